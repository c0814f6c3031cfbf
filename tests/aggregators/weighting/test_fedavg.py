"""FedAvg and uniform weights, and the uniform fallback when the raw weights sum to zero."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.aggregators.weighting import FedAvgWeighting, UniformWeighting, UpdateMeta, normalise_weights


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=20).filter(lambda c: sum(c) > 0))
def test_fedavg_weights_are_proportional_to_sample_counts(counts: list[int]) -> None:
    algo = FedAvgWeighting()
    raw = np.array([algo.raw_weight(UpdateMeta(worker_id=f"w{i}", num_samples=n)) for i, n in enumerate(counts)])
    weights, fell_back = algo.normalise(raw)
    assert not fell_back
    assert np.allclose(weights, np.array(counts) / sum(counts))


def test_uniform_weights_ignore_sample_counts() -> None:
    algo = UniformWeighting()
    raw = np.array([algo.raw_weight(UpdateMeta(worker_id=f"w{i}", num_samples=n)) for i, n in enumerate([1, 50, 7])])
    weights, fell_back = algo.normalise(raw)
    assert np.allclose(weights, 1 / 3) and not fell_back


@pytest.mark.parametrize("raw", [[0.0, 0.0, 0.0], [0.0]])
def test_zero_sum_falls_back_to_uniform_and_says_so(raw: list[float]) -> None:
    weights, fell_back = normalise_weights(np.array(raw))
    assert fell_back
    assert np.allclose(weights, 1 / len(raw))


def test_fedavg_with_only_empty_workers_falls_back_to_uniform() -> None:
    algo = FedAvgWeighting()
    raw = np.array([algo.raw_weight(UpdateMeta(worker_id=w, num_samples=0)) for w in ("a", "b")])
    assert algo.normalise(raw)[1] is True


@pytest.mark.parametrize("raw", [[], [1.0, -0.5], [1.0, float("inf")], [[1.0, 2.0]]])
def test_normalise_rejects_empty_negative_non_finite_and_non_vector_input(raw: list[object]) -> None:
    with pytest.raises(ValueError):
        normalise_weights(np.array(raw))
