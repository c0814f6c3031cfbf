"""The plausible range of a site's feature statistics (fedbroker/statistics_release.py): what `count` rows of
values in [0, 1], exact or noised at the stated (ε, δ), can give. Honest releases pass (at 6σ a value falls
outside with probability below 2e-9), forged ones are named feature by feature, and no claim of ε or δ widens
the range past what the least accepted ones allow."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.statistics_release import (
    MIN_STATISTICS_DELTA,
    MIN_STATISTICS_EPSILON,
    PLAUSIBLE_SIGMAS,
    release_problems,
    statistics_sigma,
)


def honest(rng: np.random.Generator, *, rows: int, features: int, epsilon: float, delta: float) -> tuple[
        np.ndarray, np.ndarray]:
    """A site's release as its worker draws it: values in [0, 1] (some at the edges), summed, noised at σ."""
    u = np.clip(rng.normal(rng.uniform(-0.2, 1.2, features), 0.3, size=(rows, features)), 0.0, 1.0)
    sums, squares = u.sum(axis=0), (u * u).sum(axis=0)
    if not epsilon:
        return sums, squares
    sigma = statistics_sigma(features=features, epsilon=epsilon, delta=delta)
    return sums + rng.normal(0.0, sigma, features), squares + rng.normal(0.0, sigma, features)


@pytest.mark.parametrize("epsilon", [0.0, MIN_STATISTICS_EPSILON, 1.0, 8.0])
@pytest.mark.parametrize(("rows", "features"), [(1, 1), (30, 5), (400, 64)])
def test_honest_releases_are_plausible(epsilon: float, rows: int, features: int) -> None:
    rng = np.random.default_rng(rows * 100 + features)
    for _ in range(200):
        sums, squares = honest(rng, rows=rows, features=features, epsilon=epsilon, delta=1e-5)
        assert release_problems(sums, squares, count=rows, epsilon=epsilon, delta=1e-5) == []


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 10_000), features=st.integers(1, 50), epsilon=st.floats(MIN_STATISTICS_EPSILON, 20.0),
       delta=st.floats(MIN_STATISTICS_DELTA, 0.5), side=st.sampled_from(["sum high", "sum low", "square high"]),
       feature=st.integers(0, 49))
def test_a_value_just_past_the_range_is_named_and_one_just_inside_is_not(
        rows: int, features: int, epsilon: float, delta: float, side: str, feature: int) -> None:
    j = feature % features
    reach = PLAUSIBLE_SIGMAS * statistics_sigma(features=features, epsilon=epsilon, delta=delta)
    for over, plausible in ((1.001, False), (0.999, True)):
        sums, squares = [rows / 2] * features, [rows / 4] * features
        if side == "sum high":
            sums[j] = rows + over * reach
            squares[j] = sums[j] - reach  # within its gap: only the sum is out
        elif side == "sum low":
            sums[j] = squares[j] = -over * reach
        else:  # a sum at the low edge, so the square is within its own range whatever the count
            sums[j] = -0.99 * reach
            squares[j] = sums[j] + over * math.sqrt(2) * reach
        problems = release_problems(sums, squares, count=rows, epsilon=epsilon, delta=delta)
        assert (problems == []) == plausible, (side, over, problems)
        if not plausible:
            assert f"[{j}] " in problems[0]


def test_the_attack_is_named_with_the_range_it_broke() -> None:
    """Break 9: ±1e15 sums (the control queue's cap) from a site of 200 rows at ε 1."""
    problems = release_problems([1e15, -1e15, 3.0], [1e15, 1e15, 2.0], count=200, epsilon=1.0, delta=1e-5)
    sigma = statistics_sigma(features=3, epsilon=1.0, delta=1e-5)
    assert problems[0] == (f"feature_sum: 2 value(s) ([0] 1e+15, [1] -1e+15) outside [0, 200] (the rows' values "
                           f"rescaled to [0, 1]) widened by 6σ = {6 * sigma:.4g} (ε 1, δ 1e-05)")
    assert problems[1].startswith("feature_sq_sum: 2 value(s) ([0] 1e+15, [1] 1e+15) outside [0, 200]")
    assert problems[2].startswith("feature_sq_sum: 1 value(s) ([1] 1e+15) above its feature's sum by more than")


def test_exact_statistics_have_no_room_beyond_float_error() -> None:
    assert release_problems([200.0, 0.0], [200.0, 0.0], count=200, epsilon=0.0, delta=0.0) == []
    assert release_problems([200.0 + 1e-9, -1e-9], [0.0, 0.0], count=200, epsilon=0.0, delta=0.0) == []
    assert "outside [0, 200]" in release_problems([200.01, 0.0], [0.0, 0.0], count=200, epsilon=0.0, delta=0.0)[0]
    assert "above its feature's sum" in release_problems([1.0], [1.01], count=200, epsilon=0.0, delta=0.0)[0]


@pytest.mark.parametrize(("epsilon", "delta"), [(MIN_STATISTICS_EPSILON / 2, 1e-5), (1e-9, 1e-5),
                                                (1.0, MIN_STATISTICS_DELTA / 10), (1.0, 0.0)])
def test_no_claim_of_epsilon_or_delta_widens_the_range_past_the_least_accepted(epsilon: float, delta: float) -> None:
    """σ grows as ε or δ shrink: a site stating ε 1e-9 would make any sums plausible, so it is refused outright."""
    (problem,) = release_problems([100.0], [50.0], count=200, epsilon=epsilon, delta=delta)
    assert problem.startswith(f"statistics noised at ε {epsilon:g}, δ {delta:g}: below the least this coordinator "
                              f"takes (ε {MIN_STATISTICS_EPSILON:g}, δ {MIN_STATISTICS_DELTA:g})")


def test_the_widest_range_any_site_gets_is_the_least_accepted_epsilons() -> None:
    widest = statistics_sigma(features=5, epsilon=MIN_STATISTICS_EPSILON, delta=MIN_STATISTICS_DELTA)
    for epsilon in (MIN_STATISTICS_EPSILON, 0.5, 1.0, 10.0):
        for delta in (MIN_STATISTICS_DELTA, 1e-5, 0.1):
            assert statistics_sigma(features=5, epsilon=epsilon, delta=delta) <= widest
