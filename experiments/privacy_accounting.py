"""The privacy experiment's noise calibration: the smallest noise multiplier that gives each cell its ε.

Central: the sampled-Gaussian RDP accountant the workers use (`fedbroker.privacy.project_epsilon`), T steps at
rate q. Distributed and local: the Skellam accounting of `fedbroker.secagg.skellam` (the module the secure rounds
use), which also picks the quantiser's scale γ and the ring. Calibrated once per (task, N, ε, mode) in the
parent process and stored with the results, so every seed of a cell runs the same noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from experiments.privacy_sim import Noise

Z_LOW, Z_HIGH = 0.05, 500.0


def smallest_z(epsilon_of: Callable[[float], float], target: float, *, rel_tol: float = 1e-4) -> float:
    """The smallest z with epsilon_of(z) ≤ target, by bisection (ε falls as z grows)."""
    low, high = Z_LOW, Z_HIGH
    if epsilon_of(high) > target:
        raise ValueError(f"even z = {high} does not reach ε = {target}")
    while high - low > rel_tol * high:
        mid = math.sqrt(low * high)
        if epsilon_of(mid) <= target:
            high = mid
        else:
            low = mid
    return high


def central_z(*, epsilon: float, sample_rate: float, rounds: int, delta: float) -> float:
    from fedbroker.privacy import project_epsilon

    return smallest_z(lambda z: project_epsilon([], noise_multiplier=z, sample_rate=sample_rate, steps=rounds,
                                                delta=delta), epsilon)
