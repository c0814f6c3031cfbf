"""A worker's side of one SecAgg+ round: advertise keys, share secrets, mask the input, help unmask.

Each step may run once and only in order; the object refuses anything else, so a service that asks
twice (hoping for both shares of one peer) gets an error, not a second answer.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from numpy.typing import NDArray

from fedbroker.secagg import shamir
from fedbroker.secagg.crypto import (
    KEY_BYTES,
    PublicKeys,
    agree,
    commitment,
    open_sealed,
    prg,
    prg_scratch,
    public_bytes,
    seal,
    split_sealed,
)
from fedbroker.secagg.errors import SecAggError, TooFewSurvivors
from fedbroker.secagg.params import SecAggParams, clipped_count, mask_ring, quantise, ring_dtype

_STEPS = ("advertise", "share_keys", "open_inbox", "masked_input", "unmask", "done")
MIN_ROUND_SEED_BYTES = 16


def check_round_seed(round_seed: bytes) -> bytes:
    """The round seed as given, refused when it is not bytes or too short to bind a round."""
    if not isinstance(round_seed, bytes) or len(round_seed) < MIN_ROUND_SEED_BYTES:
        raise SecAggError(f"the round seed must be at least {MIN_ROUND_SEED_BYTES} bytes")
    return round_seed


class SecAggClient:
    """One worker in one round. `rng` drives only the stochastic rounding; every secret (key pairs, b_i,
    Shamir coefficients, nonces) comes from the OS CSPRNG, never from a seeded generator."""

    def __init__(self, worker_id: str, params: SecAggParams, round_seed: bytes, rng: np.random.Generator) -> None:
        """Draw the round's two key pairs and the self-mask seed b_i."""
        self.worker_id = worker_id
        self.params = params
        self.round_seed = check_round_seed(round_seed)
        self._rng = rng
        self._c_key = X25519PrivateKey.generate()
        self._s_key = X25519PrivateKey.generate()
        self._b_seed = os.urandom(KEY_BYTES)
        self._step = 0
        self._roster: dict[str, PublicKeys] = {}
        self._opened: set[str] = set()  # the senders whose shares opened and matched their commitments
        self._failed: set[str] = set()  # the senders whose shares did not
        self._held: dict[str, tuple[int, int]] = {}  # owner → (share of b_owner, share of s_owner^SK)
        self.clipped = 0  # coordinates of the last input outside [−B, B]

    def _advance(self, step: str) -> None:
        expected = _STEPS[self._step]
        if step != expected:
            raise SecAggError(f"worker {self.worker_id!r}: {step} asked while the next step is {expected}")
        self._step += 1

    def advertise(self) -> PublicKeys:
        """Step 0: the two public keys the service forwards to this worker's neighbours."""
        self._advance("advertise")
        return PublicKeys(c_pk=public_bytes(self._c_key), s_pk=public_bytes(self._s_key))

    def share_keys(self, roster: Mapping[str, PublicKeys]) -> dict[str, bytes]:
        """Step 1: shares of b_i and s_i^SK for each neighbour in `roster`, each sealed for that neighbour.

        The roster is this worker's neighbours' keys (this worker's own entry, if present, is ignored).
        The worker keeps its own share of both secrets; shares go to the neighbours and itself, any t of
        which rebuild a secret.
        """
        self._advance("share_keys")
        roster = {peer: keys for peer, keys in roster.items() if peer != self.worker_id}
        holders = [self.worker_id, *sorted(roster)]
        if len(holders) < self.params.threshold:
            raise TooFewSurvivors(f"worker {self.worker_id!r}: {len(roster)} neighbours and itself are fewer "
                                  f"than the threshold {self.params.threshold}")
        keys = [k.s_pk for k in roster.values()] + [k.c_pk for k in roster.values()]
        if len(set(keys)) != len(keys):
            raise SecAggError(f"worker {self.worker_id!r}: the roster repeats a public key")
        self._roster = dict(roster)
        b_shares = shamir.split(self._b_seed, holders, self.params.threshold)
        s_shares = shamir.split(self._s_key.private_bytes_raw(), holders, self.params.threshold)
        self._held[self.worker_id] = (b_shares[self.worker_id], s_shares[self.worker_id])
        out = {}
        for peer, peer_keys in roster.items():
            key = agree(self._c_key, peer_keys.c_pk, self.round_seed, b"share key")
            b, s = shamir.encode_share(b_shares[peer]), shamir.encode_share(s_shares[peer])
            commitments = (commitment(b, round_seed=self.round_seed, dealer=self.worker_id, holder=peer, kind=b"b")
                           + commitment(s, round_seed=self.round_seed, dealer=self.worker_id, holder=peer, kind=b"s"))
            out[peer] = commitments + seal(key, b + s, round_seed=self.round_seed, sender=self.worker_id,
                                           receiver=peer)
        return out

    def open_inbox(self, inbox: Mapping[str, bytes]) -> dict[str, str]:
        """Step 2, before training: open the shares each neighbour sealed for this worker and check them
        against the dealer's commitments. Returns the senders whose shares fail, each with why; the service
        excludes them (named) before anyone trains, so a garbled share costs no honest site ε."""
        self._advance("open_inbox")
        unknown = sorted(set(inbox) - set(self._roster))
        if unknown:
            raise SecAggError(f"worker {self.worker_id!r}: shares from non-neighbours {unknown}")
        failed = {}
        for sender, message in sorted(inbox.items()):
            try:
                self._held[sender] = self._open_one(sender, message)
                self._opened.add(sender)
            except SecAggError as exc:
                failed[sender] = str(exc)
        self._failed = set(failed)
        return failed

    def _open_one(self, sender: str, message: bytes) -> tuple[int, int]:
        size = shamir.SHARE_BYTES
        b_commit, s_commit, sealed = split_sealed(message, share_bytes=size, sender=sender)
        key = agree(self._c_key, self._roster[sender].c_pk, self.round_seed, b"share key")
        plaintext = open_sealed(key, sealed, round_seed=self.round_seed, sender=sender, receiver=self.worker_id)
        b, s = plaintext[:size], plaintext[size:]
        if len(plaintext) != 2 * size:
            raise SecAggError(f"the share message from {sender!r} has a wrong length")
        seed, me = self.round_seed, self.worker_id
        if (commitment(b, round_seed=seed, dealer=sender, holder=me, kind=b"b") != b_commit
                or commitment(s, round_seed=seed, dealer=sender, holder=me, kind=b"s") != s_commit):
            raise SecAggError(f"the shares {sender!r} sealed for {me!r} do not match its published commitments")
        return shamir.decode_share(b), shamir.decode_share(s)

    def masked_input(self, vector: NDArray[np.floating[Any]], excluded: Collection[str] = ()) -> NDArray[np.unsignedinteger[Any]]:
        """Step 3: y_i = q(x_i) + PRG(b_i) + Σ_{j>i} PRG(s_ij) − Σ_{j<i} PRG(s_ij) (mod R).

        `vector` is this worker's update already multiplied by its weight. This worker masks pairwise with
        the senders its inbox held less `excluded` (the service's verdict after every holder opened its
        inbox: the set the service derives the same way). A sender whose shares failed here must be among
        them, else this worker's masks would not cancel.
        """
        self._advance("masked_input")
        kept = self._mask_peers(excluded)
        y = quantise(vector, self.params, self._rng)
        self.clipped = clipped_count(vector, self.params)
        return self._add_masks(y, kept, self.params.bits)

    def masked_integers(self, levels: NDArray[np.unsignedinteger[Any]], excluded: Collection[str] = (), *,
                        bits: int | None = None) -> NDArray[np.unsignedinteger[Any]]:
        """Step 3 for an input already in the ring (distributed DP: the worker quantised its gradient sum and added
        its noise itself): y_i = levels + the same masks as `masked_input` (mod 2^bits).

        `bits`: the ring `levels` live in (default the round's); the masks cancel in any ring, so the service
        unmasks with the same bits. Nothing is clipped or rounded here: the caller already did."""
        ring = self.params.bits if bits is None else bits
        if not 8 <= ring <= 64:
            raise SecAggError(f"worker {self.worker_id!r}: a ring of {ring} bits (8..64 only)")
        values = np.asarray(levels)
        if values.ndim != 1 or values.dtype != ring_dtype(ring):
            raise SecAggError(f"worker {self.worker_id!r}: the input must be a flat {ring_dtype(ring).__name__} "
                              f"vector of the 2^{ring} ring, got {values.dtype} {values.shape}")
        if ring not in (32, 64) and values.size and int(values.max()) >> ring:
            raise SecAggError(f"worker {self.worker_id!r}: the input holds values outside the 2^{ring} ring")
        self._advance("masked_input")
        kept = self._mask_peers(excluded)
        self.clipped = 0
        return self._add_masks(values.copy(), kept, ring)

    def _mask_peers(self, excluded: Collection[str]) -> list[str]:
        """The peers to mask with (the opened ones less `excluded`); refuses a failed sender left in."""
        gone = set(excluded)
        kept = sorted(self._opened - gone)
        unexcluded = sorted(self._failed - gone)
        if unexcluded:
            raise SecAggError(f"worker {self.worker_id!r}: the service did not exclude {unexcluded}, whose shares "
                              f"failed here; masking with them would not cancel")
        for peer in gone:
            self._held.pop(peer, None)
        return kept

    def _add_masks(self, y: NDArray[np.unsignedinteger[Any]], kept: list[str],
                   bits: int) -> NDArray[np.unsignedinteger[Any]]:
        """y + PRG(b_i) ± the pairwise masks with `kept`, in the ring of `bits`."""
        length = y.shape[0]
        scratch = prg_scratch(length, bits)
        y += prg(self._b_seed, length, bits, scratch=scratch)
        for peer in kept:
            seed = agree(self._s_key, self._roster[peer].s_pk, self.round_seed, b"mask")
            mask = prg(seed, length, bits, scratch=scratch)
            if self.worker_id < peer:
                y += mask
            else:
                y -= mask
        return mask_ring(y, bits)

    def unmask(self, survivors: Collection[str], dropped: Collection[str]) -> dict[str, bytes]:
        """Step 3: the share of b_j for each surviving j and of s_j^SK for each dropped j this worker holds.

        Refuses (once asked, never again) when a peer is named both survivor and dropped, when this worker
        is not among the survivors, or when fewer than t of its neighbourhood (itself included) survived:
        each of those would let the service learn more than the sum.
        """
        self._advance("unmask")
        alive, gone = set(survivors), set(dropped)
        both = sorted(alive & gone)
        if both:
            raise SecAggError(f"worker {self.worker_id!r}: {both} named both survivor and dropped; "
                              f"revealing both shares would unmask an individual input")
        if self.worker_id not in alive:
            raise SecAggError(f"worker {self.worker_id!r}: asked to unmask but not listed as a survivor")
        near = alive & (set(self._roster) | {self.worker_id})
        if len(near) < self.params.threshold:
            raise TooFewSurvivors(f"worker {self.worker_id!r}: {len(near)} survivors in its neighbourhood, "
                                  f"the threshold is {self.params.threshold}")
        out = {}
        for owner, (b_share, s_share) in self._held.items():
            if owner in alive:
                out[owner] = shamir.encode_share(b_share)
            elif owner in gone:
                out[owner] = shamir.encode_share(s_share)
        self._held.clear()
        return out
