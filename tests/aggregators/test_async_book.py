"""The aggregation service's asynchronous mode (FedBuff), without a network: tasks, staleness, versions,
idempotence per (job, worker, task) and the spool that makes an accepted update survive a crash."""

from __future__ import annotations

import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.errors import ConfigError, Conflict, Rejection, UploadRejected
from tests.aggregators.test_rounds import SPEC, stream, weights

AGG = {"alignment": "none", "weighting": "fedavg", "selection": "all"}


def config(**overrides: object) -> dict[str, object]:
    out: dict[str, object] = {"aggregation": AGG, "buffer_size": 2, "max_staleness": 1, "staleness": "constant",
                              "staleness_params": {}, "server_lr": 1.0, "seed": 0}
    out.update(overrides)
    return out


def opened(book: RoundBook, **overrides: object) -> RoundBook:
    book.put_global("j", 1, SPEC.to_json(), weights(0.0))
    book.open_buffer("j", config(**overrides), num_samples={"w1": 100, "w2": 100, "w3": 100})
    return book


def tasks(book: RoundBook, *workers: str) -> dict[str, int]:
    return {w: issued.task for w, issued in book.issue_tasks("j", list(workers))}


def test_a_full_buffer_of_fresh_updates_is_the_fedavg_of_them() -> None:
    book = opened(RoundBook(max_update_bytes=10_000))
    t = tasks(book, "w1", "w2")
    book.receive_update(stream(weights(1.0), rnd=t["w1"], worker="w1", n=10))
    assert book.global_model("j")[0] == 1  # one update of two: no version yet
    book.receive_update(stream(weights(4.0), rnd=t["w2"], worker="w2", n=30))
    version, _, state = book.global_model("j")
    assert version == 2
    np.testing.assert_allclose(state["0.weight"], (10 * 1.0 + 30 * 4.0) / 40, rtol=1e-6)
    _, status = book.buffer_status("j")
    assert [v.version for v in status.summaries] == [2]
    assert sorted(u.worker_id for u in status.summaries[0].updates) == ["w1", "w2"]


def test_new_tasks_are_on_the_newest_version_and_a_stale_update_is_refused_changing_nothing() -> None:
    book = opened(RoundBook(max_update_bytes=10_000), buffer_size=1, max_staleness=1)
    t = tasks(book, "w1", "w2", "w3")                           # all on version 1
    book.receive_update(stream(weights(1.0), rnd=t["w1"], worker="w1"))   # → version 2
    assert book.issue_tasks("j", ["w1"])[0][1].base == 2
    book.receive_update(stream(weights(2.0), rnd=t["w2"], worker="w2"))   # τ = 1: accepted → version 3
    before = book.global_model("j")
    with pytest.raises(UploadRejected) as info:                 # τ = 2 > max_staleness 1
        book.receive_update(stream(weights(9.0), rnd=t["w3"], worker="w3"))
    assert info.value.reason is Rejection.STALE and "version 1" in str(info.value)
    after = book.global_model("j")
    assert after[0] == before[0] == 3
    np.testing.assert_array_equal(after[2]["0.weight"], before[2]["0.weight"])
    assert book.buffer_status("j")[1].refused_stale == 1


def test_a_retried_upload_counts_once_and_gets_its_first_receipt() -> None:
    book = opened(RoundBook(max_update_bytes=10_000))
    t = tasks(book, "w1", "w2")
    first = book.receive_update(stream(weights(1.0), rnd=t["w1"], worker="w1"))
    again = book.receive_update(stream(weights(7.0), rnd=t["w1"], worker="w1"))
    assert again.duplicate and again.sha256 == first.sha256
    assert book.buffer_status("j")[1].folded[0].worker_id == "w1" and len(book.buffer_status("j")[1].folded) == 1
    assert book.status("j", t["w1"]) == (["w1"], False)      # what a worker with a redelivered task asks


def test_an_upload_for_a_task_that_is_not_the_workers_outstanding_one_is_refused() -> None:
    book = opened(RoundBook(max_update_bytes=10_000))
    old = tasks(book, "w1")["w1"]
    new = tasks(book, "w1")["w1"]                             # supersedes the first
    with pytest.raises(UploadRejected) as info:
        book.receive_update(stream(weights(1.0), rnd=old, worker="w1"))
    assert info.value.reason is Rejection.ROUND_CLOSED
    with pytest.raises(UploadRejected) as info:             # never issued to w2
        book.receive_update(stream(weights(1.0), rnd=new, worker="w2"))
    assert info.value.reason is Rejection.ROUND_CLOSED
    with pytest.raises(UploadRejected) as info:             # more samples than w1 registered
        book.receive_update(stream(weights(1.0), rnd=new, worker="w1", n=101))
    assert info.value.reason is Rejection.TOO_MANY_SAMPLES
    assert book.status("j", new) == ([], True)


