"""Nearest-neighbour mixing before a rule: identical honest updates come back exactly, an outlier's own mixed
update is pulled to the honest ones, and the kept weight is reported on the original sites."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.robust import ROBUST, RobustInput, RobustMemory
from fedbroker.aggregators.robust.premix import mixed_rows, nnm_matrix

RULES: dict[str, dict[str, Any]] = {
    "median": {}, "trimmed_mean": {"beta": 0.3}, "multi_krum": {"f": 3}, "centered_clipping": {},
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_identical_honest_updates_come_back_exactly_past_f_outliers(name: str) -> None:
    rng = np.random.default_rng(0)
    n, f, p = 10, 3, 30
    honest = rng.normal(size=p)
    deltas = np.vstack([np.tile(honest, (n - f, 1)), rng.normal(size=(f, p)) * 100])[rng.permutation(n)]
    # centered clipping steps from its last aggregate: there, the honest update (from 0 it would need rounds)
    memory = RobustMemory().advanced(honest, keep=1) if name == "centered_clipping" else None
    result = ROBUST.create(name, {**RULES[name], "premix": "nnm", "nnm_f": f}).aggregate(
        RobustInput(deltas=deltas, weights=np.full(n, 1 / n), rng=np.random.default_rng(0), memory=memory))
    # exactly, up to the rounding of a mean of n − f equal numbers (and of the float32 kept centre)
    np.testing.assert_allclose(result.delta, honest, rtol=1e-6 if memory else 1e-12, atol=1e-15)


def test_an_outlier_s_own_mixed_update_is_pulled_to_the_honest_ones() -> None:
    rng = np.random.default_rng(1)
    n, f, p = 9, 2, 15
    honest = rng.normal(size=(n - 1, p)) * 0.01 + 1.0
    outlier = rng.normal(size=p) * 1e4
    deltas = np.vstack([honest, outlier])
    mixed = mixed_rows(deltas, nnm_matrix(deltas, f))
    # its n − f nearest are itself and n − f − 1 honest ones: its distance shrinks by n − f at least
    centre = honest.mean(axis=0)
    assert np.linalg.norm(mixed[-1] - centre) <= np.linalg.norm(outlier - centre) / (n - f) * 1.001
    # an honest update's neighbours are all honest
    assert np.max(np.abs(mixed[:-1] - centre)) < 0.05


def test_each_row_mixes_itself_and_its_n_minus_f_minus_one_nearest() -> None:
    deltas = np.arange(6, dtype=float)[:, None] * np.array([[1.0, 0.0]])
    mix = nnm_matrix(deltas, 3)
    assert np.allclose(mix.sum(axis=1), 1.0) and np.all((mix > 0).sum(axis=1) == 3)
    assert np.all(np.diag(mix) > 0)
    assert set(np.flatnonzero(mix[0])) == {0, 1, 2} and set(np.flatnonzero(mix[5])) == {3, 4, 5}


def test_kept_weight_sums_back_over_the_original_sites() -> None:
    rng = np.random.default_rng(2)
    deltas = rng.normal(size=(8, 12))
    deltas[3] += 40.0
    weights = np.full(8, 1 / 8)
    result = ROBUST.create("multi_krum", {"f": 2, "premix": "nnm", "nnm_f": 2}).aggregate(
        RobustInput(deltas=deltas, weights=weights, rng=np.random.default_rng(0)))
    mix = nnm_matrix(deltas, 2)
    inner = ROBUST.create("multi_krum", {"f": 2}).aggregate(
        RobustInput(deltas=mixed_rows(deltas, mix), weights=weights, rng=np.random.default_rng(0)))
    np.testing.assert_allclose(result.kept_weight, mix.T @ inner.kept_weight)
    np.testing.assert_allclose(result.kept_weight.sum(), 1.0)
    assert result.kept_weight[3] < 1 / 8 / 2                     # the outlier keeps little of its share
