"""One writer per spool, and no write of a running book deletes a file a record is about to name.

A second aggregation service on a spool is refused, naming the folder, once its bounded wait for the lock has
passed (a process test: tests/faults/test_spool_lock_wait.py); a stopped book's threads (gRPC
cannot stop a running handler) write nothing, so the next service on the folder is its only writer; and
within one book, a commit that lands while a new global version is being written keeps that version's file.
Every interleaving is made by construction (a hook inside the write, or calls after the stop), never by
sleeping."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.spool import LOCK_FILE, QUARANTINE_DIR, SpoolClosed, SpoolInUse, job_folder
from fedbroker.app.cli import main
from fedbroker.errors import ConfigError, Unavailable
from tests.aggregators.test_async_book import config
from tests.aggregators.test_rounds import SPEC, stream, weights

pytestmark = [pytest.mark.timeout(60)]


def async_book(spool: Path, **overrides: object) -> RoundBook:
    """Job `j` in asynchronous mode (buffer of two) with w1's update in its buffer."""
    book = RoundBook(max_update_bytes=10_000, spool_dir=spool)
    book.put_global("j", 1, SPEC.to_json(), weights(0.0))
    book.open_buffer("j", config(**overrides), num_samples={"w1": 100, "w2": 100, "w3": 100})
    tasks = {w: issued.task for w, issued in book.issue_tasks("j", ["w1", "w2"])}
    book.receive_update(stream(weights(1.0), rnd=tasks["w1"], worker="w1", n=10))
    return book


def task_of(book: RoundBook, worker: str) -> int:
    return next(i.task for w, i in book.buffer_status("j")[1].issued.items() if w == worker)


def files_of(spool: Path) -> dict[str, bytes]:
    return {str(p.relative_to(spool)): p.read_bytes() for p in sorted(spool.rglob("*")) if p.is_file()}


# ----- one service per spool ------------------------------------------------------------------------


def test_a_second_service_on_the_same_spool_is_refused_naming_the_folder(tmp_path: Path) -> None:
    first = async_book(tmp_path)
    before = files_of(tmp_path)
    with pytest.raises(SpoolInUse) as info:
        RoundBook(spool_dir=tmp_path)
    message = str(info.value)
    assert str(tmp_path) in message and "another aggregation service" in message
    assert str(tmp_path / LOCK_FILE) in message
    assert isinstance(info.value, ConfigError) and info.value.field == "aggregator.spool_dir"
    assert files_of(tmp_path) == before  # the refused one touched nothing
    first.stop()
    restarted = RoundBook(spool_dir=tmp_path)  # a stopped service lets the next one in
    assert restarted.buffer_status("j")[1].folded[0].worker_id == "w1"
    restarted.stop()


def test_the_aggregator_command_refuses_to_start_on_a_spool_another_service_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    holder = RoundBook(spool_dir=tmp_path)
    monkeypatch.setenv("FEDBROKER__AGGREGATOR__SPOOL_DIR", str(tmp_path))
    monkeypatch.setenv("FEDBROKER__AGGREGATOR__SPOOL_LOCK_WAIT_S", "0.2")
    try:
        assert main(["aggregator", "--listen", "127.0.0.1:0"]) == 2  # a config error once the bound has passed
    finally:
        holder.stop()
    err = capsys.readouterr().err
    assert f"{tmp_path} is in use by another aggregation service" in err
    assert "did not let go within aggregator.spool_lock_wait_s = 0.2 s" in err


# ----- a stopped book writes nothing -----------------------------------------------------------------


def test_every_write_of_a_stopped_book_raises_and_changes_no_file(tmp_path: Path) -> None:
    book = async_book(tmp_path)
    w2 = task_of(book, "w2")
    book.stop()
    before = files_of(tmp_path)
    calls: list[Callable[[], Any]] = [
        lambda: book.put_global("j", 7, SPEC.to_json(), weights(7.0)),
        lambda: book.issue_tasks("j", ["w3"]),
        lambda: book.receive_update(stream(weights(2.0), rnd=w2, worker="w2", n=10)),
        lambda: book.close_buffer("j"),
        lambda: book.put_global("other", 1, SPEC.to_json(), weights(0.0)),
    ]
    for call in calls:
        with pytest.raises(SpoolClosed) as info:
            call()
        assert isinstance(info.value, Unavailable)  # UNAVAILABLE: a client retries it against the next service
    assert files_of(tmp_path) == before
    book.stop()  # idempotent