def test_an_accepted_update_survives_a_service_crash_and_counts_once(tmp_path) -> None:
    book = opened(RoundBook(max_update_bytes=10_000, spool_dir=tmp_path), buffer_size=3)
    t = tasks(book, "w1", "w2", "w3")
    receipt = book.receive_update(stream(weights(1.0), rnd=t["w1"], worker="w1", n=10))
    book.stop()  # the process dies after the receipt; only its spool remains
    restarted = RoundBook(max_update_bytes=10_000, spool_dir=tmp_path)
    again = restarted.receive_update(stream(weights(1.0), rnd=t["w1"], worker="w1", n=10))
    assert again.duplicate and again.sha256 == receipt.sha256
    restarted.receive_update(stream(weights(4.0), rnd=t["w2"], worker="w2", n=30))
    restarted.receive_update(stream(weights(2.0), rnd=t["w3"], worker="w3", n=60))
    version, _, state = restarted.global_model("j")
    assert version == 2
    np.testing.assert_allclose(state["0.weight"], (10 * 1.0 + 30 * 4.0 + 60 * 2.0) / 100, rtol=1e-6)
    assert restarted.issue_tasks("j", ["w1"])[0][1].task > max(t.values())  # task numbers never repeat


def test_a_buffer_full_at_the_crash_becomes_its_version_on_restart(tmp_path) -> None:
    book = opened(RoundBook(max_update_bytes=10_000, spool_dir=tmp_path), buffer_size=2)
    t = tasks(book, "w1", "w2")
    book.receive_update(stream(weights(2.0), rnd=t["w1"], worker="w1", n=10))
    # the second update reaches the disk, then the process dies before the version is committed
    book.buffers.publish_version = lambda job, state: (_ for _ in ()).throw(SystemExit("killed"))  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        book.receive_update(stream(weights(4.0), rnd=t["w2"], worker="w2", n=10))
    book.stop()
    restarted = RoundBook(max_update_bytes=10_000, spool_dir=tmp_path)
    version, _, state = restarted.global_model("j")
    assert version == 2
    np.testing.assert_allclose(state["0.weight"], 3.0, rtol=1e-6)
    assert restarted.receive_update(stream(weights(4.0), rnd=t["w2"], worker="w2", n=10)).duplicate


def test_open_buffer_is_idempotent_and_refuses_alignment_naming_the_field() -> None:
    book = opened(RoundBook(max_update_bytes=10_000))
    t = tasks(book, "w1")
    assert book.open_buffer("j", config()) == 1
    assert book.status("j", t["w1"]) == ([], True)  # the issued task survived the repeated open
    other = RoundBook(max_update_bytes=10_000)
    other.put_global("j", 1, SPEC.to_json(), weights(0.0))
    other.put_global("f", 1, SPEC.to_json(), weights(0.0))
    with pytest.raises(ConfigError) as info:
        other.open_buffer("f", config(aggregation={**AGG, "alignment": "feddna"}))
    assert info.value.field == "aggregation.alignment"
    with pytest.raises(ConfigError) as info:
        other.open_buffer("j", config(staleness="linear"))
    assert info.value.field == "schedule.staleness"
    with pytest.raises(Conflict):
        other.issue_tasks("j", ["w1"])  # not in asynchronous mode


def test_closing_the_buffer_names_the_updates_it_holds_which_no_version_holds(tmp_path) -> None:
    """Their ε is spent: the coordinator records each as not aggregated (issue 30, break 8), also on a retry of
    the close after the service restarted."""
    book = opened(RoundBook(max_update_bytes=10_000, spool_dir=tmp_path))
    t = tasks(book, "w1", "w2")
    book.receive_update(stream(weights(1.0), rnd=t["w1"], worker="w1", n=10))  # one of two: no version
    version, left = book.close_buffer("j")
    assert version == 1 and [(u.worker_id, u.task, u.num_samples) for u in left] == [("w1", t["w1"], 10)]
    book.stop()
    restarted = RoundBook(max_update_bytes=10_000, spool_dir=tmp_path)
    assert [(u.worker_id, u.task) for u in restarted.close_buffer("j")[1]] == [("w1", t["w1"])]


def test_a_closed_buffer_refuses_uploads_and_issues_nothing(tmp_path) -> None:
    book = opened(RoundBook(max_update_bytes=10_000, spool_dir=tmp_path))
    t = tasks(book, "w1")
    assert book.close_buffer("j") == (1, []) and book.close_buffer("j") == (1, [])  # idempotent
    book.stop()
    restarted = RoundBook(max_update_bytes=10_000, spool_dir=tmp_path)  # and durable
    with pytest.raises(UploadRejected) as info:
        restarted.receive_update(stream(weights(1.0), rnd=t["w1"], worker="w1"))
    assert info.value.reason is Rejection.ROUND_CLOSED and "ended" in str(info.value)
    with pytest.raises(Conflict):
        restarted.issue_tasks("j", ["w1"])
