"""The robust rule interface: the round's updates Δ_i = x_i − x_global as one (n, P) array → one update Δ.

A rule sees every chosen update apart (after selection, instead of the weighted mean) and says, besides its
result, how much of it each update got (`kept_weight`), so a close can report who was discarded. Pure numpy:
no torch (FLTrust's root update g_0 is trained by the service and passed in), no grpc, no metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fedbroker.aggregators.registry import Registry
from fedbroker.aggregators.robust.memory import RobustMemory
from fedbroker.aggregators.selection import ProbeRequest
from fedbroker.algorithms.catalogue import ROBUST_RULES
from fedbroker.algorithms.robust_params import DISCARDED_BELOW, DOWNWEIGHTED_BELOW


@dataclass(frozen=True)
class RobustResult:
    """A rule's update, how much of it each input got, and numbers for the close's stats.

    `kept_weight[i]`: the weight update i got in the result on the plain mean's scale (0 = discarded). For a
    rule that combines whole updates it is the coefficient (Multi-Krum, the geometric median's final Weiszfeld
    weights, norm bounding's w_i·min(1, M/‖Δ_i‖), FLTrust's trust share); for a coordinate-wise rule it is
    the mean over coordinates of the coefficient the update got there. `expected[i]`: what the plain mean the
    rule replaces would have given it (the job's weight, or 1/n for a rule that counts every update once).
    """

    delta: np.ndarray
    kept_weight: np.ndarray
    expected: np.ndarray
    notes: dict[str, float] = field(default_factory=dict)
    memory: RobustMemory | None = None   # what the job keeps for the next round (None: nothing new)
    flagged: np.ndarray | None = None    # a boolean mask: the updates the history check flagged (and excluded)

    def was_flagged(self, i: int) -> bool:
        """Whether update i was flagged by a history check."""
        return bool(self.flagged is not None and self.flagged[i])

    def ratios(self) -> np.ndarray:
        """kept_weight / expected per update (1 where nothing was expected)."""
        return np.asarray(np.divide(self.kept_weight, self.expected, out=np.ones_like(self.kept_weight),
                                    where=self.expected > 0))

    def discarded(self) -> np.ndarray:
        """A boolean mask: the updates that got less than DISCARDED_BELOW of their share."""
        return np.asarray(self.ratios() < DISCARDED_BELOW)

    def downweighted(self) -> np.ndarray:
        """A boolean mask: the updates that kept some weight but less than DOWNWEIGHTED_BELOW of their share."""
        r = self.ratios()
        return np.asarray((r >= DISCARDED_BELOW) & (r < DOWNWEIGHTED_BELOW))


@dataclass(frozen=True)
class RobustInput:
    """One round's robust problem, as one object so every rule takes one argument; built only past the checks
    every rule needs (`check_updates`), so `deltas` is a 2-D float array of finite rows and `weights` sum to 1.

    `deltas`: the chosen updates Δ_i = x_i − x_global, one row each. `weights`: the job's coefficients, one per
    row. `rng`: seeded by the job and round (bucketing draws its permutation from it). `root_update`: FLTrust's
    g_0, trained by the service on its root set when the rule's `root_request` asked for one. `sites`: the site
    that sent each row (empty: anonymous rows, as after a pre-mix; the history check then checks nothing).
    `memory`: what the job kept from its earlier rounds (centered clipping's momentum, the history check's
    per-site history); None on a job's first robust round.
    """

    deltas: np.ndarray
    weights: np.ndarray
    rng: np.random.Generator
    root_update: np.ndarray | None = None
    sites: tuple[str, ...] = ()
    memory: RobustMemory | None = None

    def __post_init__(self) -> None:
        deltas, weights = check_updates(self.deltas, self.weights)
        object.__setattr__(self, "deltas", deltas)
        object.__setattr__(self, "weights", weights)
        if self.sites and len(self.sites) != deltas.shape[0]:
            raise ValueError(f"robust aggregation needs one site per update: {deltas.shape[0]} update(s), "
                             f"{len(self.sites)} site(s)")


@dataclass(frozen=True)
class RootRequest:
    """The root set a rule needs the service to train g_0 on, and how (FLTrust)."""

    probe: ProbeRequest
    epochs: int
    lr: float
    batch_size: int


class RobustRule(Protocol):
    """What the service calls; every registered rule extends its parameters' frozen kw-only dataclass
    (`fedbroker.algorithms.robust_params`)."""

    def root_request(self) -> RootRequest | None:
        """The root (probe) set the service must train g_0 on before `aggregate` (None: the rule needs none)."""

    def aggregate(self, problem: RobustInput) -> RobustResult:
        """The round's update from the problem's updates and the job's normalised weights."""


ROBUST: Registry[RobustRule] = Registry(ROBUST_RULES)


def check_updates(deltas: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The updates as a 2-D float array and the weights normalised to sum 1; a ValueError naming what is
    wrong (no update, a shape mismatch, a NaN or infinite update, a negative or non-finite weight)."""
    d = np.asarray(deltas)
    if d.ndim != 2 or d.shape[0] == 0:
        raise ValueError(f"robust aggregation needs a (updates, parameters) array with at least one update, "
                         f"got shape {d.shape}")
    if not np.issubdtype(d.dtype, np.floating):
        d = d.astype(np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (d.shape[0],):
        raise ValueError(f"robust aggregation needs one weight per update: {d.shape[0]} update(s), weights of "
                         f"shape {w.shape}")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"robust aggregation needs finite weights >= 0 with a positive sum, got {w.tolist()}")
    bad = np.flatnonzero(~np.isfinite(d).all(axis=1)) if d.shape[1] else np.zeros(0, dtype=np.intp)
    if bad.size:
        raise ValueError(f"update(s) at row(s) {bad.tolist()} hold NaN or infinite values; a robust rule cannot "
                         f"rank them (refuse such an upload before the close)")
    return d, w / w.sum()


def uniform(n: int) -> np.ndarray:
    """Every update counted once."""
    return np.full(n, 1.0 / n)


def combination(deltas: np.ndarray, coefficients: np.ndarray, *, chunk: int = 1 << 16) -> np.ndarray:
    """Σ_i c_i · Δ_i, computed in float64 a column block at a time (a float32 product of large finite values
    overflows to inf) without a float64 copy of the whole array."""
    c = np.asarray(coefficients, dtype=np.float64)
    out = np.zeros(deltas.shape[1])
    if not np.any(c):
        return out
    for start in range(0, deltas.shape[1], chunk):
        out[start:start + chunk] = c @ deltas[:, start:start + chunk].astype(np.float64)
    return out


def dots(deltas: np.ndarray, vector: np.ndarray, *, chunk: int = 1 << 16) -> np.ndarray:
    """Δ_i · v for every row, in float64 a column block at a time (FLTrust's Δ_i · g_0: in float32 a finite
    update of 3e38 against g_0's sign overflows, and the cosine becomes NaN)."""
    v = np.asarray(vector, dtype=np.float64)
    out = np.zeros(deltas.shape[0])
    for start in range(0, deltas.shape[1], chunk):
        out += deltas[:, start:start + chunk].astype(np.float64) @ v[start:start + chunk]
    return out


def row_norms(deltas: np.ndarray) -> np.ndarray:
    """‖Δ_i‖ for every row, accumulated in float64."""
    return np.asarray(np.sqrt(np.einsum("ij,ij->i", deltas, deltas, dtype=np.float64)))


def gram(deltas: np.ndarray, *, chunk: int = 1 << 16) -> np.ndarray:
    """G = D Dᵀ (n, n) in float64, a column block at a time so float32 updates are summed in float64 without
    a float64 copy of the whole array."""
    n, p = deltas.shape
    g = np.zeros((n, n))
    if deltas.dtype == np.float64:
        return np.asarray(deltas @ deltas.T)
    for start in range(0, p, chunk):
        block = deltas[:, start:start + chunk].astype(np.float64)
        g += block @ block.T
    return g


def squared_distances(g: np.ndarray) -> np.ndarray:
    """‖Δ_i − Δ_j‖² from the Gram matrix (clipped at 0 against rounding)."""
    d = np.diag(g)
    return np.asarray(np.maximum(d[:, None] + d[None, :] - 2.0 * g, 0.0))


def notes_with(prefix: str, values: Mapping[str, float]) -> dict[str, float]:
    """Stats names under the rule's prefix."""
    return {f"{prefix}_{k}": float(v) for k, v in values.items()}
