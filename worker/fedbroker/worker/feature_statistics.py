"""A site's per-feature sums and sums of squares, for statistics the sites agree on (`data.standardize:
federated`), released under the Gaussian mechanism.

Each sample is flattened, each feature clipped to the range the job asks for, [lower_j, upper_j], and
rescaled to [0, 1]: u_j = (clip(x_j) - lower_j) / (upper_j - lower_j). The release is the 2d-vector
(Σ u_j, Σ u_j²) over the site's training rows. Adding or removing one record moves it by that record's
(u, u²), whose L2 norm is at most sqrt(2d): the sensitivity the noise is calibrated to. The values stay in
the rescaled units; whoever combines them maps back: mean_j = lower_j + (upper_j - lower_j)·S_j/n and
var_j = (upper_j - lower_j)²·(Q_j/n - (S_j/n)²).

The noise is calibrated by the analytic Gaussian mechanism (Balle & Wang, "Improving the Gaussian Mechanism
for Differential Privacy", ICML 2018, Theorem 8): N(0, σ²) per coordinate is (ε, δ)-DP for sensitivity Δ
exactly when Φ(Δ/2σ - εσ/Δ) - e^ε Φ(-Δ/2σ - εσ/Δ) <= δ, and σ is the smallest value meeting it. The
textbook σ = Δ·sqrt(2 ln(1.25/δ))/ε holds only for ε < 1 (and is looser there).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import norm

from fedbroker.errors import FedbrokerError


class BadBounds(FedbrokerError):
    """The clipping range a request names does not fit this site's features."""

    reason = "bad_bounds"


def gaussian_delta(sigma: float, *, epsilon: float, sensitivity: float) -> float:
    """The smallest δ for which N(0, σ²) noise on a query of L2 `sensitivity` is (ε, δ)-DP (the exact
    condition of the analytic Gaussian mechanism, module docstring)."""
    a, b = sensitivity / (2.0 * sigma), epsilon * sigma / sensitivity
    # e^ε·Φ(-a-b) in logs: e^ε alone overflows for large ε where Φ(-a-b) is tiny
    return float(norm.cdf(a - b) - math.exp(epsilon + float(norm.logcdf(-a - b))))


def gaussian_sigma(*, epsilon: float, delta: float, sensitivity: float) -> float:
    """The smallest σ (to 1e-12 relative) for which `gaussian_delta(σ) <= delta`; σ scales with the
    sensitivity, so the search runs at sensitivity 1. δ(σ) falls as σ grows."""
    if not (math.isfinite(epsilon) and epsilon > 0 and 0 < delta < 1 and math.isfinite(sensitivity)
            and sensitivity > 0):
        raise ValueError(f"need ε > 0, 0 < δ < 1 and sensitivity > 0, got {epsilon}, {delta}, {sensitivity}")
    return _unit_sigma(float(epsilon), float(delta)) * sensitivity


@functools.lru_cache(maxsize=64)
def _unit_sigma(epsilon: float, delta: float) -> float:
    hi = 1.0
    while gaussian_delta(hi, epsilon=epsilon, sensitivity=1.0) > delta:
        hi *= 2.0
    lo = hi / 2.0
    while lo > 1e-12 and gaussian_delta(lo, epsilon=epsilon, sensitivity=1.0) <= delta:
        lo /= 2.0
    while hi - lo > 1e-12 * hi:  # invariant: δ(lo) > delta >= δ(hi)
        mid = (lo + hi) / 2.0
        if gaussian_delta(mid, epsilon=epsilon, sensitivity=1.0) <= delta:
            hi = mid
        else:
            lo = mid
    return hi


def feature_bounds(lower: Sequence[float], upper: Sequence[float], features: int) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) per feature from a request's ranges: one value each stands for every feature; any
    other count must be one per feature. Raises BadBounds naming what does not fit."""
    out = []
    for name, values in (("lower", lower), ("upper", upper)):
        if len(values) not in (1, features):
            raise BadBounds(f"the request's {name} bounds hold {len(values)} values; this site's samples have "
                            f"{features} features (give one value for all, or one per feature)")
        array = np.asarray(values, dtype=np.float64)
        if not np.all(np.isfinite(array)):
            raise BadBounds(f"the request's {name} bounds must be finite")
        out.append(np.broadcast_to(array, (features,)).copy())
    low, high = out
    if not np.all(high > low):
        j = int(np.flatnonzero(~(high > low))[0])
        raise BadBounds(f"the request's range for feature {j} is [{low[j]:g}, {high[j]:g}]: upper must exceed lower")
    return low, high


def clipped_sums(x: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """(Σ u_j, Σ u_j²) as one 2d-vector of float64, u the clipped samples rescaled to [0, 1]."""
    flat = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    u = (np.clip(flat, lower, upper) - lower) / (upper - lower)
    return np.concatenate([u.sum(axis=0), (u * u).sum(axis=0)])


@dataclass(frozen=True)
class StatisticsDraw:
    """One release: the (noised) sums and sums of squares in rescaled units, and what they cost."""

    sums: np.ndarray
    sq_sums: np.ndarray
    epsilon: float       # 0: exact
    delta: float


def release_statistics(exact: np.ndarray, *, epsilon: float, delta: float, rng: np.random.Generator) -> StatisticsDraw:
    """`exact` (from `clipped_sums`) plus Gaussian noise calibrated to (ε, δ) at sensitivity sqrt(2d); ε 0
    releases it exactly. No clipping of the noised sums: they stay unbiased for whoever combines them."""
    d = len(exact) // 2
    if not epsilon:
        return StatisticsDraw(exact[:d].copy(), exact[d:].copy(), 0.0, 0.0)
    sigma = gaussian_sigma(epsilon=epsilon, delta=delta, sensitivity=math.sqrt(2 * d))
    noised = exact + rng.normal(0.0, sigma, size=exact.shape)
    return StatisticsDraw(noised[:d], noised[d:], float(epsilon), float(delta))
