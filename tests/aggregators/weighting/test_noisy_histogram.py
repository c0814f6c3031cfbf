"""Laplace-noised label histograms for owners who will not share exact counts."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.label_stats import noisy_histogram


@settings(max_examples=100, deadline=None)
@given(
    counts=st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=12),
    epsilon=st.floats(min_value=0.01, max_value=100.0),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_noisy_histogram_is_non_negative_integers(counts: list[int], epsilon: float, seed: int) -> None:
    out = noisy_histogram(counts, epsilon=epsilon, rng=np.random.default_rng(seed))
    assert out.shape == (len(counts),)
    assert np.issubdtype(out.dtype, np.integer)
    assert np.all(out >= 0)


@pytest.mark.parametrize("epsilon", [None, math.inf])
def test_noisy_histogram_is_exact_without_a_finite_epsilon(epsilon: float | None) -> None:
    out = noisy_histogram([4, 0, 17], epsilon=epsilon, rng=np.random.default_rng(0))
    assert out.tolist() == [4, 0, 17]


def test_noisy_histogram_error_shrinks_as_epsilon_grows() -> None:
    counts = np.full(2000, 1000)  # far from zero, so clipping never bites
    errors = []
    for eps in (0.1, 1.0, 10.0):
        out = noisy_histogram(counts, epsilon=eps, rng=np.random.default_rng(42))
        errors.append(float(np.abs(out - counts).mean()))
    assert errors[0] > errors[1] > errors[2]
    # Laplace(b = 1/ε) has mean absolute deviation b: sensitivity 1.
    assert errors[0] == pytest.approx(10.0, rel=0.1)
    assert errors[1] == pytest.approx(1.0, rel=0.1)


def test_noisy_histogram_is_reproducible_for_a_seed() -> None:
    a = noisy_histogram([5, 6, 7], epsilon=0.5, rng=np.random.default_rng(3))
    b = noisy_histogram([5, 6, 7], epsilon=0.5, rng=np.random.default_rng(3))
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize(
    ("counts", "epsilon"),
    [([1, 2], 0.0), ([1, 2], -1.0), ([1, 2], float("nan")), ([1, -2], 1.0), ([1.5], 1.0), ([], 1.0)],
)
def test_noisy_histogram_rejects_bad_epsilon_and_counts(counts: list[float], epsilon: float) -> None:
    with pytest.raises(ValueError):
        noisy_histogram(counts, epsilon=epsilon, rng=np.random.default_rng(0))
