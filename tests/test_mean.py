"""The blocked weighted means: float32 products and group sums, float64 across groups, within the stated bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregators import mean as mean_module
from aggregators.mean import RunningWeightedMean, weighted_mean

U = 2.0**-24  # float32 unit roundoff


def reference(updates, weights):
    """The exact mean (float64) and Σ|w·x|/Σw, the scale of the allowed rounding error."""
    total = sum(float(w) for w in weights)
    sums = {name: np.zeros(np.shape(arr)) for name, arr in updates[0].items()}
    scale = {name: np.zeros(np.shape(arr)) for name, arr in updates[0].items()}
    for update, w in zip(updates, weights):
        for name, arr in update.items():
            sums[name] += float(w) * np.asarray(arr, dtype=np.float64)
            scale[name] += abs(float(w)) * np.abs(np.asarray(arr, dtype=np.float64))
    return {n: a / total for n, a in sums.items()}, {n: a / total for n, a in scale.items()}


def assert_within_bound(got, updates, weights):
    exact, scale = reference(updates, weights)
    for name, want in exact.items():
        assert got[name].shape == want.shape and got[name].dtype == np.float32
        error = np.abs(got[name].astype(np.float64) - want)
        bound = (mean_module.GROUP + 3) * U * scale[name] + U * np.abs(want)
        assert np.all(error <= bound), float(np.max(error - bound))


def make_updates(seed, count, shapes):
    rng = np.random.default_rng(seed)
    return [{f"t{i}": rng.standard_normal(shape).astype(np.float32) for i, shape in enumerate(shapes)}
            for _ in range(count)]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    count=st.integers(1, 20),
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=3),
    weights=st.lists(st.sampled_from([1.0, 0.5, 3.0, 1e-3, 250.0, 1437.0]), min_size=20, max_size=20),
    block=st.sampled_from([1, 3, 7, 64]),
)
def test_blocked_means_are_the_weighted_mean_within_the_rounding_bound(seed, count, shapes, weights, block):
    updates = make_updates(seed, count, shapes)
    w = weights[:count]
    old = mean_module.BLOCK
    mean_module.BLOCK = block
    try:
        running = RunningWeightedMean()
        for update, weight in zip(updates, w):
            running.add(update, weight)
        incremental = running.result()
        batch = weighted_mean(updates, w)
    finally:
        mean_module.BLOCK = old
    assert_within_bound(incremental, updates, w)
    assert_within_bound(batch, updates, w)
    for name in incremental:  # both paths do the same arithmetic in the same order
        np.testing.assert_array_equal(incremental[name], batch[name])


def test_error_does_not_grow_with_the_number_of_updates():
    x = np.full(1000, 0.1, dtype=np.float32)  # 0.1 is inexact: every float32 add rounds
    count = 2000
    running = RunningWeightedMean()
    for _ in range(count):
        running.add({"w": x}, 1.0)
    got = running.result()["w"].astype(np.float64)
    assert np.all(np.abs(got - float(np.float32(0.1))) <= (mean_module.GROUP + 3) * U * 0.1)


def test_non_contiguous_and_float64_inputs_are_averaged_as_values():
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    updates = [{"w": base.T}, {"w": (base * 3).T.astype(np.float32)}]
    assert_within_bound(weighted_mean(updates, [1.0, 2.0]), updates, [1.0, 2.0])
    running = RunningWeightedMean()
    running.add(updates[0], 1.0)
    running.add(updates[1], 2.0)
    assert_within_bound(running.result(), updates, [1.0, 2.0])


def test_no_positive_weight_is_refused():
    with pytest.raises(ValueError, match="positively weighted"):
        RunningWeightedMean().result()
    with pytest.raises(ValueError, match="positively weighted"):
        weighted_mean([{"w": np.ones(3, np.float32)}], [0.0])


def test_mismatched_tensors_are_refused_before_any_arithmetic():
    with pytest.raises(ValueError, match="different"):
        weighted_mean([{"a": np.ones(2, np.float32)}, {"b": np.ones(2, np.float32)}], [1.0, 1.0])
    with pytest.raises(ValueError, match="different sizes"):
        weighted_mean([{"a": np.ones(2, np.float32)}, {"a": np.ones(3, np.float32)}], [1.0, 1.0])
    running = RunningWeightedMean()
    running.add({"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}, 1.0)
    with pytest.raises(ValueError, match="'b' does not match"):
        running.add({"a": np.full(2, 5.0, np.float32), "b": np.ones(3, np.float32)}, 1.0)
    np.testing.assert_array_equal(running.result()["a"], [1.0, 1.0])  # the refused update left no trace


def test_incremental_mean_allocates_no_model_sized_temporary():
    import tracemalloc

    size = 1 << 20
    update = {"w": np.ones(size, np.float32)}
    running = RunningWeightedMean()
    running.add(update, 0.5)  # allocates the float64 sums and the float32 group sum
    tracemalloc.start()
    try:
        for _ in range(2 * mean_module.GROUP):  # folds into the float64 sums twice
            running.add(update, 0.25)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < size  # far below one float32 copy of the update (4 bytes per value)
