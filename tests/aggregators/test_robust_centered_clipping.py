"""Centered clipping's defining properties: fewer than half the updates, wherever they are, move the result at
most their share of (‖v − μ_H‖ + τ) from the honest mean; with τ past every distance it is the weighted mean;
the centre is the last round's aggregate, carried in the job's memory."""

from __future__ import annotations

import numpy as np
import pytest

from fedbroker.aggregators.robust import ROBUST, RobustInput, RobustMemory
from fedbroker.aggregators.robust.centered import distances_to


def problem(deltas: np.ndarray, *, previous: np.ndarray | None = None, weights: np.ndarray | None = None) -> RobustInput:
    n = deltas.shape[0]
    memory = RobustMemory().advanced(previous, keep=1) if previous is not None else None
    return RobustInput(deltas=deltas, weights=np.full(n, 1.0 / n) if weights is None else weights,
                       rng=np.random.default_rng(0), memory=memory)


@pytest.mark.parametrize("seed", range(8))
def test_fewer_than_half_anywhere_move_the_result_at_most_their_share_of_tau(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, p = int(rng.integers(5, 16)), int(rng.integers(3, 40))
    f = int(rng.integers(1, (n - 1) // 2 + 1))
    honest = rng.normal(size=(n - f, p)) + 3.0
    centre = honest.mean(axis=0) + rng.normal(size=p)           # last round's aggregate: near, not at, the mean
    tau = float(distances_to(honest, centre).max()) * 1.01      # no honest update is clipped
    mu = honest.mean(axis=0)
    for scale in (1e-3, 1.0, 1e3, 1e12):                         # attackers near, far, and absurdly far
        attackers = rng.normal(size=(f, p)) * scale + rng.normal(size=p) * scale
        deltas = np.vstack([honest, attackers])[rng.permutation(n)]
        result = ROBUST.create("centered_clipping", {"tau": tau}).aggregate(problem(deltas, previous=centre))
        bound = f / n * (np.linalg.norm(centre - mu) + tau)
        assert np.linalg.norm(result.delta - mu) <= bound * (1 + 1e-9) + 1e-12


def test_the_default_tau_stays_within_the_honest_distances_whatever_the_attackers() -> None:
    rng = np.random.default_rng(4)
    honest = rng.normal(size=(7, 20))
    for scale in (1.0, 1e6):
        deltas = np.vstack([honest, rng.normal(size=(3, 20)) * scale])
        result = ROBUST.create("centered_clipping", {}).aggregate(problem(deltas))
        distances = np.linalg.norm(honest, axis=1)   # the centre is 0 in a job's first round
        assert distances.min() <= result.notes["cc_tau"] <= distances.max()


def test_without_attackers_and_a_large_tau_it_is_the_weighted_mean_from_any_centre() -> None:
    rng = np.random.default_rng(1)
    deltas = rng.normal(size=(9, 30))
    weights = rng.uniform(1, 4, size=9)
    weights /= weights.sum()
    for previous in (None, rng.normal(size=30) * 5):
        result = ROBUST.create("centered_clipping", {"tau": 1e6}).aggregate(
            problem(deltas, previous=previous, weights=weights))
        np.testing.assert_allclose(result.delta, weights @ deltas, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(result.kept_weight, weights)
        assert result.notes["cc_clipped"] == 0


def test_the_momentum_carries_the_last_aggregate_from_round_to_round() -> None:
    rng = np.random.default_rng(2)
    rule = ROBUST.create("centered_clipping", {"tau": 0.1})
    first = rule.aggregate(problem(rng.normal(size=(5, 10)) + 10.0))
    assert first.notes["cc_momentum"] == 0.0 and first.memory is not None
    np.testing.assert_array_equal(first.memory.previous, first.delta.astype(np.float32))
    assert np.linalg.norm(first.delta) <= 0.1 + 1e-12           # from 0, one step of at most τ
    second = rule.aggregate(RobustInput(deltas=rng.normal(size=(5, 10)) + 10.0, weights=np.full(5, 0.2),
                                        rng=np.random.default_rng(0), memory=first.memory))
    assert second.notes["cc_momentum"] == 1.0 and second.memory is not None
    assert second.memory.closes == 2
    # the second round starts where the first ended and moves at most τ again
    assert np.linalg.norm(second.delta - first.delta) <= 0.1 + 1e-6
    assert np.linalg.norm(second.delta) > np.linalg.norm(first.delta)


def test_a_kept_centre_of_another_model_size_is_not_used() -> None:
    deltas = np.ones((4, 6))
    result = ROBUST.create("centered_clipping", {"tau": 1e6}).aggregate(problem(deltas, previous=np.ones(3)))
    assert result.notes["cc_momentum"] == 0.0
    np.testing.assert_allclose(result.delta, np.ones(6))
