"""Label histograms for data owners who will not share exact counts: the Laplace mechanism."""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike


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
