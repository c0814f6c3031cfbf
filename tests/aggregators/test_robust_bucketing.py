"""Bucketing before a rule: with buckets of one it is the rule itself; averaging buckets of s honest updates
divides their spread by s; the rule's kept weight is reported back on the sites that sent the updates."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.robust import ROBUST, RobustInput
from fedbroker.aggregators.robust.premix import bucket_matrix, mixed_rows

RULES: dict[str, dict[str, Any]] = {
    "median": {}, "trimmed_mean": {"beta": 0.2}, "multi_krum": {"f": 2}, "geometric_median": {},
    "norm_bound": {"max_norm": 3.0}, "centered_clipping": {}, "none": {},
}


def problem(deltas: np.ndarray, weights: np.ndarray, seed: int = 0) -> RobustInput:
    return RobustInput(deltas=deltas, weights=weights, rng=np.random.default_rng(seed))


@pytest.mark.parametrize("name", sorted(RULES))
def test_buckets_of_one_are_the_rule_itself(name: str) -> None:
    rng = np.random.default_rng(3)
    deltas, weights = rng.normal(size=(11, 25)), rng.uniform(1, 3, size=11)
    weights /= weights.sum()
    plain = ROBUST.create(name, RULES[name]).aggregate(problem(deltas, weights))
    bucketed = ROBUST.create(name, {**RULES[name], "premix": "bucketing", "bucket_size": 1}).aggregate(
        problem(deltas, weights))
    np.testing.assert_allclose(bucketed.delta, plain.delta, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(bucketed.kept_weight, plain.kept_weight, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(bucketed.expected, plain.expected)


@pytest.mark.parametrize("size", [2, 3, 5])
def test_bucket_means_of_honest_updates_have_a_variance_of_about_one_over_s(size: int) -> None:
    rng = np.random.default_rng(size)
    n, p = 60, 4000
    deltas = rng.normal(size=(n, p))
    mix = bucket_matrix(np.full(n, 1.0 / n), size, rng)
    means = mixed_rows(deltas, mix)
    assert mix.shape == (n // size, n) and np.allclose(mix.sum(axis=1), 1.0)
    assert np.all((mix > 0).sum(axis=0) == 1)                     # every update in exactly one bucket
    ratio = float(means.var(axis=0, ddof=1).mean() / deltas.var(axis=0, ddof=1).mean())
    assert abs(ratio * size - 1.0) < 0.08


def test_an_uneven_last_bucket_holds_the_rest() -> None:
    mix = bucket_matrix(np.full(7, 1 / 7), 3, np.random.default_rng(0))
    assert sorted((mix > 0).sum(axis=1).tolist()) == [1, 3, 3]


@pytest.mark.parametrize("name", sorted(RULES))
def test_kept_weight_is_split_back_over_each_bucket_s_members(name: str) -> None:
    rng = np.random.default_rng(5)
    deltas, weights = rng.normal(size=(13, 20)), rng.uniform(1, 3, size=13)
    deltas[[2, 7]] *= 50.0                                        # two outliers
    weights /= weights.sum()
    params = {**RULES[name], "premix": "bucketing", "bucket_size": 3}
    result = ROBUST.create(name, params).aggregate(problem(deltas, weights, seed=9))
    mix = bucket_matrix(weights, 3, np.random.default_rng(9))    # the same draw the rule made
    inner = ROBUST.create(name, RULES[name]).aggregate(RobustInput(
        deltas=mixed_rows(deltas, mix), weights=(mix > 0) @ weights, rng=np.random.default_rng(9)))
    np.testing.assert_allclose(result.delta, inner.delta, rtol=1e-9, atol=1e-12)
    assert result.kept_weight.shape == (13,)
    np.testing.assert_allclose(result.kept_weight.sum(), inner.kept_weight.sum())
    for b, members in enumerate(mix > 0):                         # a bucket's weight, shared by its members' weights
        np.testing.assert_allclose(result.kept_weight[members],
                                   inner.kept_weight[b] * weights[members] / weights[members].sum())
    assert result.notes["premix_rows"] == 5.0
