"""Buffered asynchronous aggregation (FedBuff, Nguyen et al. AISTATS 2022) with FedAsync's staleness
functions (Xie et al. 2019): pure arithmetic over numpy arrays, no I/O.

The service holds the global model x_t at version t. A worker trained from version τ_k returns x_k; its
delta is Δ_k = x_k − x_{τ_k}. A buffer of `buffer_size` accepted updates, when full, gives

    Δ̄ = Σ_k (w_k / Σ_j w_j) · s(t − τ_k) · Δ_k,        x_{t+1} = x_t + η_g · Δ̄

with w_k the job's weighting (sample counts or DWFed ISH) and η_g the server learning rate. The
staleness factor scales each delta but is not part of the normalisation, so stale updates shrink the
step instead of re-weighting the fresh ones up. With every τ = 0, s = constant, η_g = 1 and the buffer
as large as the round, one version is exactly synchronous FedAvg of the same updates.

An update with τ > `max_staleness` is refused (`StaleUpdate`) before it touches the buffer.

Memory: one float64 accumulator per tensor (Σ w·s·Δ) and a scalar Σ w, whatever the buffer size, so a
buffer rebuilt by replaying its accepted updates in order (a restarted service) sums the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from fedbroker.algorithms.params import Staleness

__all__ = ["Buffer", "StaleUpdate", "fedbuff_version"]

MAX_STALENESS_LIMIT = 1000   # versions; each one kept costs the service a model's memory


class StaleUpdate(ValueError):
    """An update whose base version is more than `max_staleness` versions behind."""

    def __init__(self, tau: int, max_staleness: int) -> None:
        super().__init__(f"update is {tau} version(s) stale, more than max_staleness {max_staleness}")
        self.tau = tau
        self.max_staleness = max_staleness


@dataclass
class Buffer:
    """The updates accepted since the last version, folded as they arrive: Σ w·s(τ)·Δ and Σ w."""

    buffer_size: int
    max_staleness: int
    staleness: Staleness = field(default_factory=Staleness)
    server_lr: float = 1.0
    count: int = 0
    total_weight: float = 0.0
    _sum: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {self.buffer_size}")
        if not 0 <= self.max_staleness <= MAX_STALENESS_LIMIT:
            raise ValueError(f"max_staleness must be in [0, {MAX_STALENESS_LIMIT}], got {self.max_staleness}")
        if not (math.isfinite(self.server_lr) and self.server_lr > 0):
            raise ValueError(f"server_lr must be a positive number, got {self.server_lr}")

    @property
    def full(self) -> bool:
        """Whether the buffer holds `buffer_size` updates: time for the next version."""
        return self.count >= self.buffer_size

    def check(self, tau: int) -> float:
        """The staleness factor of an update τ versions behind; StaleUpdate past `max_staleness`."""
        if tau > self.max_staleness:
            raise StaleUpdate(tau, self.max_staleness)
        return self.staleness(tau)

    def add(self, update: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray], *, weight: float,
            tau: int) -> float:
        """Fold x_k − x_{τ_k} in with weight w_k·s(τ); returns s(τ). A stale update raises before anything
        changes, and so does a weight that is not positive or an update of other tensors than its base."""
        factor = self.check(tau)
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"an update's weight must be positive, got {weight}")
        if update.keys() != base.keys() or any(np.shape(update[n]) != np.shape(base[n]) for n in base):
            raise ValueError("the update's tensors differ from its base version's")
        scale = weight * factor
        if not self._sum:
            self._sum = {name: np.zeros(np.shape(arr), dtype=np.float64) for name, arr in base.items()}
        for name, arr in update.items():
            self._sum[name] += scale * (np.asarray(arr, dtype=np.float64) - np.asarray(base[name], dtype=np.float64))
        self.count += 1
        self.total_weight += weight
        return factor

    def apply(self, current: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """x_{t+1} = x_t + η_g · Σ_k (w_k / Σ w) s(τ_k) Δ_k as float32; the buffer itself is left as it is."""
        if self.count == 0 or self.total_weight <= 0:
            raise ValueError("the buffer holds no update")
        step = self.server_lr / self.total_weight
        return {name: (np.asarray(arr, dtype=np.float64) + step * self._sum[name]).astype(np.float32)
                for name, arr in current.items()}

    def reset(self) -> None:
        """Empty the buffer for the next version."""
        self.count, self.total_weight, self._sum = 0, 0.0, {}


def fedbuff_version(current: Mapping[str, np.ndarray], updates: list[tuple[Mapping[str, np.ndarray],
                    Mapping[str, np.ndarray], float, int]], *, staleness: Staleness, server_lr: float = 1.0,
                    max_staleness: int = MAX_STALENESS_LIMIT) -> dict[str, np.ndarray]:
    """One version from (update, its base version, weight, τ) tuples at once: what a full Buffer gives."""
    buffer = Buffer(buffer_size=max(1, len(updates)), max_staleness=max_staleness, staleness=staleness,
                    server_lr=server_lr)
    for update, base, weight, tau in updates:
        buffer.add(update, base, weight=weight, tau=tau)
    return buffer.apply(current)
