"""What keeps a close bounded and safe to repeat, and one worker's weight bounded (issue 12, items 5 and 6):
algorithm parameters bounded at submission, cooperative deadlines with documented fallbacks, a CloseRound
repeated while the first runs, keepalive settings both sides agree on, sample counts bounded by what a
worker registered, and a cap on any one update's share."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators import combine as combine_module
from fedbroker.aggregators.job_state import Job
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.weighting import FedAvgWeighting
from fedbroker.errors import ConfigError, ConfigErrors, Rejection, UploadRejected
from fedbroker.job.spec import parse_model
from fedbroker.job.submission import accept_job
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec
from fedbroker.rpc.plumbing import CHANNEL_OPTIONS

SPEC = parse_model({"input_shape": [4], "layers": [
    {"type": "Linear", "in_features": 4, "out_features": 3}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 3, "out_features": 2}]})
AGG = {"alignment": "none", "weighting": "fedavg", "selection": "all"}


def weights(value: float) -> dict[str, np.ndarray]:
    return {"0.weight": np.full((3, 4), value, np.float32), "0.bias": np.full(3, value, np.float32),
            "2.weight": np.full((2, 3), value, np.float32), "2.bias": np.full(2, value, np.float32)}


def stream(tensors: dict[str, np.ndarray], *, worker: str, n: int, job: str = "j", rnd: int = 1) -> Any:
    header = pb.UpdateHeader(job_id=job, round=rnd, worker_id=worker, num_samples=n,
                             tensors=codec.tensor_specs(tensors))
    return codec.stream_messages(pb.UpdateChunk, header, tensors, chunk_bytes=16)


def new_book(aggregation: dict[str, Any] = AGG, workers: tuple[str, ...] = ("w1", "w2", "w3"), **book: Any) -> RoundBook:
    b = RoundBook(max_update_bytes=10_000, clock=lambda: 1000.0, **book)
    b.put_global("j", 1, SPEC.to_json(), weights(0.0))
    b.open_round("j", 1, list(workers), deadline=2000.0, aggregation=aggregation, seed=0,
                 num_samples={w: 1000 for w in workers})
    return b


# ----- item 5 (a): every algorithm parameter is bounded at submission, named in the error ----------------


def _job(**aggregation: Any) -> dict[str, Any]:
    return {"name": "j", "category": "digits", "model": SPEC.to_dict(), "aggregation": aggregation}


@pytest.mark.parametrize(("aggregation", "named"), [
    ({"selection": "ga", "selection_params": {"m": 2, "population": 20_000_000}}, "population"),
    ({"selection": "ga", "selection_params": {"m": 2, "generations": 10 ** 9}}, "generations"),
    ({"selection": "ga", "selection_params": {"m": 10 ** 6}}, "m must be an integer in [1, 100000]"),
    ({"selection": "ga", "selection_params": {"m": 50_000, "population": 1000}}, "population × m"),
    ({"selection": "ga", "selection_params": {"m": 2, "ga_gap": 10 ** 9}}, "ga_gap"),
    ({"selection": "ga", "selection_params": {"m": 2, "mu": 1e300}}, "mu"),
    ({"selection": "ga", "selection_params": {"m": 2, "probe_size": 10 ** 9}}, "probe_size"),
    ({"selection": "random", "selection_params": {"m": 10 ** 9}}, "m must be an integer in [1, 100000]"),
    ({"alignment": "pfnm", "alignment_params": {"iterations": 10 ** 9}}, "iterations must be an integer in [0, 100]"),
    ({"alignment": "pfnm", "alignment_params": {"max_global_width": 10 ** 9}}, "max_global_width"),
    ({"alignment": "pfnm", "alignment_params": {"count_clip": 10 ** 12}}, "count_clip"),
    ({"alignment": "pfnm", "alignment_params": {"sigma2": 1e-300}}, "sigma2"),
    ({"alignment": "pfnm", "alignment_params": {"sigma0_2": 1e300}}, "sigma0_2"),
    ({"alignment": "nafi", "alignment_params": {"iterations": 10 ** 9}}, "iterations"),
    ({"alignment": "nafi", "alignment_params": {"lam": 1e12}}, "lam"),
    ({"alignment": "feddna", "alignment_params": {"freeze_after": 10 ** 12}}, "freeze_after"),
    ({"weighting": "fedavg", "weighting_params": {"max_share": 0}}, "max_share"),
    ({"weighting": "dwfed", "weighting_params": {"max_share": 1.5}}, "max_share"),
])
def test_a_parameter_beyond_its_bound_is_refused_at_submission_naming_it(aggregation: dict[str, Any],
                                                                          named: str) -> None:
    with pytest.raises(ConfigError) as info:
        accept_job(_job(**aggregation))
    errors = info.value.errors if isinstance(info.value, ConfigErrors) else [info.value]
    assert any(named in str(e) and e.field.startswith("aggregation.") for e in errors), str(info.value)


def test_parameters_at_their_bounds_are_accepted() -> None:
    accept_job(_job(selection="ga", selection_params={"m": 2, "population": 1000, "generations": 1000,
                                                      "fitness": "reported_loss", "ga_gap": 5}))  # rounds: 5
    accept_job(_job(alignment="pfnm", alignment_params={"iterations": 100, "max_global_width": 65536}))
    accept_job(_job(weighting="fedavg", weighting_params={"max_share": 1.0}))


# ----- item 5 (b): an alignment past its deadline stops, and the round is the weighted mean -----------------


def test_an_alignment_past_its_time_limit_falls_back_to_the_weighted_mean(caplog: pytest.LogCaptureFixture) -> None:
    book = new_book({"alignment": "feddna", "weighting": "fedavg", "selection": "all"},
                    alignment_time_limit_s=-1.0)
    book.receive_update(stream(weights(1.0), worker="w1", n=10))
    book.receive_update(stream(weights(4.0), worker="w2", n=30))
    result = book.close("j", 1)
    assert result.stats["alignment_fallback"] == 1.0
    assert "alignment stopped" in caplog.text and "passed its time limit" in caplog.text
    for name, array in book.global_model("j")[2].items():
        np.testing.assert_allclose(array, (10 * 1.0 + 30 * 4.0) / 40, rtol=1e-6, err_msg=name)


def test_an_alignment_within_its_time_limit_aligns() -> None:
    book = new_book({"alignment": "feddna", "weighting": "fedavg", "selection": "all"})
    book.receive_update(stream(weights(1.0), worker="w1", n=10))
    book.receive_update(stream(weights(4.0), worker="w2", n=30))
    assert book.close("j", 1).stats["alignment_fallback"] == 0.0


# ----- item 5 (c): CloseRound is safe to repeat ------------------------------------------------------------


def test_a_close_repeated_while_the_first_runs_returns_the_first_closes_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    book = new_book()
    book.receive_update(stream(weights(1.0), worker="w1", n=10))
    entered, release = threading.Event(), threading.Event()
    real_combine = combine_module.combine

    def slow_combine(*args: Any, **kwargs: Any) -> Any:  # the first close aggregates until released
        entered.set()
        assert release.wait(60)
        return real_combine(*args, **kwargs)

    monkeypatch.setattr("fedbroker.aggregators.round_book.combine", slow_combine)
    asked: list[int] = []
    real_repeated = Job.repeated_close
    monkeypatch.setattr(Job, "repeated_close", lambda self, n: (asked.append(n), real_repeated(self, n))[1])
    results: dict[str, Any] = {}

    def close(name: str) -> None:
        try:
            results[name] = book.close("j", 1)
        except Exception as exc:  # the test reports it
            results[name] = exc

    first = threading.Thread(target=close, args=("first",))
    first.start()
    assert entered.wait(60)
    retry = threading.Thread(target=close, args=("retry",))  # the coordinator lost its connection and retries
    retry.start()
    deadline = threading.Event()
    for _ in range(6000):  # the retry has looked at the round (under the book's lock) while it is closing
        if len(asked) >= 2:
            break
        deadline.wait(0.01)
    assert len(asked) >= 2
    release.set()
    first.join(60)
    retry.join(60)
    assert not isinstance(results["first"], Exception), results["first"]
    assert not isinstance(results["retry"], Exception), results["retry"]
    assert results["retry"].model_version == results["first"].model_version == 2
    assert book.global_model("j")[0] == 2  # closed once: no version 3
    assert book.close("j", 1).model_version == 2  # and a retry after it, too


def test_a_close_repeated_after_the_first_failed_closes_the_round_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    book = new_book()
    book.receive_update(stream(weights(1.0), worker="w1", n=10))
    real_combine = combine_module.combine
    calls: list[int] = []

    def failing_once(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the first close failed")
        return real_combine(*args, **kwargs)

    monkeypatch.setattr("fedbroker.aggregators.round_book.combine", failing_once)
    with pytest.raises(RuntimeError):
        book.close("j", 1)
    assert book.close("j", 1).model_version == 2


# ----- item 5 (d): keepalive settings that client and server agree on -------------------------------------


def test_the_server_accepts_every_keepalive_ping_the_client_sends() -> None:
    options = dict(CHANNEL_OPTIONS)
    # the client pings every keepalive_time_ms, with or without a call in flight and without data (a long
    # CloseRound): the server must accept pings at least that often, or it answers GOAWAY too_many_pings
    assert options["grpc.http2.min_ping_interval_without_data_ms"] < options["grpc.keepalive_time_ms"]
    assert options["grpc.keepalive_permit_without_calls"] == 1
    assert options["grpc.http2.max_pings_without_data"] == 0  # the client keeps pinging through a long call


# ----- item 6: a worker's sample count is bounded by what it registered; a cap on any one share ----------


def test_an_upload_claiming_more_samples_than_registered_is_refused() -> None:
    book = new_book()
    book.receive_update(stream(weights(1.0), worker="w1", n=1000))  # exactly what it registered
    with pytest.raises(UploadRejected) as info:
        book.receive_update(stream(weights(1e3), worker="w2", n=10 ** 15))
    assert info.value.reason is Rejection.TOO_MANY_SAMPLES and info.value.reason.final
    assert "claims 1000000000000000 samples, more than the 1000 it registered" in str(info.value)
    book.close("j", 1)
    np.testing.assert_allclose(book.global_model("j")[2]["0.weight"], 1.0)  # the accepted update alone


def test_the_registered_sample_counts_survive_a_restart_from_the_spool(tmp_path: Any) -> None:
    first = RoundBook(max_update_bytes=10_000, clock=lambda: 1000.0, spool_dir=tmp_path)
    first.put_global("j", 1, SPEC.to_json(), weights(0.0))
    first.open_round("j", 1, ["w1", "w2"], deadline=2000.0, aggregation=AGG, seed=0, num_samples={"w1": 5, "w2": 5})
    first.stop()
    restarted = RoundBook(max_update_bytes=10_000, clock=lambda: 1000.0, spool_dir=tmp_path)
    with pytest.raises(UploadRejected, match="more than the 5 it registered"):
        restarted.receive_update(stream(weights(1.0), worker="w1", n=6))


def test_max_share_bounds_how_far_one_poisoned_update_moves_the_model() -> None:
    workers = tuple(f"w{i}" for i in range(5))
    book = new_book({"alignment": "none", "weighting": "fedavg", "selection": "all",
                     "weighting_params": {"max_share": 0.25}}, workers=workers)
    book.receive_update(stream(weights(1000.0), worker="w0", n=1000))  # the poisoner claims all it registered
    for w in workers[1:]:
        book.receive_update(stream(weights(0.0), worker=w, n=1))
    result = book.close("j", 1)
    assert max(u.weight for u in result.updates) == pytest.approx(0.25)
    for name, array in book.global_model("j")[2].items():  # 0.25 of the way to the poisoned update, not 99.6%
        np.testing.assert_allclose(array, 250.0, rtol=1e-6, err_msg=name)


def test_max_share_caps_and_renormalises_in_proportion() -> None:
    w, fell_back = FedAvgWeighting(max_share=0.4).normalise(np.array([90.0, 6.0, 3.0, 1.0]))
    assert not fell_back
    np.testing.assert_allclose(w, [0.4, 0.6 * 0.6, 0.6 * 0.3, 0.6 * 0.1])
    uniform, _ = FedAvgWeighting(max_share=0.3).normalise(np.array([9.0, 1.0]))  # 2 updates cannot hold a 0.3 cap
    np.testing.assert_allclose(uniform, [0.5, 0.5])
    plain, _ = FedAvgWeighting().normalise(np.array([9.0, 1.0]))
    np.testing.assert_allclose(plain, [0.9, 0.1])
