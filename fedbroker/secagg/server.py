"""The aggregation service's side of one SecAgg+ round: route, accumulate, unmask the sum only.

Stages, each closed by the call that moves to the next (a late call for a closed stage is refused):
  add_keys* → rosters() → add_shares* → inboxes() → exclude() → add_masked* → unmask_requests() → add_unmask*
  → finish()

U1 advertised keys, U2 ⊆ U1 sent their shares, less those `exclude` names (their shares failed at a recipient,
who opens its inbox before it trains), U3 ⊆ U2 sent a masked input (survivors), the rest of U2 dropped.
Each share message carries its dealer's commitments to the two shares in it (`crypto.commitment`): a
revealed share that does not match is refused naming its revealer (`Dishonest`), so a survivor cannot shift
the sum by lying about a share. The service keeps the running sum of masked inputs mod R and never any single one; the sealed
shares it routes are opaque to it. After unmasking it holds Σ_{i∈U3} q(w_i·x_i) and nothing finer.

A distributed-DP round (`ddp`) sums signed integers instead (each worker's γ-scaled gradient sum plus its Skellam
share, already in the ring): the masks cancel the same way, and `finish` reads the sum signed, mod 2^bits, over γ
(`ddp_sum`); the offset quantiser's path is untouched.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from numpy.typing import NDArray

from fedbroker.secagg import shamir
from fedbroker.secagg.client import check_round_seed
from fedbroker.secagg.crypto import (
    PublicKeys,
    agree,
    commitment,
    neighbour_graph,
    prg,
    prg_scratch,
    public_bytes,
    split_sealed,
)
from fedbroker.secagg.errors import Dishonest, SecAggError, ShareMismatch, TooFewSurvivors
from fedbroker.secagg.params import SecAggParams, dequantise_sum, mask_ring, sum_error_bound
from fedbroker.secagg.skellam import DDPRound, dequantise, from_ring

_STAGES = ("keys", "shares", "verify", "masked", "unmask", "finished")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[SecAggServer, _P], _R]) -> Callable[Concatenate[SecAggServer, _P], _R]:
    """One call at a time: a service's handler threads may add masked inputs concurrently."""
    @functools.wraps(method)
    def call(self: SecAggServer, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)
    return call


@dataclass(frozen=True)
class UnmaskRequest:
    """What the service asks one survivor for: b-shares of `survivors`, s-shares of `dropped`."""

    survivors: frozenset[str]
    dropped: frozenset[str]


@dataclass(frozen=True)
class SecAggResult:
    """The unmasked round: Σ_{i∈survivors} w_i·x_i (quantised), who is in it, and its error bound."""

    total: NDArray[np.float64]
    survivors: tuple[str, ...]
    dropped: tuple[str, ...]
    error_max: float  # per coordinate, worst case
    error_std: float  # per coordinate, standard-deviation bound


