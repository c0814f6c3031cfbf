"""The defining property of each robust rule, pinned on random rounds (hypothesis): what f arbitrary updates
can and cannot do to the result."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.aggregators.robust import (
    FLTrust,
    GeometricMedian,
    Median,
    MultiKrum,
    NormBound,
    RobustInput,
    TrimmedMean,
    trimmed,
)
from fedbroker.aggregators.robust.coordinatewise import NETWORK_UP_TO, sorting_network

RNG = np.random.default_rng(0)
SEEDS = st.integers(0, 2**32 - 1)
HUGE = st.floats(-1e30, 1e30, allow_nan=False)


def uniform(n: int) -> np.ndarray:
    return np.full(n, 1.0 / n)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 15), p=st.integers(1, 8), seed=SEEDS, data=st.data())
def test_the_median_stays_within_the_honest_range_whatever_fewer_than_half_send(n: int, p: int, seed: int,
                                                                              data: st.DataObject) -> None:
    rng = np.random.default_rng(seed)
    f = data.draw(st.integers(0, (n - 1) // 2), label="f")
    deltas = rng.normal(size=(n, p))
    honest = np.ones((n, p), dtype=bool)
    for j in range(p):  # a different set of f liars in every coordinate, each value arbitrary
        liars = rng.choice(n, size=f, replace=False)
        honest[liars, j] = False
        deltas[liars, j] = data.draw(st.lists(HUGE, min_size=f, max_size=f), label=f"lies {j}")
    result = Median().aggregate(RobustInput(deltas=deltas, weights=uniform(n), rng=RNG))
    low = np.where(honest, deltas, np.inf).min(axis=0)
    high = np.where(honest, deltas, -np.inf).max(axis=0)
    assert np.all(low <= result.delta) and np.all(result.delta <= high)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 30), p=st.integers(1, 6), beta=st.floats(0.0, 0.49), seed=SEEDS)
def test_the_trimmed_mean_drops_ceil_beta_n_per_side_and_averages_the_rest(n: int, p: int, beta: float,
                                                                         seed: int) -> None:
    deltas = np.random.default_rng(seed).normal(size=(n, p))
    rule = TrimmedMean(beta=beta)
    k = min(math.ceil(Fraction(repr(beta)) * n), (n - 1) // 2)
    result = rule.aggregate(RobustInput(deltas=deltas, weights=uniform(n), rng=RNG))
    expected = np.sort(deltas, axis=0)[k:n - k].mean(axis=0)
    np.testing.assert_allclose(result.delta, expected, rtol=1e-12, atol=1e-12)
    assert result.notes["trimmed_per_side"] == k
    assert result.notes["trim_lowered"] == float(math.ceil(Fraction(repr(beta)) * n) > (n - 1) // 2)


def test_the_trimmed_mean_at_beta_0_1_of_ten_drops_one_each_side() -> None:
    column = np.array([-1000.0, 1, 2, 3, 4, 5, 6, 7, 8, 1000.0])[:, None]
    result = TrimmedMean(beta=0.1).aggregate(RobustInput(deltas=column, weights=uniform(10), rng=RNG))
    assert result.delta[0] == 4.5 and result.notes["trimmed_per_side"] == 1
    assert result.kept_weight[0] == result.kept_weight[-1] == 0 and np.allclose(result.kept_weight[1:-1], 1 / 8)
    assert TrimmedMean(beta=0.11).aggregate(RobustInput(deltas=column, weights=uniform(10), rng=RNG)).delta[0] == 4.5  # ⌈1.1⌉ = 2: 2..7
    thirty = np.arange(30.0)[:, None]
    assert TrimmedMean(beta=0.1).aggregate(RobustInput(deltas=thirty, weights=uniform(30), rng=RNG)).notes["trimmed_per_side"] == 3  # not 4


@settings(max_examples=40, deadline=None)
@given(f=st.integers(0, 4), extra=st.integers(0, 6), p=st.integers(2, 40), far=st.floats(10.0, 1e6), seed=SEEDS)
def test_multi_krum_never_averages_an_attacker_far_from_the_honest_cluster(f: int, extra: int, p: int, far: float,
                                                                          seed: int) -> None:
    rng = np.random.default_rng(seed)
    honest = 2 * f + 3 + extra - f   # n = honest + f >= 2f + 3
    centre = rng.normal(size=p)
    cluster = centre + 0.1 * rng.normal(size=(honest, p)) / math.sqrt(p)
    attackers = centre + far * rng.choice([-1.0, 1.0], size=(f, p)) * (1 + rng.random(size=(f, p)))
    deltas = np.vstack([cluster, attackers])[rng.permutation(honest + f)]
    is_attacker = np.array([any(np.array_equal(row, a) for a in attackers) for row in deltas])
    result = MultiKrum(f=f).aggregate(RobustInput(deltas=deltas, weights=uniform(len(deltas)), rng=RNG))
    assert not np.any(result.kept_weight[is_attacker] > 0)
    radius = np.linalg.norm(cluster - centre, axis=1).max()
    assert np.linalg.norm(result.delta - centre) <= radius + 1e-9
    assert result.discarded()[is_attacker].all()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 12), p=st.integers(1, 20), seed=SEEDS)
def test_the_geometric_median_of_identical_points_is_that_point(n: int, p: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    point = rng.normal(size=p) * 10
    weights = rng.uniform(0.1, 1.0, size=n)
    result = GeometricMedian().aggregate(RobustInput(deltas=np.tile(point, (n, 1)), weights=weights / weights.sum(), rng=RNG))
    np.testing.assert_allclose(result.delta, point, rtol=1e-9, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(honest=st.integers(3, 12), share=st.floats(0.0, 0.4), p=st.integers(2, 30), far=st.floats(1.0, 1e6),
       seed=SEEDS)
def test_the_geometric_median_stays_near_the_honest_points_whatever_the_outliers(honest: int, share: float, p: int,
                                                                                 far: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    f = min(int(share * honest / (1 - share)), honest - 1)  # the outliers' share of the points stays < 0.4
    points = rng.normal(size=(honest, p)) / math.sqrt(p)
    outliers = far * rng.normal(size=(f, p))
    deltas = np.vstack([points, outliers])
    result = GeometricMedian().aggregate(RobustInput(deltas=deltas, weights=uniform(honest + f), rng=RNG))
    alpha = f / (honest + f)
    bound = 2 * (1 - alpha) / (1 - 2 * alpha) * np.linalg.norm(points, axis=1).max()  # Minsker's breakdown bound
    assert np.linalg.norm(result.delta) <= bound * 1.01 + 1e-6


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 10), p=st.integers(1, 20), bound=st.floats(0.01, 100.0), seed=SEEDS)
def test_norm_bounding_caps_every_update_at_m_and_leaves_small_ones_alone(n: int, p: int, bound: float,
                                                                         seed: int) -> None:
    rng = np.random.default_rng(seed)
    deltas = rng.normal(size=(n, p)) * rng.uniform(0.001, 200.0, size=(n, 1))
    weights = rng.uniform(0.1, 1.0, size=n)
    weights /= weights.sum()
    result = NormBound(max_norm=bound).aggregate(RobustInput(deltas=deltas, weights=weights, rng=RNG))
    norms = np.linalg.norm(deltas, axis=1)
    scale = result.kept_weight / weights
    np.testing.assert_allclose(scale * norms, np.minimum(norms, bound), rtol=1e-9)   # each is capped at M ...
    small = norms <= bound
    np.testing.assert_array_equal(result.kept_weight[small], (weights / weights.sum())[small])  # ... small kept
    np.testing.assert_allclose(result.delta, (result.kept_weight[:, None] * deltas).sum(axis=0), rtol=1e-9,
                               atol=1e-12)
    assert np.linalg.norm(result.delta) <= bound * (1 + 1e-9)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 10), p=st.integers(2, 20), seed=SEEDS)
def test_fltrust_gives_no_weight_against_g0_and_never_outgrows_it(n: int, p: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    g0 = rng.normal(size=p)
    deltas = rng.normal(size=(n, p)) * rng.uniform(0.01, 1e4, size=(n, 1))
    deltas[0] = -rng.uniform(0.1, 1e6) * g0                 # a scaled sign flip of the root direction
    rule = FLTrust(probe_dataset="digits")
    result = rule.aggregate(RobustInput(deltas=deltas, weights=uniform(n), rng=RNG, root_update=g0))
    assert result.kept_weight[0] == 0.0
    cosine = deltas @ g0 / (np.linalg.norm(deltas, axis=1) * np.linalg.norm(g0))
    assert np.all(result.kept_weight[cosine <= 0] == 0.0)
    assert np.linalg.norm(result.delta) <= np.linalg.norm(g0) * (1 + 1e-9)


def test_fltrust_keeps_the_global_model_when_it_trusts_no_update() -> None:
    g0 = np.array([1.0, 0.0])
    result = FLTrust(probe_dataset="digits").aggregate(RobustInput(deltas=np.array([[-1.0, 0.0], [0.0, 3.0]]), weights=uniform(2), rng=RNG,
                                                       root_update=g0))
    assert np.all(result.delta == 0) and np.all(result.kept_weight == 0) and result.notes["fltrust_trusted"] == 0


@pytest.mark.parametrize("n", range(1, NETWORK_UP_TO + 1))
def test_the_sorting_network_sorts_every_zero_one_input_and_random_ones(n: int) -> None:
    """By the 0-1 principle a comparator network that sorts every 0-1 input sorts every input: exhaustive up to
    n = 14, random 0-1 inputs above, and random reals for every n."""
    rng = np.random.default_rng(n)
    count = 2**n if n <= 14 else 20_000
    codes = np.arange(count) if n <= 14 else rng.integers(0, 2**n, size=count)
    values = np.vstack([((codes >> i) & 1).astype(np.float64) for i in range(n)])  # (n, count): a column each
    values = np.hstack([values, rng.normal(size=(n, 500))])
    for i, j in sorting_network(n):
        values[i], values[j] = np.minimum(values[i], values[j]), np.maximum(values[i], values[j])
    assert np.all(np.diff(values, axis=0) >= 0)


@pytest.mark.parametrize("n", [3, NETWORK_UP_TO, NETWORK_UP_TO + 1, 40])
def test_the_network_and_the_sort_give_the_same_trimmed_mean(n: int) -> None:
    deltas = np.random.default_rng(n).normal(size=(n, 20_000)).astype(np.float32)
    for k in {0, 1, (n - 1) // 2}:
        got, _ = trimmed(deltas, k)
        np.testing.assert_allclose(got, np.sort(deltas.astype(np.float64), axis=0)[k:n - k].mean(axis=0), rtol=1e-6,
                                   atol=1e-6)
