"""A site's feature-statistics release (`data.standardize: federated`) as both sides read it. In the kernel
because the worker noises its per-feature sums with the Gaussian mechanism calibrated here, and the coordinator
checks with the same σ that what a site sent could have come from it (one site's ±1e15 sums once set every
feature's agreed mean to its bound).

The noise is calibrated by the analytic Gaussian mechanism (Balle & Wang, "Improving the Gaussian Mechanism
for Differential Privacy", ICML 2018, Theorem 8): N(0, σ²) per coordinate is (ε, δ)-DP for sensitivity Δ
exactly when Φ(Δ/2σ - εσ/Δ) - e^ε Φ(-Δ/2σ - εσ/Δ) <= δ, and σ is the smallest value meeting it. The
textbook σ = Δ·sqrt(2 ln(1.25/δ))/ε holds only for ε < 1 (and is looser there). A release of d features is
the 2d-vector (Σ u_j, Σ u_j²) of values u in [0, 1]: one record moves it by at most sqrt(2d) in L2.

The plausible range (`release_problems`). Over `count` rows an exact sum S_j lies in [0, count] and its sum
of squares Q_j in [0, S_j]. Noised, each is plausible within PLAUSIBLE_SIGMAS·σ of that range, and Q_j - S_j
(noise N(0, 2σ²)) below sqrt(2)·PLAUSIBLE_SIGMAS·σ. At 6σ an honest value falls outside with probability
at most 2·Φ(-6) ≈ 2e-9 per check, and a site's release has 3d checks: 5e-6 for a 784-pixel image. σ is
the one the site's stated ε and δ give, and a site may state no less than MIN_STATISTICS_EPSILON and
MIN_STATISTICS_DELTA: wider noise would let its sums lie anywhere, so the room a site has is fixed here,
never by its own claim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from scipy.special import log_ndtr, ndtr

PLAUSIBLE_SIGMAS = 6.0        # k: how far from the exact range a noised value may lie, in σ (module docstring)
MIN_STATISTICS_EPSILON = 0.1  # the least ε a noised release may state (at d = 5, δ 1e-5: σ ≈ 97, k·σ ≈ 580)
MIN_STATISTICS_DELTA = 1e-10  # the least δ; σ grows about as sqrt(ln(1/δ)): ×1.6 from 1e-5 at ε 1
_EXACT_SLACK = 1e-6           # float error in an exact sum, relative to its count (plus this, absolute)
_SHOWN = 5                    # the features a problem names, at most


def gaussian_delta(sigma: float, *, epsilon: float, sensitivity: float) -> float:
    """The smallest δ for which N(0, σ²) noise on a query of L2 `sensitivity` is (ε, δ)-DP (the exact
    condition of the analytic Gaussian mechanism, module docstring)."""
    a, b = sensitivity / (2.0 * sigma), epsilon * sigma / sensitivity
    # e^ε·Φ(-a-b) in logs: e^ε alone overflows for large ε where Φ(-a-b) is tiny
    return float(ndtr(a - b) - math.exp(epsilon + float(log_ndtr(-a - b))))


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


def statistics_sigma(*, features: int, epsilon: float, delta: float) -> float:
    """The σ of each value of a release of `features` features at (ε, δ): sensitivity sqrt(2d)."""
    return gaussian_sigma(epsilon=epsilon, delta=delta, sensitivity=math.sqrt(2 * features))


def release_problems(sums: Sequence[float], squares: Sequence[float], *, count: int, epsilon: float,
                     delta: float) -> list[str]:
    """Why this release cannot have come from `count` rows of values in [0, 1], exact (ε 0) or noised at the
    stated (ε, δ); [] when it can. Pure: the coordinator's check of a site's statistics (module docstring)."""
    if epsilon and (epsilon < MIN_STATISTICS_EPSILON or delta < MIN_STATISTICS_DELTA):
        return [f"statistics noised at ε {epsilon:g}, δ {delta:g}: below the least this coordinator takes "
                f"(ε {MIN_STATISTICS_EPSILON:g}, δ {MIN_STATISTICS_DELTA:g}), noise that wide could hide any sums"]
    if epsilon:
        reach = PLAUSIBLE_SIGMAS * statistics_sigma(features=len(sums), epsilon=epsilon, delta=delta)
        what = f"{PLAUSIBLE_SIGMAS:g}σ = {reach:.4g} (ε {epsilon:g}, δ {delta:g})"
        gap = math.sqrt(2.0) * reach
    else:
        reach = gap = _EXACT_SLACK * (count + 1)
        what = "nothing (exact)"
    low, high = -reach, count + reach
    out = []
    for name, values in (("feature_sum", sums), ("feature_sq_sum", squares)):
        bad = [j for j, v in enumerate(values) if not low <= v <= high]
        if bad:
            out.append(f"{name}: {_named(bad, values)} outside [0, {count}] (the rows' values rescaled to [0, 1]) "
                       f"widened by {what}")
    above = [j for j, (s, q) in enumerate(zip(sums, squares)) if q - s > gap]
    if above:
        out.append(f"feature_sq_sum: {_named(above, squares)} above its feature's sum by more than "
                   f"{gap:.4g} (a square of a value in [0, 1] is at most the value)")
    return out


def _named(indices: list[int], values: Sequence[float]) -> str:
    shown = ", ".join(f"[{j}] {values[j]:.6g}" for j in indices[:_SHOWN])
    return f"{len(indices)} value(s) ({shown}{', …' if len(indices) > _SHOWN else ''})"
