"""The row-wise weighted means: float32 folds (sgemv), float64 flushes, within the stated rounding bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.aggregators import mean as mean_module
from fedbroker.aggregators.mean import Layout, RunningWeightedMean, UpdateRows, weighted_mean_of_rows

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
        bound = (mean_module.ROWS + mean_module.FLUSH + 3) * U * scale[name] + U * np.abs(want)
        assert np.all(error <= bound), float(np.max(error - bound))


def make_updates(seed, count, shapes):
    rng = np.random.default_rng(seed)
    return [{f"t{i}": rng.standard_normal(shape).astype(np.float32) for i, shape in enumerate(shapes)}
            for _ in range(count)]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    count=st.integers(1, 40),
    shapes=st.lists(st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple), min_size=1, max_size=3),
    weights=st.lists(st.sampled_from([1.0, 0.5, 3.0, 1e-3, 250.0, 1437.0, 0.0]), min_size=40, max_size=40),
    rows=st.sampled_from([1, 2, 3, 16]),
    flush=st.sampled_from([1, 2, 8]),
)
def test_every_path_is_the_weighted_mean_within_the_rounding_bound(seed, count, shapes, weights, rows, flush):
    updates = make_updates(seed, count, shapes)
    w = weights[:count]
    if sum(w) <= 0:
        w[0] = 1.0
    layout = Layout.of(updates[0])
    old = mean_module.FLUSH
    mean_module.FLUSH = flush
    try:
        copied = RunningWeightedMean(max_rows=rows)       # tensors copied into its rows
        for update, weight in zip(updates, w):
            copied.add(update, weight)
        received = RunningWeightedMean(layout, max_rows=rows)  # each update received into a reserved row
        for update, weight in zip(updates, w):
            slot = received.reserve(layout)
            assert slot is not None
            layout.write(update, slot.values)
            received.add(layout.views(slot.values), weight, slot=slot)
        store = UpdateRows(layout.size, per_block=rows)   # a round that keeps every update
        slots = [store.take() for _ in updates]
        for update, slot in zip(updates, slots):
            layout.write(update, slot.values)
        kept = weighted_mean_of_rows(store, slots, w, layout)
        results = [copied.result(), received.result(), kept]
    finally:
        mean_module.FLUSH = old
    for result in results:
        assert_within_bound(result, updates, w)
    for name in results[0]:  # the running mean does the same arithmetic however the rows were filled
        np.testing.assert_array_equal(results[0][name], results[1][name])


def test_error_does_not_grow_with_the_number_of_updates():
    x = np.full(1000, 0.1, dtype=np.float32)  # 0.1 is inexact: every float32 add rounds
    count = 5000                              # 39 flushes of 8 folds of 16 rows
    running = RunningWeightedMean()
    for _ in range(count):
        running.add({"w": x}, 1.0)
    got = running.result()["w"].astype(np.float64)
    bound = (mean_module.ROWS + mean_module.FLUSH + 3) * U * 0.1
    assert np.all(np.abs(got - float(np.float32(0.1))) <= bound)
    assert bound < count * U * 0.1 / 50  # far below what a plain float32 sum may drift


def test_non_contiguous_and_float64_inputs_are_averaged_as_values():
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    updates = [{"w": base.T}, {"w": (base * 3).T.astype(np.float32)}]
    running = RunningWeightedMean()
    running.add(updates[0], 1.0)
    running.add(updates[1], 2.0)
    assert_within_bound(running.result(), updates, [1.0, 2.0])


def test_no_positive_weight_is_refused():
    with pytest.raises(ValueError, match="positively weighted"):
        RunningWeightedMean().result()
    store = UpdateRows(3, per_block=2)
    with pytest.raises(ValueError, match="positively weighted"):
        weighted_mean_of_rows(store, [store.take()], [0.0], Layout({"w": (3,)}))


def test_mismatched_tensors_are_refused_before_any_arithmetic():
    other_names = RunningWeightedMean()
    other_names.add({"a": np.ones(2, np.float32)}, 1.0)
    with pytest.raises(ValueError, match="different tensors"):
        other_names.add({"b": np.ones(2, np.float32)}, 1.0)
    running = RunningWeightedMean()
    running.add({"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}, 1.0)
    with pytest.raises(ValueError, match="'b' does not match .*different sizes"):
        running.add({"a": np.full(2, 5.0, np.float32), "b": np.ones(3, np.float32)}, 1.0)
    np.testing.assert_array_equal(running.result()["a"], [1.0, 1.0])  # the refused update left no trace


def test_a_released_row_leaves_no_trace_and_is_reused():
    layout = Layout({"w": (4,)})
    running = RunningWeightedMean(layout, max_rows=2)
    refused = running.reserve(layout)
    refused.values[:] = np.nan            # an upload that turned out to hold NaN, then was refused
    running.release(refused)
    for value, weight in [(1.0, 1.0), (4.0, 2.0), (7.0, 1.0)]:  # more updates than rows: folds in between
        slot = running.reserve(layout)
        slot.values[:] = value
        running.add(layout.views(slot.values), weight, slot=slot)
    np.testing.assert_array_equal(running.result()["w"], np.full(4, 4.0, np.float32))


def test_uploads_in_flight_keep_their_rows_while_others_fold():
    layout = Layout({"w": (3,)})
    running = RunningWeightedMean(layout, max_rows=2)
    in_flight = running.reserve(layout)   # still streaming
    in_flight.values[:] = np.inf          # half-written garbage must never reach the sum
    done = running.reserve(layout)
    done.values[:] = 2.0
    running.add(layout.views(done.values), 1.0, slot=done)
    assert running.reserve(layout) is not None  # the committed row was folded and is free again
    running.add({"w": np.full(3, 5.0, np.float32)}, 1.0)  # no free row: folded on its own
    in_flight.values[:] = 8.0
    running.add(layout.views(in_flight.values), 2.0, slot=in_flight)
    np.testing.assert_array_equal(running.result()["w"], np.full(3, (2.0 + 5.0 + 16.0) / 4, np.float32))


def test_a_reserved_row_is_refused_for_another_layout():
    running = RunningWeightedMean(Layout({"a": (2,), "b": (3,)}))
    assert running.reserve(Layout({"b": (3,), "a": (2,)})) is None  # other order: received apart, then copied


def test_an_add_after_the_result_continues_the_sum():
    running = RunningWeightedMean()
    running.add({"w": np.full(3, 2.0, np.float32)}, 1.0)
    np.testing.assert_array_equal(running.result()["w"], np.full(3, 2.0, np.float32))
    running.add({"w": np.full(3, 5.0, np.float32)}, 2.0)
    np.testing.assert_allclose(running.result()["w"], np.full(3, 4.0), rtol=4 * U)


def test_running_mean_memory_is_its_rows_whatever_the_number_of_updates():
    import tracemalloc

    size = 1 << 18
    layout = Layout({"w": (size,)})
    update = np.ones(size, np.float32)
    peaks = []
    for count in (mean_module.ROWS, 6 * mean_module.ROWS):
        tracemalloc.start()
        try:
            running = RunningWeightedMean(layout)
            for _ in range(count):
                slot = running.reserve(layout)
                np.copyto(slot.values, update)
                running.add(layout.views(slot.values), 0.5, slot=slot)
            running.result()
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    rows_bytes = (mean_module.ROWS + 1) * size * 4  # the rows and the float32 sum
    assert peaks[0] <= rows_bytes * 1.05 and peaks[1] <= rows_bytes * 1.05, peaks


def test_rows_of_a_big_model_stay_within_the_buffer_budget():
    layout = Layout({"w": (1000,)})
    running = RunningWeightedMean(layout, buffer_bytes=3 * 4000 + 1)
    assert running._rows.per_block == 3
    tiny_budget = RunningWeightedMean(layout, buffer_bytes=10)
    assert tiny_budget._rows.per_block == 1  # always one row, however big the model


def test_a_result_handed_out_never_changes():
    running = RunningWeightedMean()
    running.add({"w": np.full(3, 2.0, np.float32)}, 1.0)
    first = running.result()["w"]
    running.add({"w": np.full(3, 8.0, np.float32)}, 1.0)
    running.result()
    np.testing.assert_array_equal(first, np.full(3, 2.0, np.float32))  # e.g. a global model being served
