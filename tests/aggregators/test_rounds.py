"""The aggregation service's rules, without a network: validation, idempotency, FedAvg."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedbroker.aggregators import installed_jobs
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.errors import Conflict, NotFound, UploadRejected
from fedbroker.job.settings import sections_settings
from fedbroker.job.spec import parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec

SPEC = parse_model({"input_shape": [4], "layers": [
    {"type": "Linear", "in_features": 4, "out_features": 3}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 3, "out_features": 2}]})
AGG = {"alignment": "none", "weighting": "fedavg", "selection": "all"}


def weights(value: float) -> dict[str, np.ndarray]:
    return {"0.weight": np.full((3, 4), value, np.float32), "0.bias": np.full(3, value, np.float32),
            "2.weight": np.full((2, 3), value, np.float32), "2.bias": np.full(2, value, np.float32)}


def stream(tensors, *, job="j", rnd=1, worker="w1", n=10, **extra):
    header = pb.UpdateHeader(job_id=job, round=rnd, worker_id=worker, num_samples=n,
                             tensors=codec.tensor_specs(tensors), **extra)
    return codec.stream_messages(pb.UpdateChunk, header, tensors, chunk_bytes=16)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def book():
    clock = Clock()
    b = RoundBook(max_update_bytes=10_000, clock=clock)
    b.clock_ = clock
    b.put_global("j", 1, SPEC.to_json(), weights(0.0))
    b.open_round("j", 1, ["w1", "w2", "w3"], deadline=2000.0, aggregation=AGG, seed=0)
    return b


def test_fedavg_is_the_sample_weighted_mean(book):
    book.receive_update(stream(weights(1.0), worker="w1", n=10))
    book.receive_update(stream(weights(4.0), worker="w2", n=30))
    result = book.close("j", 1)
    assert result.model_version == 2 and result.aggregated == ["w1", "w2"]
    version, _, state = book.global_model("j")
    assert version == 2
    np.testing.assert_allclose(state["0.weight"], (10 * 1.0 + 30 * 4.0) / 40)
    assert {u.worker_id: u.weight for u in result.updates} == {"w1": 0.25, "w2": 0.75}


def test_duplicate_upload_is_counted_once(book):
    first = book.receive_update(stream(weights(1.0), worker="w1", n=10))
    again = book.receive_update(stream(weights(100.0), worker="w1", n=10))
    assert not first.duplicate and again.duplicate and again.sha256 == first.sha256
    book.receive_update(stream(weights(3.0), worker="w2", n=10))
    book.close("j", 1)
    np.testing.assert_allclose(book.global_model("j")[2]["0.bias"], 2.0)


def test_previous_global_version_stays_downloadable(book):
    book.receive_update(stream(weights(1.0)))
    book.close("j", 1)
    assert book.global_model("j", 1)[0] == 1
    with pytest.raises(NotFound, match="version 7"):
        book.global_model("j", 7)


def bad_cases():
    w = weights(1.0)
    wrong_shape = dict(w, **{"0.weight": np.ones((4, 3), np.float32)})
    wrong_dtype = dict(w, **{"0.bias": np.ones(3, np.float64)})
    extra = dict(w, **{"9.weight": np.ones(1, np.float32)})
    missing = {k: v for k, v in w.items() if k != "2.bias"}
    nan = dict(w, **{"2.weight": np.full((2, 3), np.nan, np.float32)})
    inf = dict(w, **{"0.bias": np.array([0, np.inf, 0], np.float32)})
    return [
        ("unknown_job", lambda: stream(w, job="nope"), "unknown job 'nope'"),
        ("round_closed", lambda: stream(w, rnd=5), "round 5 of job 'j' lies past this service's state"),
        ("unknown_worker", lambda: stream(w, worker="mallory"), "'mallory' is not a participant"),
        ("wrong_shape", lambda: stream(wrong_shape), "'0.weight' has shape [4, 3], expected [3, 4]"),
        ("wrong_dtype", lambda: stream(wrong_dtype), "'0.bias' has dtype float64"),
        ("unknown_tensor", lambda: stream(extra), "unknown tensor '9.weight'"),
        ("missing_tensor", lambda: stream(missing), "'2.bias' is missing"),
        ("non_finite", lambda: stream(nan), "'2.weight' contains NaN or Inf"),
        ("non_finite", lambda: stream(inf), "'0.bias' contains NaN or Inf"),
        ("bad_header", lambda: stream(w, n=0), "num_samples must be positive"),
        ("truncated", lambda: list(stream(w))[:-2], "stream ended"),
        ("too_large", lambda: stream({f"{i}.weight": np.ones(1000, np.float32) for i in range(3)}), "limit"),
    ]


@pytest.mark.parametrize("reason, make, text", bad_cases(), ids=[c[0] + "-" + str(i) for i, c in enumerate(bad_cases())])
def test_bad_upload_is_refused_by_name_and_loses_nothing(book, reason, make, text):
    book.receive_update(stream(weights(2.0), worker="w2", n=5))
    with pytest.raises(UploadRejected) as info:
        book.receive_update(make())
    assert info.value.reason == reason and text in str(info.value), str(info.value)
    assert book.status("j", 1) == (["w2"], True)
    book.close("j", 1)
    np.testing.assert_allclose(book.global_model("j")[2]["0.weight"], 2.0)


def test_late_upload_is_refused_with_a_reason(book):
    book.clock_.now = 2000.5
    with pytest.raises(UploadRejected, match="deadline passed") as info:
        book.receive_update(stream(weights(1.0)))
    assert info.value.reason == "late"


def test_upload_for_a_closed_round_is_refused(book):
    book.receive_update(stream(weights(1.0), worker="w1"))
    book.close("j", 1)
    with pytest.raises(UploadRejected) as info:
        book.receive_update(stream(weights(1.0), worker="w2"))
    assert info.value.reason == "round_closed"


def test_round_without_uploads_cannot_close(book):
    with pytest.raises(Conflict, match="no accepted update"):
        book.close("j", 1)


def test_open_round_is_idempotent_but_refuses_other_participants(book):
    assert book.open_round("j", 1, ["w3", "w2", "w1"], 2000.0, AGG) == 1
    with pytest.raises(Conflict, match="other participants"):
        book.open_round("j", 1, ["w1"], 2000.0, AGG)


def test_global_model_must_match_its_spec():
    book = RoundBook()
    with pytest.raises(UploadRejected, match="'0.weight' has shape"):
        book.put_global("k", 1, SPEC.to_json(), dict(weights(0.0), **{"0.weight": np.ones((2, 2), np.float32)}))


def test_selection_and_weighting_plug_in_by_name(book):
    book.installed.install(sections_settings("k", aggregation={**AGG, "weighting": "uniform", "selection": "random",
                                                               "selection_params": {"m": 2}}))
    book.put_global("k", 1, SPEC.to_json(), weights(0.0))
    book.open_round("k", 2, ["w1", "w2", "w3"], 2000.0, seed=3)
    for i, w in enumerate(["w1", "w2", "w3"]):
        book.receive_update(stream(weights(float(i)), job="k", rnd=2, worker=w, n=10 * (i + 1)))
    result = book.close("k", 2)
    assert len(result.aggregated) == 2
    expected = np.mean([float(["w1", "w2", "w3"].index(w)) for w in result.aggregated])
    np.testing.assert_allclose(book.global_model("k")[2]["0.bias"], expected, rtol=1e-6)
    assert json.loads(result.model_spec_json) == SPEC.to_dict()


def test_a_jobs_algorithms_are_built_once_not_every_round(book, monkeypatch):
    built = []
    real = installed_jobs.build_algorithms
    monkeypatch.setattr(installed_jobs, "build_algorithms", lambda installed: built.append(installed) or real(installed))
    first = book.table.jobs["j"].round.algorithms
    for number in (1, 2, 3):
        book.receive_update(stream(weights(1.0), rnd=number, worker="w1", n=10))
        book.close("j", number)
        book.open_round("j", number + 1, ["w1", "w2"], 2000.0, dict(AGG))
        assert book.table.jobs["j"].round.algorithms is first
    assert built == []
    book.receive_update(stream(weights(1.0), rnd=4, worker="w1", n=10))
    book.close("j", 4)
    with pytest.raises(Conflict, match="another aggregation section"):  # a job's settings never change
        book.open_round("j", 5, ["w1", "w2"], 2000.0, {**AGG, "weighting": "uniform"})
    assert built == []


def test_tensors_sent_in_another_order_are_averaged_by_name(book):
    book.receive_update(stream(weights(1.0), worker="w1", n=10))
    reordered = dict(reversed(list(weights(3.0).items())))  # received apart, then copied into a row by name
    book.receive_update(stream(reordered, worker="w2", n=10))
    book.close("j", 1)
    state = book.global_model("j")[2]
    for name in weights(0.0):
        np.testing.assert_allclose(state[name], 2.0)


def test_refused_uploads_give_back_the_rows_they_were_received_into(book):
    mean = book.table.jobs["j"].round.rows.mean
    free = mean.free_rows
    bad = weights(1.0)
    bad["2.bias"] = np.array([1.0, np.nan], np.float32)
    for _ in range(3 * free):  # more refusals than rows: a leaked row would run the mean out of rows
        with pytest.raises(UploadRejected, match="NaN"):
            book.receive_update(stream(bad, worker="w1"))
    assert mean.free_rows == free
    book.receive_update(stream(weights(5.0), worker="w1", n=10))
    assert mean.free_rows == free - 1  # the accepted upload holds the row it was received into
    book.close("j", 1)
    np.testing.assert_allclose(book.global_model("j")[2]["0.weight"], 5.0)


def test_a_round_that_keeps_every_update_averages_the_rows_it_received_them_into(book):
    book.put_global("k", 1, SPEC.to_json(), weights(0.0))
    book.open_round("k", 2, ["w1", "w2", "w3"], 2000.0, {**AGG, "selection": "random", "selection_params": {"m": 3}},
                    seed=1)
    for i, w in enumerate(["w1", "w2", "w3"]):
        book.receive_update(stream(weights(float(i + 1)), job="k", rnd=2, worker=w, n=10 * (i + 1)))
    rnd = book.table.jobs["k"].round
    assert all(e.slot is not None and np.shares_memory(e.tensors["0.weight"], e.slot.values)
               for e in rnd.accepted.values())
    book.close("k", 2)
    np.testing.assert_allclose(book.global_model("k")[2]["2.weight"], (10 * 1 + 20 * 2 + 30 * 3) / 60, rtol=1e-6)


def test_the_next_round_receives_into_the_rows_of_the_last_one(book):
    book.receive_update(stream(weights(1.0), worker="w1", n=10))
    first = book.table.jobs["j"].round.rows.mean.rows
    book.close("j", 1)
    book.open_round("j", 2, ["w1", "w2"], 2000.0, AGG)
    book.receive_update(stream(weights(3.0), rnd=2, worker="w2", n=10))
    assert book.table.jobs["j"].round.rows.mean.rows is first  # memory already mapped: no page faults on upload
    book.close("j", 2)
    np.testing.assert_allclose(book.global_model("j")[2]["0.weight"], 3.0)
    np.testing.assert_allclose(book.global_model("j", 2)[2]["0.weight"], 1.0)  # the kept version is untouched
