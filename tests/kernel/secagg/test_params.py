"""The ring and the quantiser: settings checked once, no sum can wrap, rounding unbiased within its bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.errors import ConfigError
from fedbroker.secagg import SecAggParams, dequantise_sum, quantise, sum_error_bound
from fedbroker.secagg.local import run_round

SEED = b"round-seed-0000000000"


@pytest.mark.parametrize("n", [2, 10, 100, 255, 1000, 5000])
def test_worst_case_all_plus_b_cannot_wrap_at_the_chosen_bits(n: int) -> None:
    params = SecAggParams.choose(n, 0.5)
    top = quantise(np.full(4, params.clip), params, np.random.default_rng(0))
    assert (top == params.levels).all()
    assert n * params.levels < 2**params.bits  # the integer sum of n top levels fits the ring
    bottom = quantise(np.full(4, -params.clip), params, np.random.default_rng(0))
    assert (bottom == 0).all()


def test_a_round_of_all_plus_b_inputs_sums_to_n_times_b() -> None:
    n = 6
    params = SecAggParams.choose(n, 2.0)
    inputs = {f"w{i}": np.full(50, 2.0) for i in range(n)}
    result = run_round(inputs, params, SEED, rng=np.random.default_rng(1))
    np.testing.assert_allclose(result.total, n * 2.0, atol=result.error_max)
    inputs = {f"w{i}": np.full(50, 9.0) for i in range(n)}  # clipped to +B first
    result = run_round(inputs, params, SEED, rng=np.random.default_rng(1))
    np.testing.assert_allclose(result.total, n * 2.0, atol=result.error_max)


def test_choose_picks_32_bits_for_small_rounds_and_64_when_precision_needs_it() -> None:
    assert SecAggParams.choose(100, 1.0).bits == 32
    assert SecAggParams.choose(1000, 1.0).bits == 64  # 24 bits + log2(1001) > 32
    assert SecAggParams.choose(10, 1.0, precision_bits=40).bits == 64
    with pytest.raises(ConfigError, match="precision_bits"):
        SecAggParams.choose(10, 1.0, precision_bits=62)


def test_choose_uses_everyone_for_small_n_and_a_sparse_graph_for_large_n() -> None:
    small, large = SecAggParams.choose(10, 1.0), SecAggParams.choose(100, 1.0)
    assert small.neighbours == 9 and small.complete_graph(10)
    assert 10 <= large.neighbours <= 30 and not large.complete_graph(100)
    assert large.threshold > (large.neighbours + 1) // 2  # a strict majority of a secret's holders


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"n_max": 1}, "secagg.n_max"),
    ({"bits": 7}, "secagg.bits"),
    ({"bits": 65}, "secagg.bits"),
    ({"clip": 0.0}, "secagg.clip"),
    ({"clip": float("nan")}, "secagg.clip"),
    ({"threshold": 1}, "secagg.threshold"),
    ({"threshold": 11}, "secagg.threshold"),  # 9 neighbours + itself = 10 holders
    ({"neighbours": 0}, "secagg.neighbours"),
    ({"n_max": 300, "bits": 8}, "secagg.bits"),  # fewer than 2 levels: the sum would wrap
])
def test_bad_settings_name_their_field(kwargs: dict[str, object], field: str) -> None:
    base: dict[str, object] = {"n_max": 10, "threshold": 6, "neighbours": 9, "bits": 32, "clip": 1.0}
    with pytest.raises(ConfigError, match=field):
        SecAggParams(**{**base, **kwargs})  # type: ignore[arg-type]


def test_non_finite_or_non_flat_input_is_refused() -> None:
    params = SecAggParams.choose(4, 1.0)
    with pytest.raises(ConfigError, match="NaN"):
        quantise(np.array([0.0, np.nan]), params, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="flat"):
        quantise(np.zeros((2, 2)), params, np.random.default_rng(0))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 60), clip=st.floats(1e-3, 1e3), seed=st.integers(0, 2**32), bits=st.sampled_from([16, 32, 64]))
def test_dequantised_sum_is_within_the_worst_case_bound(n: int, clip: float, seed: int, bits: int) -> None:
    params = SecAggParams(n_max=n, threshold=2, neighbours=n - 1, bits=bits, clip=clip)
    rng = np.random.default_rng(seed)
    xs = rng.uniform(-clip, clip, size=(n, 64))
    total = np.zeros(64, dtype=params.dtype)
    for x in xs:
        total += quantise(x, params, rng)
    worst, _ = sum_error_bound(params, n)
    error = np.abs(dequantise_sum(total, n, params) - xs.sum(axis=0))
    assert (error <= worst * (1 + 1e-9) + 1e-12 * n * clip).all()


def test_stochastic_rounding_is_unbiased_and_its_spread_within_the_std_bound() -> None:
    params = SecAggParams(n_max=8, threshold=2, neighbours=7, bits=12, clip=1.0)  # coarse: Δ ≈ 0.0039
    rng = np.random.default_rng(7)
    x = np.full(200_000, 0.123456)
    errors = dequantise_sum(quantise(x, params, rng), 1, params) - x
    _, std_bound = sum_error_bound(params, 1)
    assert abs(errors.mean()) < 5 * std_bound / np.sqrt(x.size)
    assert errors.std() <= std_bound
    assert np.abs(errors).max() < params.step


def test_describe_reports_the_settings_and_their_error_bounds() -> None:
    view = SecAggParams.choose(50, 0.1).describe()
    assert {"n_max", "threshold", "neighbours", "bits", "clip", "levels", "step", "sum_error_max",
            "sum_error_std"} <= set(view)
    assert view["sum_error_max"] == pytest.approx(50 * 0.2 / view["levels"])