def test_a_late_thread_of_a_stopped_book_cannot_delete_the_next_books_files(tmp_path: Path) -> None:
    """The harness's restart: the old book's handler threads go on after the server stopped, while the new
    book serves the same folder. Their commits would prune the global versions the new records name."""
    old = async_book(tmp_path)
    w2 = task_of(old, "w2")
    old.stop()
    new = RoundBook(max_update_bytes=10_000, spool_dir=tmp_path)
    new.receive_update(stream(weights(3.0), rnd=w2, worker="w2", n=10))  # the buffer fills: version 2
    assert new.global_model("j")[0] == 2
    for late in (lambda: old.put_global("j", 1, SPEC.to_json(), weights(9.0)),  # its record names version 1 only
                 lambda: old.receive_update(stream(weights(3.0), rnd=w2, worker="w2", n=10)),
                 lambda: old.issue_tasks("j", ["w1", "w2"])):
        with pytest.raises(SpoolClosed):
            late()
    new.stop()
    again = RoundBook(spool_dir=tmp_path)
    assert again.global_model("j")[0] == 2 and not (tmp_path / QUARANTINE_DIR).exists()
    np.testing.assert_allclose(again.global_model("j")[2]["0.weight"], 2.0, rtol=1e-6)  # (10·1 + 10·3) / 20
    again.stop()


class Watched(threading.Condition):
    """The spool's condition, telling when `Spool.close` starts waiting on it."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        self.waiting.set()
        return super().wait_for(predicate, timeout)


def test_stop_waits_for_the_write_under_way_before_the_next_service_may_open_the_spool(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    book = async_book(tmp_path, buffer_size=3)
    w2 = task_of(book, "w2")
    inside, go = threading.Event(), threading.Event()
    real_savez = np.savez

    def held_savez(fh: Any, **arrays: Any) -> None:
        real_savez(fh, **arrays)
        if not inside.is_set():
            inside.set()
            assert go.wait(30)

    monkeypatch.setattr(np, "savez", held_savez)
    assert book.table.spool is not None
    guard = book.table.spool._guard = Watched()
    upload = threading.Thread(target=book.receive_update, args=(stream(weights(3.0), rnd=w2, worker="w2", n=10),))
    upload.start()
    assert inside.wait(30)  # w2's update is being written
    stopping = threading.Thread(target=book.stop)
    stopping.start()
    assert guard.waiting.wait(30)  # the stop waits for the write
    with pytest.raises(SpoolInUse):  # which still holds the folder
        RoundBook(spool_dir=tmp_path)
    go.set()
    upload.join(30)
    stopping.join(30)
    assert not stopping.is_alive()
    monkeypatch.undo()
    restarted = RoundBook(spool_dir=tmp_path)  # the update written before the stop ended is there
    assert [u.worker_id for u in restarted.buffer_status("j")[1].folded] == ["w1", "w2"]
    restarted.stop()


# ----- one book: a commit that lands while a global version is written -------------------------------


def test_a_commit_landing_after_a_new_global_is_written_keeps_its_file(tmp_path: Path) -> None:
    """The buffer fills and its version is written, outside the book's lock; before the record naming it is
    committed, another call (the coordinator issuing a task) commits a record naming the older versions only."""
    book = async_book(tmp_path)
    w2 = task_of(book, "w2")
    spool = book.table.spool
    assert spool is not None
    real = spool.save_global

    def then_a_task(job_id: str, version: int, *args: Any) -> None:
        real(job_id, version, *args)
        book.issue_tasks("j", ["w3"])  # commits the job's record (versions [1]) before version 2's

    spool.save_global = then_a_task  # type: ignore[method-assign]
    book.receive_update(stream(weights(3.0), rnd=w2, worker="w2", n=10))
    assert book.global_model("j")[0] == 2
    book.stop()
    restarted = RoundBook(spool_dir=tmp_path)
    assert restarted.global_model("j")[0] == 2 and not (tmp_path / QUARANTINE_DIR).exists()
    restarted.stop()


def test_a_commit_landing_while_a_new_global_is_written_leaves_its_temporary_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same commit, while version 2 is still a temporary file: the rename that follows must find it."""
    book = async_book(tmp_path)
    w2 = task_of(book, "w2")
    folder = job_folder(tmp_path, "j")
    real_savez = np.savez

    def savez(fh: Any, **arrays: Any) -> None:
        real_savez(fh, **arrays)
        if list(folder.glob(".global-2.npz.*")):  # version 2 being written
            book.issue_tasks("j", ["w3"])

    monkeypatch.setattr(np, "savez", savez)
    book.receive_update(stream(weights(3.0), rnd=w2, worker="w2", n=10))
    monkeypatch.undo()
    assert book.global_model("j")[0] == 2
    book.stop()
    restarted = RoundBook(spool_dir=tmp_path)
    assert restarted.global_model("j")[0] == 2 and not (tmp_path / QUARANTINE_DIR).exists()
    restarted.stop()
