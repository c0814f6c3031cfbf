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
from fedbroker.algorithms.catalogue import WEIGHTINGS


@dataclass(frozen=True)
class UpdateMeta:
    """What the service knows about one update besides its parameters."""

    worker_id: str
    num_samples: int
    ish: float | None = None
    loss: float | None = None


class Weighting(Protocol):
    """What the service calls; every registered weighting extends its parameters' frozen kw-only dataclass
    (`fedbroker.algorithms.params`, which says whether its weights are proportional)."""

    def raw_weight(self, meta: UpdateMeta) -> float:
        """The update's weight before normalisation, from its own metadata only; ValueError if inconsistent."""

    def normalise(self, raw: np.ndarray) -> tuple[np.ndarray, bool]:
        """The round's coefficients from the chosen updates' raw weights, and whether they fell back to uniform."""


WEIGHTING: Registry[Weighting] = Registry(WEIGHTINGS)


def checked_num_samples(meta: UpdateMeta) -> int:
    """The update's sample count; a negative or non-integer count means the update is inconsistent."""
    n = meta.num_samples
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise ValueError(f"worker {meta.worker_id!r}: num_samples must be an integer, got {n!r}")
    if n < 0:
        raise ValueError(f"worker {meta.worker_id!r}: num_samples must be >= 0, got {n}")
    return int(n)


def cap_shares(weights: np.ndarray, max_share: float) -> np.ndarray:
    """Weights summing to 1 with none above `max_share`: the capped ones are set to the cap and the rest
    rescaled in proportion (repeated until none exceeds it), so one update, whatever it claims, moves the
    model by at most that share. When fewer than 1/max_share updates are aggregated the cap cannot hold and
    the weights are uniform (the fairest split there is); mass left over for updates weighted 0 is shared
    equally among them.
    """
    w = np.asarray(weights, dtype=np.float64)
    n = w.size
    if max_share >= 1.0 or n == 0:
        return w
    if n * max_share <= 1.0:
        return np.full(n, 1.0 / n)
    capped = np.zeros(n, dtype=bool)
    while True:
        free_mass = 1.0 - max_share * capped.sum()
        free_total = float(w[~capped].sum())
        out = np.full(n, max_share)
        if free_total > 0:
            out[~capped] = w[~capped] * (free_mass / free_total)
        else:
            out[~capped] = free_mass / (~capped).sum()
        over = ~capped & (out > max_share)
        if not over.any():
            return out
        capped |= over


def normalise_weights(raw: np.ndarray, *, max_share: float = 1.0) -> tuple[np.ndarray, bool]:
    """Weights that sum to 1 (none above `max_share`, see cap_shares), and whether they fell back to uniform
    because Σ raw <= 0.

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
    return cap_shares(w / total, max_share), False
