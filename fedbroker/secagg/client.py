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
from fedbroker.secagg.crypto import KEY_BYTES, PublicKeys, agree, open_sealed, prg, prg_scratch, public_bytes, seal
from fedbroker.secagg.errors import SecAggError, TooFewSurvivors
from fedbroker.secagg.params import SecAggParams, clipped_count, mask_ring, quantise

_STEPS = ("advertise", "share_keys", "masked_input", "unmask", "done")
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
            plaintext = shamir.encode_share(b_shares[peer]) + shamir.encode_share(s_shares[peer])
            out[peer] = seal(key, plaintext, round_seed=self.round_seed, sender=self.worker_id, receiver=peer)
        return out

    def masked_input(self, vector: NDArray[np.floating[Any]], inbox: Mapping[str, bytes]) -> NDArray[np.unsignedinteger[Any]]:
        """Step 2: y_i = q(x_i) + PRG(b_i) + Σ_{j>i} PRG(s_ij) − Σ_{j<i} PRG(s_ij) (mod R).

        `vector` is this worker's update already multiplied by its weight; `inbox` holds the sealed
        shares its neighbours sent (those that reached the service). This worker masks pairwise with
        exactly those senders, the set the service derives the same way.
        """
        self._advance("masked_input")
        unknown = sorted(set(inbox) - set(self._roster))
        if unknown:
            raise SecAggError(f"worker {self.worker_id!r}: shares from non-neighbours {unknown}")
        for sender, ciphertext in inbox.items():
            key = agree(self._c_key, self._roster[sender].c_pk, self.round_seed, b"share key")
            plaintext = open_sealed(key, ciphertext, round_seed=self.round_seed, sender=sender,
                                    receiver=self.worker_id)
            if len(plaintext) != 2 * shamir.SHARE_BYTES:
                raise SecAggError(f"worker {self.worker_id!r}: the share message from {sender!r} has a wrong length")
            self._held[sender] = (shamir.decode_share(plaintext[:shamir.SHARE_BYTES]),
                                  shamir.decode_share(plaintext[shamir.SHARE_BYTES:]))
        y = quantise(vector, self.params, self._rng)
        self.clipped = clipped_count(vector, self.params)
        bits, length = self.params.bits, y.shape[0]
        scratch = prg_scratch(length, bits)
        y += prg(self._b_seed, length, bits, scratch=scratch)
        for peer in sorted(inbox):
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
