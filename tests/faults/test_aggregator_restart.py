"""The aggregation service killed mid-round and restarted: what it acknowledged survives (persist before the
receipt), and the coordinator copes with a service that comes back, with its spool or without any state."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.spool import Spool
from fedbroker.errors import UploadRejected
from tests.aggregators.test_rounds import SPEC, stream, weights
from tests.faults.harness import Federation, HoldsRound, Training, job, wait_for

pytestmark = [pytest.mark.integration]

FEDAVG = {"alignment": "none", "weighting": "fedavg", "selection": "all"}
RANDOM_TWO = {"alignment": "none", "weighting": "fedavg", "selection": "random", "selection_params": {"m": 2}}
WORKERS = ["w1", "w2", "w3"]


def opened(book: RoundBook, aggregation: dict) -> RoundBook:
    book.put_global("j", 1, SPEC.to_json(), weights(0.0))
    book.open_round("j", 1, WORKERS, deadline=4e9, aggregation=aggregation, seed=5)
    return book


def upload(book: RoundBook, worker: str, value: float, n: int) -> bool:
    return book.receive_update(stream(weights(value), worker=worker, n=n)).duplicate


@pytest.mark.timeout(30)
@pytest.mark.parametrize("aggregation", [FEDAVG, RANDOM_TWO], ids=["running-mean", "kept-updates"])
def test_restarted_service_keeps_acknowledged_uploads_and_closes_to_the_same_model(tmp_path: Path,
                                                                                   aggregation: dict) -> None:
    spooled = opened(RoundBook(spool_dir=tmp_path), aggregation)
    assert not upload(spooled, "w1", 1.0, 10)
    assert not upload(spooled, "w2", 4.0, 30)
    spooled.stop()  # the process dies; only its spool remains

    restarted = RoundBook(spool_dir=tmp_path)
    assert restarted.status("j", 1) == (["w1", "w2"], True)
    assert upload(restarted, "w1", 100.0, 10)  # a worker retrying after the restart is still counted once
    assert not upload(restarted, "w3", 2.0, 20)
    result = restarted.close("j", 1)

    uninterrupted = opened(RoundBook(), aggregation)
    for worker, value, n in (("w1", 1.0, 10), ("w2", 4.0, 30), ("w3", 2.0, 20)):
        upload(uninterrupted, worker, value, n)
    expected = uninterrupted.close("j", 1)
    assert (result.aggregated, result.model_version) == (expected.aggregated, expected.model_version)
    assert result.updates == expected.updates
    for name, array in uninterrupted.global_model("j")[2].items():
        np.testing.assert_array_equal(restarted.global_model("j")[2][name], array)


@pytest.mark.timeout(30)
def test_close_is_idempotent_across_a_restart_and_the_closed_round_stays_closed(tmp_path: Path) -> None:
    book = opened(RoundBook(spool_dir=tmp_path), FEDAVG)
    upload(book, "w1", 1.0, 10)
    first = book.close("j", 1)
    book.stop()
    restarted = RoundBook(spool_dir=tmp_path)
    assert restarted.close("j", 1) == first  # the coordinator lost our reply: it gets the same result again
    assert restarted.status("j", 1) == (["w1"], False)  # a redelivered task learns its update got in
    assert restarted.global_model("j")[0] == 2 and restarted.global_model("j", 1)[0] == 1
    with pytest.raises(UploadRejected) as info:
        restarted.receive_update(stream(weights(1.0), worker="w2"))
    assert info.value.reason == "round_closed"
    # A restarted coordinator re-installing the model it checkpointed keeps what the service holds.
    restarted.put_global("j", 2, first.model_spec_json, restarted.global_model("j")[2])
    assert restarted.global_model("j")[0] == 2 and restarted.close("j", 1) == first


@pytest.mark.timeout(30)
def test_upload_is_on_disk_before_its_receipt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    book = opened(RoundBook(spool_dir=tmp_path), FEDAVG)
    upload(book, "w1", 1.0, 10)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Spool, "save_update", disk_full)
    with pytest.raises(OSError):
        upload(book, "w2", 4.0, 30)  # no receipt: the worker keeps its task and retries
    assert book.status("j", 1) == (["w1"], True)
    monkeypatch.undo()
    book.stop()
    restarted = RoundBook(spool_dir=tmp_path)
    assert restarted.status("j", 1) == (["w1"], True)
    assert not upload(restarted, "w2", 4.0, 30)


@pytest.mark.timeout(30)
def test_reopening_the_open_round_keeps_its_uploads_across_a_restart(tmp_path: Path) -> None:
    book = opened(RoundBook(spool_dir=tmp_path), FEDAVG)
    upload(book, "w1", 1.0, 10)
    book.stop()
    restarted = RoundBook(spool_dir=tmp_path)
    restarted.put_global("j", 1, SPEC.to_json(), weights(0.0))  # a restarted coordinator resuming round 1
    assert restarted.open_round("j", 1, WORKERS, deadline=5e9, aggregation=FEDAVG, seed=5) == 1
    assert restarted.status("j", 1) == (["w1"], True)


def slow_round(fed: Federation) -> tuple[str, type[HoldsRound]]:
    """Two workers, the second holding its round-1 task (untrained) until the test releases it: returns the job
    once the fast one's round-1 update is accepted, so a restart falls mid-round by construction."""
    held = HoldsRound.at(1)
    fed.add_worker("fast", index=0, count=2)
    fed.add_worker("slow", index=1, count=2, agent_class=held)
    job_id = fed.submit(job(training={"rounds": 2}))
    # `held.holding` first: a worker holds a round-1 task only once the coordinator opened the round on the service
    # (asked any earlier, the service knows no round 1 yet and `status` raises: this wait once failed that way)
    wait_for(lambda: held.holding == {"slow"} and fed.book.status(job_id, 1)[0] == ["fast"], 30,
             "the fast worker's round-1 update, the slow one holding its task")
    return job_id, held


