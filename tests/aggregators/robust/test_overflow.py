"""A finite upload can still overflow float32 arithmetic: 3e38 against g_0's sign made FLTrust's global model
NaN, and under plain FedAvg an infinite one. The rules compute in float64, an upload beyond the job's bound on
its values is refused at the door (`out_of_range`), and a close whose aggregate is not finite publishes nothing.

The pure rules here; the service over gRPC in tests/aggregators/robust/test_overflow_service.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedbroker.aggregators.admission import DERIVED_HEADROOM, check_finite, value_limit
from fedbroker.aggregators.robust import FLTrust, RobustInput
from fedbroker.aggregators.robust.base import combination, dots, uniform
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.errors import ConfigError, Conflict, Rejection, UploadRejected
from fedbroker.job.spec import AggregationConfig
from tests.aggregators.test_rounds import SPEC, stream, weights

RNG = np.random.default_rng(0)
HUGE = np.float32(3e38)


def test_fltrust_stays_finite_with_a_finite_update_of_3e38_against_g0() -> None:
    g0 = np.array([0.5, -0.25, 1.0, 0.75], dtype=np.float32)
    honest = np.array([[0.4, -0.2, 0.9, 0.7], [0.6, -0.3, 1.1, 0.8]], dtype=np.float32)
    evil = (-np.sign(g0) * HUGE).astype(np.float32)[None, :]
    with np.errstate(over="ignore"):
        assert not np.isfinite((evil @ g0)[0])  # what float32 arithmetic gave: -inf, then a NaN cosine
    result = FLTrust(probe_dataset="digits").aggregate(RobustInput(deltas=np.vstack([honest, evil]), weights=uniform(3), rng=RNG,
                                                       root_update=g0))
    assert np.all(np.isfinite(result.delta)) and np.all(np.isfinite(result.kept_weight))
    assert result.kept_weight[2] == 0.0  # pointing away from g_0: no trust
    assert np.linalg.norm(result.delta) <= np.linalg.norm(g0.astype(np.float64)) * (1 + 1e-6)


def test_fltrust_along_g0_with_3e38_is_rescaled_to_g0_not_overflowed() -> None:
    g0 = np.array([0.5, -0.25, 1.0], dtype=np.float32)
    evil = (np.sign(g0) * HUGE).astype(np.float32)[None, :]
    result = FLTrust(probe_dataset="digits").aggregate(RobustInput(deltas=evil, weights=uniform(1), rng=RNG, root_update=g0))
    assert np.all(np.isfinite(result.delta))
    np.testing.assert_allclose(np.linalg.norm(result.delta), np.linalg.norm(g0.astype(np.float64)), rtol=1e-6)


def test_combination_and_dots_sum_in_float64() -> None:
    d = np.full((3, 5), HUGE, dtype=np.float32)
    np.testing.assert_allclose(combination(d, np.array([1.0, 1.0, 1.0])), 3 * float(HUGE), rtol=1e-6)
    np.testing.assert_allclose(dots(d, np.ones(5, dtype=np.float32)), 5 * float(HUGE), rtol=1e-6)
    assert combination(d, np.zeros(3)).tolist() == [0.0] * 5


def test_the_derived_bound_follows_the_global_model_and_a_declared_one_wins() -> None:
    small = {"a": np.array([0.5, -0.25], np.float32)}
    big = {"a": np.array([3.0, -40.0], np.float32)}
    assert value_limit(declared=0.0, model=small) == DERIVED_HEADROOM  # at least 1 × the headroom
    assert value_limit(declared=0.0, model=big) == DERIVED_HEADROOM * 40.0
    assert value_limit(declared=7.5, model=big) == 7.5


def test_a_value_beyond_the_bound_is_refused_naming_the_tensor_and_the_bound() -> None:
    check_finite({"a": np.array([9.0, -10.0], np.float32)}, who="worker 'w'", limit=10.0)  # the bound itself: in
    with pytest.raises(UploadRejected) as info:
        check_finite({"a": np.array([1.0, -10.5], np.float32)}, who="worker 'w'", limit=10.0)
    assert info.value.reason == Rejection.OUT_OF_RANGE and Rejection.OUT_OF_RANGE.final
    assert "'a'" in str(info.value) and "10" in str(info.value) and "aggregation.max_update_value" in str(info.value)
    with pytest.raises(UploadRejected) as nan:
        check_finite({"a": np.array([np.nan], np.float32)}, who="worker 'w'", limit=math.inf)
    assert nan.value.reason == Rejection.NON_FINITE


@pytest.mark.parametrize("value", [-1.0, 1e21, math.inf, math.nan])
def test_the_declared_bound_is_checked_at_submission(value: float) -> None:
    with pytest.raises(ConfigError, match=r"aggregation\.max_update_value"):
        AggregationConfig(max_update_value=value)


@pytest.mark.parametrize("robust", ["none", "fltrust", "median"])
def test_the_book_refuses_a_3e38_upload_and_closes_the_honest_ones_to_a_finite_model(robust: str) -> None:
    book = RoundBook(max_update_bytes=10_000, probe_sets=lambda _n, size, seed: (
        np.random.default_rng(seed).normal(size=(size, 4)).astype(np.float32),
        np.random.default_rng(seed).integers(0, 2, size=size)))
    book.put_global("j", 1, SPEC.to_json(), weights(0.1))
    params = {"probe_dataset": "digits", "probe_size": 8} if robust == "fltrust" else {}
    book.open_round("j", 1, ["w1", "w2", "w3", "evil"], deadline=math.inf, seed=0, aggregation={
        "alignment": "none", "weighting": "fedavg", "selection": "all", "robust": robust, "robust_params": params})
    for worker, value in (("w1", 0.2), ("w2", 0.3), ("w3", 0.25)):
        book.receive_update(stream(weights(value), worker=worker, n=10))
    with pytest.raises(UploadRejected) as info:
        book.receive_update(stream({k: np.full_like(v, HUGE) for k, v in weights(0.0).items()}, worker="evil"))
    assert info.value.reason == Rejection.OUT_OF_RANGE
    result = book.close("j", 1)
    assert "evil" not in result.aggregated and result.model_version == 2
    assert all(np.all(np.isfinite(t)) for t in book.global_model("j")[2].values())


def test_a_close_whose_aggregate_is_not_finite_publishes_nothing() -> None:
    """A declared bound of 1e20 is the widest a job may set; the mean of such values stays finite, so the
    failure is made here by a rule that misbehaves: the round stays open and the version is not bumped."""
    book = RoundBook(max_update_bytes=10_000)
    book.put_global("j", 1, SPEC.to_json(), weights(0.0))
    book.open_round("j", 1, ["w1"], deadline=math.inf, seed=0, aggregation={
        "alignment": "none", "weighting": "fedavg", "selection": "all", "robust": "norm_bound",
        "robust_params": {"max_norm": 1.0}})
    book.receive_update(stream(weights(0.5), worker="w1"))
    rule = book.table.jobs["j"].round.algorithms.robust  # type: ignore[union-attr]
    real = type(rule).aggregate

    def broken(self, problem):  # type: ignore[no-untyped-def]
        out = real(self, problem)
        return type(out)(np.full_like(out.delta, np.nan), out.kept_weight, out.expected, out.notes)

    type(rule).aggregate = broken  # type: ignore[method-assign]
    try:
        with pytest.raises(Conflict, match="NaN or infinite.*not published"):
            book.close("j", 1)
    finally:
        type(rule).aggregate = real  # type: ignore[method-assign]
    assert book.global_model("j")[0] == 1  # nothing published
    assert book.status("j", 1) == (["w1"], True)  # the round is open again, its upload kept
