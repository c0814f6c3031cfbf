"""The coordinator's embedded SQLite state under a lock held elsewhere and a full disk (issue 12, item 1), on a real
SQLite file: every write is one transaction that is rolled back on any error, the error reaches the caller,
no transaction stays open, what `status` shows agrees with the file, and later writes work.

A full disk is SQLite's own SQLITE_FULL ("database or disk is full"): `PRAGMA max_page_count` caps the
file's size on the store's connections, so a write that needs a new page fails exactly as on a full disk."""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import event

from fedbroker.bus import InProcessBus
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.service import CoordinatorClient, serve, status_reply
from fedbroker.coordinator.store import StateStore, StateUnavailable
from fedbroker.job.spec import parse_job
from fedbroker.rpc.aggregation_client import AggregatorClient

BIG = "x" * 200_000  # a job spec that needs new pages: it cannot land on a full disk
JOB = {"name": "state", "category": "nobody",
       "model": {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]},
       "schedule": {"wait_for_workers_s": 3600}}


UNCAPPED = 1073741823


def _cap(store: StateStore, pages: int) -> None:
    """Every connection the store takes from its pool from now on holds the file to `pages` pages."""
    event.remove(store.engine, "checkout", getattr(store, "_test_cap", _no_cap)) if hasattr(store, "_test_cap") else None

    def cap(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        dbapi_connection.execute(f"PRAGMA max_page_count = {pages}")

    store._test_cap = cap  # type: ignore[attr-defined]
    event.listen(store.engine, "checkout", cap)


def _no_cap(*_: Any) -> None:
    return None


def fill_disk(store: StateStore) -> None:
    """From now on the store's file cannot grow (SQLITE_FULL), as on a full disk."""
    (pages,) = on_file(store.path, "PRAGMA page_count")[0]
    _cap(store, int(pages))  # type: ignore[call-overload]


def free_disk(store: StateStore) -> None:
    _cap(store, UNCAPPED)


def on_file(path: str, sql: str) -> list[tuple[object, ...]]:
    """What another process reading the file sees."""
    db = sqlite3.connect(path)
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    s = StateStore(str(tmp_path / "coordinator.sqlite"), busy_timeout_s=0.2)
    yield s
    s.close()


def test_a_write_waiting_past_the_lock_timeout_fails_rolled_back_and_later_writes_land(store: StateStore) -> None:
    store.add_job("before", "before", "{}", 1, "{}")
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another connection holds the write lock past the busy timeout
    with pytest.raises(StateUnavailable, match=r"could not record job 'blocked'.*database is locked"):
        store.add_job("blocked", "blocked", "{}", 1, "{}")
    with pytest.raises(StateUnavailable, match="could not open round 1 of job 'before'"):
        store.open_round("before", 1, ["w1", "w2"], deadline=1.0)
    assert store.engine.pool.checkedout() == 0  # no connection stays inside a transaction
    other.execute("ROLLBACK")
    other.close()
    store.add_job("after", "after", "{}", 1, "{}")
    store.open_round("after", 1, ["w1"], deadline=1.0)
    assert [r.job_id for r in store.jobs()] == ["before", "after"]
    assert on_file(store.path, "SELECT job_id FROM jobs ORDER BY created") == [("before",), ("after",)]
    assert on_file(store.path, "SELECT job_id, round FROM rounds") == [("after", 1)]


def test_a_full_disk_rolls_the_whole_transaction_back_and_later_writes_land(store: StateStore) -> None:
    store.add_job("job", "job", "{}", 1, "{}")
    fill_disk(store)
    with pytest.raises(StateUnavailable, match="could not record job 'full'.*database or disk is full"):
        store.add_job("full", "full", BIG, 1, "{}")
    many = [f"w{i:05d}-{'p' * 100}" for i in range(5000)]  # the round row lands, its participants do not fit
    with pytest.raises(StateUnavailable, match="could not open round 1 of job 'job'.*full"):
        store.open_round("job", 1, many, deadline=1.0)
    assert store.engine.pool.checkedout() == 0  # no connection stays inside a transaction
    assert store.round("job", 1) is None and store.participants("job") == []  # all of it or nothing
    store.set_job_status("job", "running")  # a write that needs no new page still lands
    free_disk(store)
    store.add_job("later", "later", BIG, 1, "{}")
    store.open_round("job", 1, many, deadline=1.0)
    assert [r.job_id for r in store.jobs()] == ["job", "later"]
    assert on_file(store.path, "SELECT job_id, status FROM jobs ORDER BY created") == [("job", "running"),
                                                                                       ("later", "pending")]
    assert on_file(store.path, "SELECT COUNT(*) FROM participants") == [(5000,)]


def test_a_write_retried_in_a_jobs_thread_lands_once_the_lock_is_released(store: StateStore) -> None:
    other = sqlite3.connect(store.path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    tries: list[float] = []

    def sleep(seconds: float) -> None:  # the lock is released while the job's thread waits to retry
        tries.append(seconds)
        if len(tries) == 2:
            other.execute("ROLLBACK")

    with store.retrying_writes(for_s=3600, sleep=sleep):
        store.add_job("job", "job", "{}", 1, "{}")
    assert len(tries) == 2
    assert on_file(store.path, "SELECT job_id FROM jobs") == [("job",)]
    other.close()
    stopping = threading.Event()
    stopping.set()
    fill_disk(store)
    with store.retrying_writes(for_s=3600, sleep=sleep, stopping=stopping.is_set), pytest.raises(StateUnavailable):
        store.add_job("stopped", "stopped", BIG, 1, "{}")  # a stopping coordinator does not retry
    assert len(tries) == 2


def big_job() -> dict[str, object]:
    """A valid job whose spec needs new pages of the file: it cannot land on a full disk."""
    layers = [{"type": "Linear", "in_features": 4, "out_features": 4}] * 120 + [
        {"type": "Linear", "in_features": 4, "out_features": 2}]
    return dict(JOB, name="big", model={"input_shape": [4], "layers": layers})


def test_a_submission_that_cannot_be_written_gets_no_job_id_and_a_clear_unavailable(store: StateStore) -> None:
    bus = InProcessBus(namespace="state-test")
    coordinator = Coordinator(bus=bus, store=store, aggregator=AggregatorClient("127.0.0.1:1"),
                              aggregator_target="127.0.0.1:1", checkpoint_dir=str(Path(store.path).parent / "ck"))
    coordinator.start()
    server, port = serve(coordinator)
    client = CoordinatorClient(f"127.0.0.1:{port}", timeout_s=30)
    try:
        accepted = client.submit(json.dumps(JOB))
        fill_disk(store)
        with pytest.raises(StateUnavailable, match="could not record job"):
            coordinator.submit(parse_job(big_job()))
        with pytest.raises(grpc.RpcError) as info:
            client.submit(json.dumps(big_job()))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "could not record job" in info.value.details() and "database or disk is full" in info.value.details()
        assert [j.job_id for j in status_reply(coordinator).jobs] == [accepted]
        assert on_file(store.path, "SELECT job_id FROM jobs") == [(accepted,)]
        free_disk(store)
        later = client.submit(json.dumps(big_job()))
        assert [j.job_id for j in client.status().jobs] == [accepted, later]
        assert on_file(store.path, "SELECT job_id FROM jobs ORDER BY created") == [(accepted,), (later,)]
    finally:
        client.close()
        server.stop(grace=0)
        coordinator.stop()
        bus.close()
