"""The weighting interface: one unnormalised weight per update, normalised once at the end of a round.

The service folds updates in one at a time (Σ w·x and Σ w), so a raw weight may depend only on its own
update's metadata, never on the other updates of the round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from fedbroker.aggregators.registry import Registry


@dataclass(frozen=True)
class UpdateMeta:
    """What the service knows about one update besides its parameters."""

    worker_id: str
    num_samples: int
    ish: float | None = None
    loss: float | None = None


class Weighting(Protocol):
    def raw_weight(self, meta: UpdateMeta) -> float: ...

    def normalise(self, raw: np.ndarray) -> tuple[np.ndarray, bool]: ...


WEIGHTING: Registry[Weighting] = Registry("weighting")


def checked_num_samples(meta: UpdateMeta) -> int:
    """The update's sample count; a negative or non-integer count means the update is inconsistent."""
    n = meta.num_samples
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise ValueError(f"worker {meta.worker_id!r}: num_samples must be an integer, got {n!r}")
    if n < 0:
        raise ValueError(f"worker {meta.worker_id!r}: num_samples must be >= 0, got {n}")
    return int(n)


def normalise_weights(raw: np.ndarray) -> tuple[np.ndarray, bool]:
    """Weights that sum to 1, and whether they fell back to uniform because Σ raw <= 0.

    A zero total (every update weighted 0, e.g. all sample counts 0) still has to give a model, and
    uniform is the only choice that favours nobody; the flag lets the service say so in a metric.
    """
    w = np.asarray(raw, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError(f"raw weights must be a non-empty 1-D array, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError("raw weights must be finite")
    if np.any(w < 0):
        raise ValueError("raw weights must be >= 0")
    total = float(w.sum())
    if total <= 0.0 or not math.isfinite(total):
        return np.full(w.size, 1.0 / w.size), True
    return w / total, False