@pytest.mark.timeout(90)
def test_service_restarted_mid_round_keeps_the_uploads_it_acknowledged(federation: Federation,
                                                                       training: Training) -> None:
    fed = federation
    job_id, held = slow_round(fed)
    fed.stop_aggregator()
    fed.start_aggregator(spool=True)  # same port, same spool
    held.release.set()
    fed.wait_job(job_id, 60)
    assert [r.aggregated for r in fed.store.rounds(job_id)] == [2, 2]
    assert training.count == {"fast": 2, "slow": 2}  # nobody trained a round twice


@pytest.mark.timeout(90)
def test_coordinator_reinstalls_a_service_that_lost_its_state(federation: Federation, training: Training) -> None:
    fed = federation
    job_id, held = slow_round(fed)
    fed.stop_aggregator()
    fed.start_aggregator(spool=False)  # no spool: the job, its model and round 1's uploads are gone
    held.release.set()
    fed.wait_job(job_id, 60)
    assert [r.aggregated for r in fed.store.rounds(job_id)] == [2, 2]
    # The coordinator installed the model and round 1 again and re-sent its tasks: the fast worker, whose
    # acknowledged update was lost with the service, trained round 1 again (the price of running without a spool).
    assert training.count["fast"] == 3 and training.count["slow"] in (2, 3)


@pytest.mark.timeout(90)
def test_a_worker_asking_between_the_reinstalled_model_and_its_round_retries(federation: Federation,
                                                                             training: Training) -> None:
    """A reinstall is two calls (the model, then the round): a worker that asks about its round in between
    must hear "not open yet" and retry, not give its task up. Forced here: the first model install waits
    for the held worker's question before the coordinator may open the round."""
    fed = federation
    job_id, held = slow_round(fed)
    fed.stop_aggregator()
    fed.start_aggregator(spool=False)
    book = fed.book
    installed, asked = threading.Event(), threading.Event()
    put_global, worker_status = book.put_global, book.worker_status

    def asking(job: str, round_number: int, worker_id: str) -> tuple[bool, bool]:
        if round_number == 1 and installed.is_set():
            asked.set()
        return worker_status(job, round_number, worker_id)

    def installing(*args: Any, **kwargs: Any) -> Any:
        result = put_global(*args, **kwargs)
        if not installed.is_set():
            installed.set()
            held.release.set()
            assert asked.wait(30), "the held worker never asked about its round"
        return result

    book.worker_status = asking  # type: ignore[method-assign]
    book.put_global = installing  # type: ignore[method-assign]
    fed.wait_job(job_id, 60)
    assert asked.is_set()
    assert [r.aggregated for r in fed.store.rounds(job_id)] == [2, 2]
    assert not {p.status for p in fed.store.participants(job_id, 1)} & {"refused", "failed"}


@pytest.mark.timeout(120)
def test_a_service_back_without_its_state_is_reinstalled_on_its_event_stream_not_at_the_safety_poll(
        rabbitmq_url: str, tmp_path: Path, training: Training) -> None:
    """The restarted service sends no event for a job it lost, but its event stream reopening wakes the round
    loop, which asks, learns the job is gone and reinstalls it at once. With the safety poll (an hour here)
    and round 1's deadline (NEVER_S) far beyond the test's timeout, nothing else could wake it in time;
    meanwhile the held worker's retries of the unknown job run out. A worker whose task failed while the job
    was lost gets it again with the reinstall."""
    fed = Federation(rabbitmq_url, tmp_path, safety_poll_s=3600.0)
    try:
        job_id, held = slow_round(fed)
        fed.stop_aggregator()
        fed.start_aggregator(spool=False)
        held.release.set()
        fed.wait_job(job_id, 90)
        assert [r.aggregated for r in fed.store.rounds(job_id)] == [2, 2]
    finally:
        fed.close()
