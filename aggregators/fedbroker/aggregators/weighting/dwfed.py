"""DWFed (Chen et al. 2022): weight each update by its index of statistical heterogeneity (ISH).

Workers compute D_k = EMD(p_k, P) and ISH_k from the population distribution P sent with the round
task, and report ISH_k with the update; the service only normalises (eq. 13) and range-checks what it
cannot recompute.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike

from fedbroker.aggregators.weighting.base import (
    WEIGHTING,
    UpdateMeta,
    check_max_share,
    checked_num_samples,
    normalise_weights,
)

IshForm = Literal["ratio", "one_minus"]
ISH_FORMS: tuple[str, ...] = ("ratio", "one_minus")

_TOL = 1e-9
# The smallest ISH each form can produce (D = 2, K = 1); anything below it, or above 1 (D = 0), was not
# computed by eq. 12 and is rejected.
_ISH_FLOOR = {"ratio": (1.0 - 2.0) / 3.0, "one_minus": 1.0 - 2.0 / 3.0}


def _counts(histogram: ArrayLike, what: str) -> np.ndarray:
    h = np.asarray(histogram, dtype=np.float64)
    if h.ndim != 1 or h.size == 0:
        raise ValueError(f"{what} must be a non-empty 1-D array of label counts, got shape {h.shape}")
    if not np.all(np.isfinite(h)) or np.any(h < 0):
        raise ValueError(f"{what} must hold finite counts >= 0")
    return h


def label_distribution(histogram: ArrayLike) -> np.ndarray:
    """p(y = i) from one worker's label counts (in the label order the coordinator fixed)."""
    h = _counts(histogram, "histogram")
    total = h.sum()
    if total <= 0:
        raise ValueError("histogram has no samples; its label distribution is undefined")
    shares: np.ndarray = h / total
    return shares


def population_distribution(histograms: Sequence[ArrayLike]) -> np.ndarray:
    """P over all registered workers: their label counts pooled, so big workers count for more."""
    if len(histograms) == 0:
        raise ValueError("population_distribution needs at least one histogram")
    arrays = [_counts(h, f"histogram {i}") for i, h in enumerate(histograms)]
    sizes = {a.size for a in arrays}
    if len(sizes) != 1:
        raise ValueError(f"histograms must all have the same number of labels, got sizes {sorted(sizes)}")
    return label_distribution(np.sum(arrays, axis=0))


def emd(p: ArrayLike, population: ArrayLike) -> float:
    """D = Σ_i |p(i) − P(i)| ∈ [0, 2] (eq. 7, read as the L1 distance between the two distributions)."""
    a = np.asarray(p, dtype=np.float64)
    b = np.asarray(population, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(f"p and P must be 1-D with the same length, got shapes {a.shape} and {b.shape}")
    return float(np.abs(a - b).sum())


def ish(distance: float, num_aggregated: int, form: str = "ratio") -> float:
    """ISH_k from D_k and K (eq. 12, garbled in the source; docs/algorithms.md, `dwfed`, gives both readings).

    ratio:     (1 − D/K) / (1 + D)
    one_minus: 1 − (1/K) · D / (1 + D)
    Both equal 1 at D = 0 and fall as D grows.
    """
    if form not in ISH_FORMS:
        raise ValueError(f"ish_form must be one of {', '.join(ISH_FORMS)}, got {form!r}")
    if isinstance(num_aggregated, bool) or not isinstance(num_aggregated, (int, np.integer)) or num_aggregated < 1:
        raise ValueError(f"num_aggregated (K) must be an integer >= 1, got {num_aggregated!r}")
    d = float(distance)
    if not math.isfinite(d) or d < -_TOL or d > 2.0 + _TOL:
        raise ValueError(f"distance (EMD) must lie in [0, 2], got {distance!r}")
    d = min(max(d, 0.0), 2.0)
    k = float(num_aggregated)
    if form == "ratio":
        return (1.0 - d / k) / (1.0 + d)
    return 1.0 - (d / (1.0 + d)) / k


def reported_ish(histogram: ArrayLike, population: ArrayLike, *, participants: int,
                 aggregation: Mapping[str, Any]) -> float:
    """The ISH a worker reports: EMD of its label distribution to the population P, and K the number of
    updates this round aggregates (m under `random`/`ga` selection, every participant otherwise)."""
    population = np.asarray(population, dtype=np.float64)
    counts = np.asarray(histogram, dtype=np.float64)
    counts = np.pad(counts, (0, max(0, len(population) - len(counts))))[: len(population)]
    params = aggregation.get("selection_params") or {}
    k = participants
    if aggregation.get("selection") in ("random", "ga") and "m" in params:
        k = min(k, int(params["m"]))
    form = (aggregation.get("weighting_params") or {}).get("ish_form", "ratio")
    return ish(emd(label_distribution(counts), population), max(1, k), form)


@WEIGHTING.register("dwfed")
@dataclass(frozen=True, kw_only=True)
class DWFedWeighting:
    """α_k = ISH_k / Σ ISH (eq. 13); no data-size factor, so IID workers weigh the same. With `max_share`
    < 1 no α_k exceeds it."""

    ish_form: str = "ratio"
    max_share: float = 1.0

    def __post_init__(self) -> None:
        if self.ish_form not in ISH_FORMS:
            raise ValueError(f"ish_form must be one of {', '.join(ISH_FORMS)}, got {self.ish_form!r}")
        check_max_share(self.max_share)

    @property
    def proportional(self) -> bool:
        return self.max_share >= 1.0

    def ish_for(self, distance: float, num_aggregated: int) -> float:
        """The ISH a worker should report under this job's form."""
        return ish(distance, num_aggregated, self.ish_form)

    def raw_weight(self, meta: UpdateMeta) -> float:
        """The reported ISH, range-checked; a negative one (only possible for K = 1) weighs 0."""
        checked_num_samples(meta)
        if meta.ish is None:
            raise ValueError(f"worker {meta.worker_id!r}: dwfed needs the ISH the worker reports, got none")
        value = float(meta.ish)
        floor = _ISH_FLOOR[self.ish_form]
        if not math.isfinite(value) or value > 1.0 + _TOL or value < floor - _TOL:
            raise ValueError(
                f"worker {meta.worker_id!r}: ISH {meta.ish!r} is outside [{floor:.6g}, 1], "
                f"the range of the {self.ish_form!r} form"
            )
        return min(max(value, 0.0), 1.0)

    def normalise(self, raw: np.ndarray) -> tuple[np.ndarray, bool]:
        return normalise_weights(raw, max_share=float(self.max_share))