class SecAggServer:
    """One round's service state: keys, routed ciphertexts, a running masked sum, then unmask shares."""

    def __init__(self, params: SecAggParams, round_seed: bytes, *, length: int | None = None,
                 ddp: DDPRound | None = None) -> None:
        """`length`: the input's size when known ahead (else the first masked input fixes it). `ddp`: a
        distributed-DP round, whose inputs are signed integers (scaled, rounded and noised by each worker) in
        the ring of `params.bits`: its sum is read back signed, mod 2^bits (`finish`), not by the offset
        quantiser."""
        self.params = params
        self.ddp = ddp
        self.round_seed = check_round_seed(round_seed)
        self.length = length
        self._stage = 0
        self._keys: dict[str, PublicKeys] = {}
        self._graph: dict[str, frozenset[str]] = {}
        self._inboxes: dict[str, dict[str, bytes]] = {}  # receiver → sender → sealed shares
        self._commitments: dict[tuple[str, str], tuple[bytes, bytes]] = {}  # (dealer, holder) → (b, s) commitments
        self._sent: set[str] = set()  # U2
        self._masked: set[str] = set()  # U3 so far
        self._sum: NDArray[np.unsignedinteger[Any]] | None = None
        self._requests: dict[str, UnmaskRequest] = {}
        self._replies: dict[str, dict[str, bytes]] = {}  # replier → owner → share (revealed by design)
        self._lock = threading.Lock()

    def _in_stage(self, stage: str, call: str) -> None:
        if _STAGES[self._stage] != stage:
            raise SecAggError(f"{call} refused: the round is in stage {_STAGES[self._stage]!r}, not {stage!r}")

    def _close(self, stage: str, call: str) -> None:
        self._in_stage(stage, call)
        self._stage += 1

    @_locked
    def add_keys(self, worker_id: str, keys: PublicKeys) -> None:
        """Record a worker's advertised keys (U1)."""
        self._in_stage("keys", f"keys from {worker_id!r}")
        if worker_id in self._keys:
            raise SecAggError(f"worker {worker_id!r} advertised keys twice")
        if len(self._keys) >= self.params.n_max:
            raise SecAggError(f"worker {worker_id!r} would exceed n_max={self.params.n_max}")
        self._keys[worker_id] = keys

    @_locked
    def rosters(self) -> dict[str, dict[str, PublicKeys]]:
        """Close advertising; each worker's neighbours' keys. Refused if any secret could never be rebuilt."""
        self._close("keys", "rosters")
        if len(self._keys) < self.params.threshold:
            raise TooFewSurvivors(f"{len(self._keys)} workers advertised keys, the threshold is "
                                  f"{self.params.threshold}")
        self._graph = neighbour_graph(list(self._keys), self.params.neighbours, self.round_seed)
        return {i: {j: self._keys[j] for j in sorted(nbrs)} for i, nbrs in self._graph.items()}

    @_locked
    def add_shares(self, worker_id: str, ciphertexts: Mapping[str, bytes]) -> None:
        """Record a worker's sealed shares (U2), one per neighbour, for routing."""
        self._in_stage("shares", f"shares from {worker_id!r}")
        if worker_id not in self._graph:
            raise SecAggError(f"shares from unknown worker {worker_id!r}")
        if worker_id in self._sent:
            raise SecAggError(f"worker {worker_id!r} sent its shares twice")
        if set(ciphertexts) != set(self._graph[worker_id]):
            missing = sorted(self._graph[worker_id] - set(ciphertexts))
            extra = sorted(set(ciphertexts) - self._graph[worker_id])
            raise SecAggError(f"worker {worker_id!r}: shares must go to exactly its neighbours "
                              f"(missing {missing}, not neighbours {extra})")
        split = {receiver: split_sealed(bytes(message), share_bytes=shamir.SHARE_BYTES, sender=worker_id)
                 for receiver, message in ciphertexts.items()}  # a wrong size is refused before anything is kept
        for receiver, message in ciphertexts.items():
            self._inboxes.setdefault(receiver, {})[worker_id] = bytes(message)
            self._commitments[worker_id, receiver] = split[receiver][:2]
        self._sent.add(worker_id)

    @_locked
    def inboxes(self) -> dict[str, dict[str, bytes]]:
        """Close sharing; for each worker that shared, the sealed shares its neighbours sent it.

        A worker's inbox names exactly the peers it will mask with (its neighbours in U2).
        """
        self._close("shares", "inboxes")
        if len(self._sent) < self.params.threshold:
            raise TooFewSurvivors(f"{len(self._sent)} workers shared keys, the threshold is {self.params.threshold}")
        self._inboxes = {i: {j: ct for j, ct in sorted(self._inboxes.get(i, {}).items()) if j in self._sent}
                         for i in sorted(self._sent)}
        return {i: dict(box) for i, box in self._inboxes.items()}

    @_locked
    def exclude(self, workers: Collection[str]) -> None:
        """Close verification: `workers` leave U2 before anyone masks (their shares failed at a recipient, or
        they did not confirm their inbox). Refused (TooFewSurvivors) when some remaining worker's secrets then
        have fewer than t holders left: the round could not be unmasked even if everyone uploaded, so nobody
        should train for it."""
        self._close("verify", "exclude")
        self._sent -= set(workers)
        self._inboxes = {i: {j: m for j, m in box.items() if j in self._sent}
                         for i, box in self._inboxes.items() if i in self._sent}
        if len(self._sent) < self.params.threshold:
            raise TooFewSurvivors(f"{len(self._sent)} workers remain after verification, the threshold is "
                                  f"{self.params.threshold}")
        for i in sorted(self._sent):
            near = self._sent & (self._graph[i] | {i})
            if len(near) < self.params.threshold:
                raise TooFewSurvivors(f"worker {i!r} has {len(near)} holders of its shares left after verification, "
                                      f"the threshold is {self.params.threshold}")

    @_locked
    def add_masked(self, worker_id: str, masked: NDArray[np.unsignedinteger[Any]]) -> None:
        """Fold one masked input into the running sum mod R (the input itself is not kept)."""
        self._in_stage("masked", f"masked input from {worker_id!r}")
        if worker_id not in self._sent:
            raise SecAggError(f"masked input from {worker_id!r}, which did not share keys this round")
        if worker_id in self._masked:
            raise SecAggError(f"worker {worker_id!r} sent its masked input twice")
        y = np.asarray(masked)
        if y.dtype != np.dtype(self.params.dtype) or y.ndim != 1:
            raise SecAggError(f"masked input from {worker_id!r} must be a flat {np.dtype(self.params.dtype)} "
                              f"vector, got {y.dtype} of shape {y.shape}")
        if self.length is None:
            self.length = y.shape[0]
        if y.shape[0] != self.length:
            raise SecAggError(f"masked input from {worker_id!r} has {y.shape[0]} values, expected {self.length}")
        if self._sum is None:
            self._sum = y.copy()
        else:
            self._sum += y
        self._masked.add(worker_id)

    @_locked
    def unmask_requests(self) -> dict[str, UnmaskRequest]:
        """Close masking: survivors are U3, dropped are U2 − U3; what each survivor is asked for."""
        self._close("masked", "unmask_requests")
        survivors = frozenset(self._masked)
        if len(survivors) < self.params.threshold:
            raise TooFewSurvivors(f"{len(survivors)} masked inputs arrived, the threshold is {self.params.threshold}")
        dropped = frozenset(self._sent - survivors)
        for i in sorted(self._sent):  # a survivor's b_i is held by itself and its neighbours, a dropped s_j by its neighbours
            near = survivors & (self._graph[i] | {i})
            if len(near) < self.params.threshold:
                raise TooFewSurvivors(f"worker {i!r} has {len(near)} survivors among the holders of its shares, "
                                      f"the threshold is {self.params.threshold}")
        self._requests = {i: UnmaskRequest(survivors=survivors & (self._graph[i] | {i}),
                                           dropped=dropped & self._graph[i]) for i in sorted(survivors)}
        self._inboxes.clear()  # routed and used: nothing more to hand out
        return dict(self._requests)

    @_locked
    def add_unmask(self, worker_id: str, shares: Mapping[str, bytes]) -> None:
        """Record a survivor's revealed shares; each must be one the request asked this worker for."""
        self._in_stage("unmask", f"unmask reply from {worker_id!r}")
        request = self._requests.get(worker_id)
        if request is None:
            raise SecAggError(f"unmask reply from {worker_id!r}, which is not a survivor")
        if worker_id in self._replies:
            raise SecAggError(f"worker {worker_id!r} sent its unmask reply twice")
        asked = request.survivors | request.dropped
        extra = sorted(set(shares) - asked)
        if extra:
            raise SecAggError(f"unmask reply from {worker_id!r} holds shares nobody asked for: {extra}")
        for owner, share in shares.items():
            try:
                shamir.decode_share(share)
            except ShareMismatch as exc:
                raise Dishonest(worker_id, f"unmask reply from {worker_id!r}, share of {owner!r}: {exc}") from exc
            if owner == worker_id:  # its own share of its own secret: as good as its own input, uncommitted
                continue
            committed = self._commitments[owner, worker_id]
            kind = b"b" if owner in request.survivors else b"s"
            if commitment(share, round_seed=self.round_seed, dealer=owner, holder=worker_id,
                          kind=kind) != committed[kind == b"s"]:
                raise Dishonest(worker_id, f"unmask reply from {worker_id!r}: its share of {owner!r} is not the one "
                                           f"{owner!r} dealt it (it does not match the dealer's commitment)")
        self._replies[worker_id] = dict(shares)

    def _shares_of(self, owner: str) -> dict[str, int]:
        return {holder: shamir.decode_share(reply[owner]) for holder, reply in self._replies.items() if owner in reply}

    def _rebuild(self, owner: str, kind: str) -> bytes:
        shares = self._shares_of(owner)
        try:
            return shamir.reconstruct(shares, self.params.threshold)
        except TooFewSurvivors as exc:
            raise TooFewSurvivors(f"{kind} of worker {owner!r}: {exc}") from exc
        except ShareMismatch as exc:
            raise ShareMismatch(f"{kind} of worker {owner!r}: {exc}") from exc

    @_locked
    def finish(self) -> SecAggResult:
        """Rebuild the secrets, strip every mask from the running sum, and dequantise it."""
        self._close("unmask", "finish")
        if self._sum is None:
            raise TooFewSurvivors("no masked input arrived")
        survivors = sorted(self._masked)
        dropped = sorted(self._sent - self._masked)
        bits, length = self.params.bits, self._sum.shape[0]
        total, scratch = self._sum, prg_scratch(length, bits)
        for i in survivors:
            total -= prg(self._rebuild(i, "self-mask seed b"), length, bits, scratch=scratch)
        for j in dropped:
            s_key = X25519PrivateKey.from_private_bytes(self._rebuild(j, "mask key s"))
            if public_bytes(s_key) != self._keys[j].s_pk:
                raise ShareMismatch(f"the rebuilt mask key of worker {j!r} does not match its advertised s_pk")
            for i in sorted(self._graph[j] & self._masked):
                mask = prg(agree(s_key, self._keys[i].s_pk, self.round_seed, b"mask"), length, bits, scratch=scratch)
                if i < j:  # i added +PRG(s_ij) for the higher-id peer j: take it back
                    total -= mask
                else:
                    total += mask
        mask_ring(total, bits)
        self._sum = None
        self._replies.clear()
        if self.ddp is not None:
            clear, (worst, std) = ddp_sum(total, self.ddp, len(survivors))
        else:
            clear = dequantise_sum(total, len(survivors), self.params)
            worst, std = sum_error_bound(self.params, len(survivors))
        return SecAggResult(total=clear, survivors=tuple(survivors), dropped=tuple(dropped), error_max=worst,
                            error_std=std)


def ddp_sum(ring_sum: NDArray[np.unsignedinteger[Any]], ddp: DDPRound,
            n_summed: int) -> tuple[NDArray[np.float64], tuple[float, float]]:
    """A distributed-DP round's unmasked sum in gradient units, and its rounding error bounds per coordinate.

    Each worker's integers are γ·g_i stochastically rounded plus its Skellam noise, so the ring sum read
    signed (`from_ring`, mod 2^bits) over γ (`dequantise`) is Σ g_i + noise/γ, exactly unless a coordinate
    wrapped (the round's wrap bound). The rounding error per term is below 1/γ (variance ≤ 1/(4γ²)); the noise
    is not an error but the mechanism, so it is not in the bounds."""
    clear = dequantise(from_ring(ring_sum, bits=ddp.bits), scale=ddp.scale)
    return clear, (n_summed / ddp.scale, math.sqrt(n_summed) / (2.0 * ddp.scale))
