"""What a worker tells the federation about its labels: its label histogram (noised for ε-DP when its owner
asks) and the index of statistical heterogeneity (ISH) that DWFed weights its update by.

DWFed (Chen et al. 2022): a worker computes D_k = EMD(p_k, P) of its label distribution p_k to the
population distribution P sent with the round task, and reports ISH_k with its update; the aggregation
service only normalises (eq. 13) and range-checks what it cannot recompute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from fedbroker.algorithms.catalogue import AggregationSettings
from fedbroker.algorithms.params import ISH_FORMS

_TOL = 1e-9


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
                 settings: AggregationSettings) -> float:
    """The ISH a worker reports: EMD of its label distribution to the population P, K the number of updates
    this round aggregates (m under a selection that chooses m, every participant otherwise), in the form
    of the job's weighting."""
    population = np.asarray(population, dtype=np.float64)
    counts = np.asarray(histogram, dtype=np.float64)
    counts = np.pad(counts, (0, max(0, len(population) - len(counts))))[: len(population)]
    return ish(emd(label_distribution(counts), population), settings.aggregated(participants),
               settings.weighting.params.reported_ish_form)


def noisy_histogram(histogram: ArrayLike, *, epsilon: float | None, rng: np.random.Generator) -> np.ndarray:
    """The counts plus Laplace(1/ε) noise each, clipped at 0 and rounded (ε-DP).

    Sensitivity 1: adding or removing one sample changes one count by 1 (L1 distance 1). Clipping and
    rounding are post-processing, so they cost no privacy. ε = None or ∞ returns the exact counts.
    """
    h = np.asarray(histogram)
    if h.ndim != 1 or h.size == 0:
        raise ValueError(f"histogram must be a non-empty 1-D array of counts, got shape {h.shape}")
    hf = h.astype(np.float64)
    if not np.all(np.isfinite(hf)) or np.any(hf < 0) or np.any(hf != np.rint(hf)):
        raise ValueError("histogram must hold integer counts >= 0")
    if epsilon is None or float(epsilon) == math.inf:
        return hf.astype(np.int64)
    eps = float(epsilon)
    if math.isnan(eps) or eps <= 0:
        raise ValueError(f"epsilon must be > 0 (or None / inf for exact counts), got {epsilon!r}")
    noisy = hf + rng.laplace(0.0, 1.0 / eps, size=hf.shape)
    return np.rint(np.maximum(noisy, 0.0)).astype(np.int64)
