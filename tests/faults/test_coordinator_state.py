"""The coordinator's state store failing under a running job (issue 12, item 1), against the real broker,
the real aggregation service and real workers: the write that records a round's close hits a full disk.

The job's thread neither dies nor leaves the job `running` forever: it retries the write (rolled back each
time, so nothing half-written is left) until the disk has room again, and the job completes; with a store
outage longer than `store_outage_s` it fails, visibly, once the failure itself can be written. Either way
what the store shows agrees with what the file holds.

The full disk is injected in the store's driver calls: the statement that closes the round raises SQLite's
own "database or disk is full" inside the real transaction, which must then be rolled back."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event

from fedbroker.coordinator.service import status_reply
from tests.faults.harness import Federation, Training, job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

JOB = job(training={"rounds": 2})
CLOSE = "mean_train_loss="           # the statement that records a round's close
FAIL_JOB = "UPDATE jobs SET status=?, error=?"


class FullDisk:
    """Installed on the store's engine: while `full` is set, statements containing one of `statements` fail in the
    driver as on a full disk (inside the real transaction, which must then be rolled back); everything else runs."""

    def __init__(self, engine: Engine, *statements: str) -> None:
        self.statements = statements
        self.full = threading.Event()
        self.failures: dict[str, int] = dict.fromkeys(statements, 0)  # failed tries, by statement
        event.listen(engine, "do_execute", self._execute)
        event.listen(engine, "do_executemany", self._execute)

    def _execute(self, cursor: Any, statement: str, parameters: Any, context: Any) -> bool:
        for watched in self.statements:
            if self.full.is_set() and watched in statement:
                self.failures[watched] += 1
                raise sqlite3.OperationalError("database or disk is full")
        return False  # not handled here: the driver runs it


def write_lock_is_free(path: str) -> bool:
    """Whether another connection can take the file's write lock at once (no transaction was left open)."""
    db = sqlite3.connect(path, timeout=5.0, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("ROLLBACK")
        return True
    finally:
        db.close()


def on_file(path: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(path)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def fill_when_round_1_closes(fed: Federation, disk: FullDisk) -> None:
    real = fed.store.close_round

    def close_round(job_id: str, round_number: int, **kwargs: Any) -> None:
        if round_number == 1:
            disk.full.set()
        return real(job_id, round_number, **kwargs)

    fed.store.close_round = close_round  # type: ignore[method-assign]


@pytest.fixture
def slow_store(rabbitmq_url: str, tmp_path: Path) -> Iterator[Federation]:
    fed = Federation(rabbitmq_url, tmp_path, start_coordinator=False)
    try:
        yield fed
    finally:
        fed.close()


def test_a_round_close_that_hits_a_full_disk_is_retried_until_it_lands_and_the_job_completes(
        federation: Federation, training: Training) -> None:
    fed = federation
    disk = FullDisk(fed.store.engine, CLOSE)
    fill_when_round_1_closes(fed, disk)
    fed.add_worker("w0", index=0, count=2)
    fed.add_worker("w1", index=1, count=2)
    job_id = fed.submit(JOB)
    wait_for(lambda: disk.failures[CLOSE] >= 3, 60, "the close of round 1 to fail a few times")
    path = fed.store.path
    assert write_lock_is_free(path)  # each failed try was rolled back, the write lock released
    assert on_file(path, "SELECT status, rounds_done FROM jobs WHERE job_id = ?", job_id) == [("running", 0)]
    assert on_file(path, "SELECT status FROM rounds WHERE job_id = ? AND round = 1", job_id) == [("open",)]
    assert on_file(path, "SELECT COUNT(*) FROM participants WHERE status = 'aggregated'") == [(0,)]
    assert fed.coordinator is not None and fed.coordinator._threads[job_id].is_alive()
    disk.full.clear()  # space freed
    fed.wait_job(job_id, 60)
    assert on_file(path, "SELECT status, rounds_done FROM jobs WHERE job_id = ?", job_id) == [("completed", 2)]
    assert on_file(path, "SELECT round, status, aggregated FROM rounds WHERE job_id = ? ORDER BY round",
                   job_id) == [(1, "closed", 2), (2, "closed", 2)]
    reply = status_reply(fed.coordinator, job_id)
    assert [(j.status, j.rounds_done) for j in reply.jobs] == [("completed", 2)]
    assert [(r.round, r.status) for r in reply.rounds] == [(1, "closed"), (2, "closed")]
    assert training.count == {"w0": 2, "w1": 2}  # the round was not trained again


def test_a_store_outage_longer_than_store_outage_s_fails_the_job_visibly_once_that_can_be_written(
        slow_store: Federation, training: Training) -> None:
    fed = slow_store
    fed.start_coordinator(store_outage_s=1.0)
    disk = FullDisk(fed.store.engine, CLOSE, FAIL_JOB)
    fill_when_round_1_closes(fed, disk)
    fed.add_worker("w0", index=0, count=2)
    fed.add_worker("w1", index=1, count=2)
    job_id = fed.submit(JOB)
    # past store_outage_s the job fails; recording that fails too, and is retried rather than given up
    wait_for(lambda: disk.failures[FAIL_JOB] >= 2, 60, "the job's failure to be tried twice")
    assert on_file(fed.store.path, "SELECT status FROM jobs WHERE job_id = ?", job_id) == [("running",)]
    disk.full.clear()
    row = wait_for(lambda: (r := fed.store.job(job_id)).status != "running" and r, 60, "the job to end")
    assert row.status == "failed"
    assert "could not record the close of round 1" in row.error and "database or disk is full" in row.error
    assert on_file(fed.store.path, "SELECT status FROM jobs WHERE job_id = ?", job_id) == [("failed",)]
    assert on_file(fed.store.path, "SELECT status FROM rounds WHERE job_id = ? AND round = 1", job_id) == [("open",)]
    assert fed.coordinator is not None
    assert [j.status for j in status_reply(fed.coordinator, job_id).jobs] == ["failed"]

