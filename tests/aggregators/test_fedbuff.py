"""FedBuff's arithmetic: one version with fresh updates is FedAvg, staleness only ever discounts, and a
refused stale update changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.aggregators.fedbuff import Buffer, StaleUpdate, fedbuff_version
from fedbroker.aggregators.mean import RunningWeightedMean
from fedbroker.algorithms.params import Staleness, staleness_function
from fedbroker.errors import ConfigError
from fedbroker.job.spec import STALENESS_FUNCTIONS

SHAPES = {"w": (3, 4), "b": (3,)}


def _model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=10_000), min_size=1, max_size=12), st.integers(0, 2**31 - 1))
def test_fresh_buffer_of_every_worker_is_synchronous_fedavg(counts: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    current = _model(rng)
    updates = [_model(rng) for _ in counts]
    new = fedbuff_version(current, [(u, current, float(n), 0) for u, n in zip(updates, counts)],
                          staleness=Staleness("constant"), server_lr=1.0)
    fedavg = RunningWeightedMean()
    for u, n in zip(updates, counts):
        fedavg.add(u, float(n))
    expected = fedavg.result()
    for name in SHAPES:
        np.testing.assert_allclose(new[name], expected[name], rtol=1e-5, atol=1e-5)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(STALENESS_FUNCTIONS), st.floats(0.0, 50.0), st.floats(0.0, 20.0), st.integers(0, 500))
def test_staleness_factor_never_increases_with_tau(kind: str, a: float, b: float, tau: int) -> None:
    params = {"constant": {}, "polynomial": {"a": a}, "hinge": {"a": a, "b": b}}[kind]
    s = staleness_function(kind, params)
    assert 0.0 < s(tau + 1) <= s(tau) <= 1.0
    assert s(0) == 1.0


def test_defaults_are_the_papers() -> None:
    poly = staleness_function("polynomial")
    hinge = staleness_function("hinge")
    assert poly(3) == pytest.approx(4 ** -0.5)
    assert hinge(4) == 1.0 and hinge(5) == pytest.approx(1 / 11)
    assert staleness_function("constant")(99) == 1.0


def test_a_refused_stale_update_changes_nothing() -> None:
    rng = np.random.default_rng(0)
    current, base = _model(rng), _model(rng)
    buffer = Buffer(buffer_size=3, max_staleness=2, staleness=staleness_function("polynomial"))
    buffer.add(_model(rng), base, weight=5.0, tau=1)
    before = buffer.apply(current)
    with pytest.raises(StaleUpdate, match="3 version"):
        buffer.add(_model(rng), base, weight=1e6, tau=3)
    assert buffer.count == 1 and buffer.total_weight == 5.0
    after = buffer.apply(current)
    for name in SHAPES:
        np.testing.assert_array_equal(before[name], after[name])


def test_staleness_scales_the_delta_but_not_the_normalisation() -> None:
    current = {"w": np.zeros(2, dtype=np.float32)}
    fresh, stale = {"w": np.array([1.0, 0.0], np.float32)}, {"w": np.array([0.0, 1.0], np.float32)}
    s = staleness_function("polynomial", {"a": 1.0})
    new = fedbuff_version(current, [(fresh, current, 1.0, 0), (stale, current, 1.0, 3)], staleness=s,
                          server_lr=2.0)
    # η·(½·1·Δ_fresh + ½·¼·Δ_stale)
    np.testing.assert_allclose(new["w"], [1.0, 0.25])


def test_delta_is_taken_against_each_updates_own_base_version() -> None:
    current = {"w": np.array([10.0], np.float32)}
    old_base = {"w": np.array([4.0], np.float32)}
    update = {"w": np.array([5.0], np.float32)}  # one step of +1 from version τ
    new = fedbuff_version(current, [(update, old_base, 1.0, 2)], staleness=Staleness("constant"))
    np.testing.assert_allclose(new["w"], [11.0])


def test_buffer_is_full_at_buffer_size_and_empty_after_reset() -> None:
    base = {"w": np.zeros(1, np.float32)}
    buffer = Buffer(buffer_size=2, max_staleness=0)
    buffer.add({"w": np.ones(1, np.float32)}, base, weight=1.0, tau=0)
    assert not buffer.full
    buffer.add({"w": np.ones(1, np.float32)}, base, weight=1.0, tau=0)
    assert buffer.full
    buffer.reset()
    assert buffer.count == 0 and not buffer.full
    with pytest.raises(ValueError, match="no update"):
        buffer.apply(base)


@pytest.mark.parametrize(("kind", "params", "field"), [
    ("linear", {}, "schedule.staleness"),
    ("polynomial", {"b": 1}, "schedule.staleness_params.b"),
    ("hinge", {"a": -1}, "schedule.staleness_params.a"),
    ("hinge", {"a": "x"}, "schedule.staleness_params.a"),
    ("polynomial", {"a": float("nan")}, "schedule.staleness_params.a"),
])
def test_bad_staleness_settings_name_the_field(kind: str, params: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        staleness_function(kind, params)
    assert info.value.field == field


def test_non_positive_weights_and_mismatched_tensors_are_refused_before_anything_changes() -> None:
    base = {"w": np.zeros(2, np.float32)}
    buffer = Buffer(buffer_size=2, max_staleness=1)
    with pytest.raises(ValueError, match="positive"):
        buffer.add({"w": np.ones(2, np.float32)}, base, weight=0.0, tau=0)
    with pytest.raises(ValueError, match="differ"):
        buffer.add({"w": np.ones(3, np.float32)}, base, weight=1.0, tau=0)
    assert buffer.count == 0
