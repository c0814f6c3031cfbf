"""A site's per-feature sums and sums of squares, for statistics the sites agree on (`data.standardize:
federated`), released under the Gaussian mechanism.

Each sample is flattened, each feature clipped to the range the job asks for, [lower_j, upper_j], and
rescaled to [0, 1]: u_j = (clip(x_j) - lower_j) / (upper_j - lower_j). The release is the 2d-vector
(Σ u_j, Σ u_j²) over the site's training rows. Adding or removing one record moves it by that record's
(u, u²), whose L2 norm is at most sqrt(2d): the sensitivity the noise is calibrated to. The values stay in
the rescaled units; whoever combines them maps back: mean_j = lower_j + (upper_j - lower_j)·S_j/n and
var_j = (upper_j - lower_j)²·(Q_j/n - (S_j/n)²).

The noise is calibrated by the analytic Gaussian mechanism (fedbroker.statistics_release, in the kernel: the
coordinator bounds what a release may hold with the same σ).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedbroker.datasets.stream import FileSamples
from fedbroker.errors import FedbrokerError
from fedbroker.statistics_release import statistics_sigma

STREAM_CHUNK = 256   # samples on files decoded at once for the statistics


class BadBounds(FedbrokerError):
    """The clipping range a request names does not fit this site's features."""

    reason = "bad_bounds"


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


def clipped_sums(x: np.ndarray | FileSamples, lower: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """(Σ u_j, Σ u_j²) as one 2d-vector of float64, u the clipped samples rescaled to [0, 1]. Samples on files
    are decoded STREAM_CHUNK at a time (as decoded: the statistics are of the raw samples)."""
    if isinstance(x, FileSamples):
        parts = [clipped_sums(x.read(np.arange(i, min(i + STREAM_CHUNK, len(x)))), lower, upper)
                 for i in range(0, len(x), STREAM_CHUNK)]
        return np.sum(parts, axis=0) if parts else clipped_sums(np.zeros((0, lower.size)), lower, upper)
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
    sigma = statistics_sigma(features=d, epsilon=epsilon, delta=delta)
    noised = exact + rng.normal(0.0, sigma, size=exact.shape)
    return StatisticsDraw(noised[:d], noised[d:], float(epsilon), float(delta))
