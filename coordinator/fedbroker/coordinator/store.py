"""The coordinator's durable state in one embedded SQLite file: jobs, workers, rounds, participants, events.

Every write commits at once (WAL mode), so a restarted coordinator finds each job where it stopped:
the last closed round and its checkpoint, and the round that was open (its participants and deadline),
which it resumes instead of starting over.

Every write is one transaction (`BEGIN IMMEDIATE` … `COMMIT`) that is rolled back on any error (a lock
held past the busy timeout, a full disk, an I/O error): the connection never stays inside an open
transaction, and the error reaches the caller as `StateUnavailable` (gRPC UNAVAILABLE). A job's thread
rides such an outage out (`retrying_writes`); intake (SubmitJob, the control queue) fails at once, so a
submission that could not be written gets no job id.

Reads return the frozen records of `records.py`: no SQLite row leaves this module.

`StateStore.in_directory` is how a coordinator process opens its state: the folder (0700) is locked
(`state_dir.py`) so a second coordinator on it is refused, and the SQLite file is created 0600 like the
checkpoints. Opening it migrates an older file to the schema this code knows (`store_schema`, `fedbroker.coordinator.schema`)
and refuses one a newer release wrote.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from sqlalchemy import create_engine
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.pool import StaticPool

from fedbroker.config import DPPolicy
from fedbroker.coordinator.records import EventRecord, JobRecord, WorkerRecord
from fedbroker.coordinator.schema import user_version
from fedbroker.coordinator.state_dir import StateDirLock, owner_only
from fedbroker.coordinator.store_epsilon import PRICED, EpsilonTables
from fedbroker.coordinator.store_evaluation import EvaluationTables
from fedbroker.coordinator.store_notes import JobNotes, write_event
from fedbroker.coordinator.store_rounds import RoundTables
from fedbroker.coordinator.store_schema import SCHEMA
from fedbroker.coordinator.store_shares import ShareTables
from fedbroker.coordinator.store_site_dp import SiteDPTables
from fedbroker.coordinator.store_sites import SiteTables
from fedbroker.errors import Unavailable
from fedbroker.job.status import FINISHED, JobStatus, WorkerState
from fedbroker.retry import Backoff, retry_call

log = logging.getLogger(__name__)
T = TypeVar("T")

DB_FILE = "coordinator.sqlite"
# Between tries of a write that a job's thread rides out (a lock held elsewhere, a full disk).
WRITE_BACKOFF = Backoff(initial_s=0.2, max_s=10.0)
# What a job may be in when its thread marks it running (running: resumed after a restart).
_RUNNABLE = frozenset({JobStatus.PENDING, JobStatus.RUNNING})


class StateUnavailable(Unavailable):
    """A read or write of the state store failed (and was rolled back): nothing of it was recorded."""

    reason = "state_unavailable"


@dataclass(frozen=True)
class _RetryPolicy:
    for_s: float                       # how long one failing write is tried again before it is given up
    sleep: Callable[[float], object]
    stopping: Callable[[], bool]


class StateStore(RoundTables, EpsilonTables, JobNotes, ShareTables, EvaluationTables, SiteTables, SiteDPTables):
    """The coordinator's one SQLite file; `busy_timeout_s`: how long a write waits for a lock another
    connection holds before it fails. Its jobs and workers are here; rounds and their participants:
    store_rounds.py; ε bounds and corrections: store_epsilon.py; a job's history and events of their own:
    store_notes.py; what sites shared with a job before round 1: store_shares.py; federated evaluation:
    store_evaluation.py; what an operator reads about the sites: store_sites.py; site-level DP: store_site_dp.py."""

    def __init__(self, path: str, *, busy_timeout_s: float = 5.0, lock: StateDirLock | None = None) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self._dir_lock = lock
        self._local = threading.local()  # the calling thread's write-retry policy (retrying_writes)
        self._lock = threading.Lock()
        if path != ":memory:":
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))  # SQLite keeps the mode
            for name in (path, f"{path}-wal", f"{path}-shm"):          # and gives it to -wal and -shm
                owner_only(name, 0o600)
        self._db = self._connect()
        # INTERIM (helper storemix, until helper "store" lands): Core statements run on the same SQLite connection
        self._engine = create_engine("sqlite://", creator=lambda: self._db, poolclass=StaticPool)
        try:
            self._migrate()
        except BaseException:
            self._db.close()
            raise

    @classmethod
    def in_directory(cls, state_dir: str, *, busy_timeout_s: float = 5.0) -> StateStore:
        """A coordinator's state: `state_dir` (created 0700) locked for this process, its SQLite file in it.
        `StateDirInUse` when another coordinator holds it; `close()` releases it."""
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        owner_only(state_dir, 0o700)
        lock = StateDirLock(state_dir)
        try:
            return cls(os.path.join(state_dir, DB_FILE), busy_timeout_s=busy_timeout_s, lock=lock)
        except BaseException:
            lock.release()
            raise

    def _connect(self) -> sqlite3.Connection:
        try:
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                                 timeout=self.busy_timeout_s)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
        except sqlite3.Error as exc:
            raise StateUnavailable(f"the coordinator's state store {self.path} could not be opened: {exc}") from exc
        return db

    def _migrate(self) -> None:
        """Bring the file to the schema this code knows (`store_schema`); a newer one is refused (`SchemaTooNew`)."""
        with self._lock:
            try:
                SCHEMA.migrate(self._db, path=self.path)
            except sqlite3.Error as exc:
                raise StateUnavailable(f"the coordinator's state store {self.path} could not be migrated: {exc}") from exc

    def schema_version(self) -> int:
        """The file's schema version (`PRAGMA user_version`): `store_schema.SCHEMA.latest` once open."""
        with self._lock:
            return user_version(self._db)

    def close(self) -> None:
        """Close the file and release the state directory (if this store holds it)."""
        with self._lock:
            self._db.close()
            if self._dir_lock is not None:
                self._dir_lock.release()
                self._dir_lock = None

    @contextlib.contextmanager
    def retrying_writes(self, *, for_s: float, sleep: Callable[[float], object] = time.sleep,
                        stopping: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """Within this block, a write from the calling thread that fails (rolled back) is tried again with
        backoff for up to `for_s` seconds (each write), then `StateUnavailable` propagates; `stopping()` true ends the
        retrying at once. For a job's thread, which must ride a store outage out rather than die in it;
        other threads (SubmitJob) keep failing at once."""
        previous = getattr(self._local, "retry", None)
        self._local.retry = _RetryPolicy(for_s, sleep, stopping)
        try:
            yield
        finally:
            self._local.retry = previous

    def _write(self, what: str, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn(connection)` in one transaction, committed, or rolled back and raised as `StateUnavailable`."""
        policy: _RetryPolicy | None = getattr(self._local, "retry", None)
        if policy is None:
            return self._transaction(what, fn)

        def log_retry(exc: Exception, retry: int, delay: float) -> None:
            log.error("%s; retrying in %.1fs", exc, delay)

        return retry_call(lambda: self._transaction(what, fn), backoff=WRITE_BACKOFF,
                          deadline=time.monotonic() + policy.for_s,
                          retryable=lambda exc: isinstance(exc, StateUnavailable) and not policy.stopping(),
                          on_retry=log_retry, sleep=policy.sleep)

    def _transaction(self, what: str, fn: Callable[[Any], T]) -> T:
        with self._lock, self._engine.connect() as sa:
            try:
                self._db.execute("BEGIN IMMEDIATE")  # the write lock now, not halfway through
                result = fn(_Both(self._db, sa))
                self._db.execute("COMMIT")
                return result
            except (sqlite3.Error, SQLAlchemyError) as exc:
                self._abandon()
                raise StateUnavailable(f"the coordinator's state store {self.path} could not {what}: {exc} "
                                       f"(rolled back: nothing of it was recorded)") from exc
            except BaseException:
                self._abandon()
                raise

    def _abandon(self) -> None:
        """Leave no transaction open (SQLite rolls some failures back itself); a connection that cannot
        roll back is replaced, so it can never keep the write lock or swallow later writes."""
        try:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
        except sqlite3.Error as exc:
            log.error("state store %s: rollback failed (%s); reopening the connection", self.path, exc)
        if self._db.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                self._db.close()
            self._db = self._connect()

    def _exec(self, sql: Any, args: Any = ()) -> list[Any]:
        """A read (one statement, no transaction left open)."""
        with self._lock:
            try:
                if not isinstance(sql, str):
                    with self._engine.connect() as sa:
                        return list(sa.execute(sql, args or None).fetchall())
                return self._db.execute(sql, args).fetchall()
            except (sqlite3.Error, SQLAlchemyError) as exc:
                raise StateUnavailable(f"the coordinator's state store {self.path} could not be read: {exc}") from exc

    def _run(self, what: str, sql: Any, args: Any = ()) -> int:
        """One write statement in its own transaction; the number of rows it changed."""
        return self._write(what, lambda db: int(db.execute(sql, args).rowcount))

    # ----- jobs -----

    def add_job(self, job_id: str, name: str, spec_json: str, rounds_total: int, model_spec_json: str, *,
                submitter: str = "") -> None:
        """`submitter`: the identity whose token submitted it, the only one that may cancel or download it."""
        now = time.time()

        def write(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT INTO jobs (job_id, name, spec_json, status, rounds_total, model_spec_json, created, updated,"
                " submitter) VALUES (?, ?, ?, 'pending', ?, ?, ?, ?, ?)",
                (job_id, name, spec_json, rounds_total, model_spec_json, now, now, submitter),
            )
            write_event(db, job_id, "submitted", message=f"{rounds_total} round(s)"
                        + (f", by {submitter}" if submitter else ""))

        self._write(f"record job {job_id!r}", write)

    def set_job_status(self, job_id: str, status: JobStatus, error: str = "") -> bool:
        """Record a job's status; whether it was written. A job that has ended never changes again, and only
        a pending (or resumed running) job becomes `running`: one asked to cancel, or cancelled while its
        thread was starting, never runs (a restarted coordinator finishes the cancel). On False for
        `running`, the caller must not run the job."""
        def write(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT status FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
            if row is None:
                return False
            (before,) = row
            if before in FINISHED or (status == JobStatus.RUNNING and before not in _RUNNABLE):
                return False
            db.execute("UPDATE jobs SET status = ?, error = ?, updated = ? WHERE job_id = ?",
                       (status, error, time.time(), job_id))
            if before != status or error:
                write_event(db, job_id, status, message=error)
            return True

        return self._write(f"record job {job_id!r} as {status}", write)

    def request_cancel(self, job_id: str, *, by: str) -> bool:
        """Mark a pending or running job `cancelling` (durably: a coordinator that stops before its thread
        acts on it cancels it when it starts again); False when it had ended already."""
        def write(db: sqlite3.Connection) -> bool:
            changed = db.execute("UPDATE jobs SET status = 'cancelling', updated = ? WHERE job_id = ?"
                                 " AND status IN ('pending', 'running')", (time.time(), job_id)).rowcount > 0
            if changed:
                write_event(db, job_id, JobStatus.CANCELLING, message=f"cancel requested{' by ' + by if by else ''}")
            return changed

        return self._write(f"record a cancel of job {job_id!r}", write)

    def cancel_job(self, job_id: str, *, by: str, round_number: int | None = None,
                   discarded: Iterable[tuple[str, int, float, float]] = ()) -> bool:
        """Record a cancelled job in one transaction: its open round (if any) abandoned, never closed; the
        uploads the aggregation service discarded kept with the ε their workers spent on them; the
        participants that had not uploaded marked cancelled. Only a job that has not ended: a cancel that
        lands as the job completes (or fails) changes nothing and returns False."""
        why = f"cancelled by {by}" if by else "cancelled"

        def write(db: sqlite3.Connection) -> bool:
            ended = sorted(FINISHED)
            if db.execute("UPDATE jobs SET status = 'cancelled', error = ?, updated = ? WHERE job_id = ?"
                          f" AND status NOT IN ({', '.join('?' for _ in ended)})",
                          (why, time.time(), job_id, *ended)).rowcount == 0:
                return False
            if round_number is not None:
                for worker_id, num_samples, epsilon, train_loss in discarded:
                    db.execute(
                        "UPDATE participants SET status = 'discarded', reason = ?, epsilon = ?, train_loss = ?,"
                        " num_samples = ? WHERE job_id = ? AND round = ? AND worker_id = ?",
                        (f"uploaded, then discarded unaggregated: the job was {why}", epsilon, train_loss,
                         num_samples, job_id, round_number, worker_id))
                db.execute("UPDATE participants SET status = 'cancelled', reason = ? WHERE job_id = ? AND round = ?"
                           " AND status IN ('published', 'uploaded')", (f"the job was {why}", job_id, round_number))
                db.execute("UPDATE rounds SET status = 'abandoned', closed = ?, seconds = ? - started"
                           " WHERE job_id = ? AND round = ? AND status = 'open'",
                           (time.time(), time.time(), job_id, round_number))
                write_event(db, job_id, "round_abandoned", round_number=round_number,
                            message="abandoned at the aggregation service: no new version")
            write_event(db, job_id, JobStatus.CANCELLED, message=why)
            return True

        return self._write(f"record job {job_id!r} as cancelled", write)

    def events(self, job_id: str, *, after: int = 0, limit: int = 1000) -> list[EventRecord]:
        """A job's events in the order they happened, those with seq > `after`, at most `limit`."""
        rows = self._exec("SELECT * FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
                          (job_id, after, limit))
        return [_event_record(r) for r in rows]

    def job(self, job_id: str) -> JobRecord | None:
        """The job, or None when no job has that id."""
        rows = self._exec("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
        return _job_record(rows[0]) if rows else None

    def jobs(self, status: JobStatus | None = None) -> list[JobRecord]:
        """Every job (or those in `status`), oldest first: the order a restart resumes them in."""
        if status:
            rows = self._exec("SELECT * FROM jobs WHERE status = ? ORDER BY created", (status,))
        else:
            rows = self._exec("SELECT * FROM jobs ORDER BY created")
        return [_job_record(r) for r in rows]

    # ----- workers -----

    def upsert_worker(self, *, worker_id: str, categories: Iterable[str], histogram: Iterable[int], dp: DPPolicy,
                      epsilon_spent: float, device: str, num_samples: int, input_shape: Iterable[int] = (),
                      num_classes: int = 0, evaluation_samples: int = 0) -> None:
        """A registration. `epsilon_spent` only raises the worker's floor (an operator's or a test's figure): the
        control queue passes 0, since a site's claim is never recorded (`recorded_epsilon`)."""
        now = time.time()
        numbers = {k: v for k, v in asdict(dp).items() if k != "enabled"}
        self._run(
            f"record the registration of worker {worker_id!r}",
            "INSERT INTO workers (worker_id, categories_json, histogram_json, dp_enabled, dp_json, epsilon_spent,"
            " device, num_samples, registered, last_seen, input_shape_json, num_classes, evaluation_samples)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(worker_id) DO UPDATE SET categories_json=excluded.categories_json,"
            " histogram_json=excluded.histogram_json, dp_enabled=excluded.dp_enabled, dp_json=excluded.dp_json,"
            " epsilon_spent=MAX(workers.epsilon_spent, excluded.epsilon_spent), device=excluded.device, num_samples=excluded.num_samples,"
            " last_seen=excluded.last_seen, input_shape_json=excluded.input_shape_json, num_classes=excluded.num_classes,"
            " evaluation_samples=excluded.evaluation_samples",
            (worker_id, json.dumps(list(categories)), json.dumps([int(c) for c in histogram]), int(dp.enabled),
             json.dumps(numbers), epsilon_spent, device, num_samples, now, now, json.dumps([int(d) for d in input_shape]),
             num_classes, evaluation_samples),
        )

    def touch_worker(self, worker_id: str, *, state: WorkerState) -> bool:
        """A heartbeat (its ε claim is advisory, never recorded); False when no worker has that id."""
        return self._run(
            f"record a heartbeat of worker {worker_id!r}",
            "UPDATE workers SET last_seen = ?, state = ? WHERE worker_id = ?", (time.time(), state, worker_id),
        ) > 0

    def recorded_epsilon(self, worker_id: str) -> float | None:
        """The ε recorded for a worker (None: unknown worker): what this coordinator priced itself, the sum over
        its jobs of the ε its participant rows hold (`priced_epsilon`), or the operator's audited correction
        when that is higher. Never a heartbeat's or registration's claim: anyone able to publish one could lock
        the site out (a worker whose ledger holds less than its record refuses to train)."""
        rows = self._exec(f"SELECT w.epsilon_spent, {PRICED} AS priced FROM workers w WHERE w.worker_id = ?",
                          (worker_id,))
        for spent, priced in rows:  # one row, or none for an unknown worker
            return max(float(spent), float(priced))
        return None

    def priced_epsilon(self, worker_id: str) -> float:
        """The ε this coordinator's own participant rows hold for a worker: per job, the largest ε recorded for
        it (an update's, or a training reported failed or not aggregated), summed over its jobs."""
        ((priced,),) = self._exec(f"SELECT {PRICED} FROM (SELECT ? AS worker_id) w", (worker_id,))
        return float(priced)

    def workers(self, category: str | None = None, *, seen_within_s: float | None = None) -> list[WorkerRecord]:
        """Registered workers by id: those serving `category`, and seen within `seen_within_s` (active)."""
        rows = self._exec(f"SELECT w.*, MAX(w.epsilon_spent, {PRICED}) AS recorded FROM workers w"
                          " ORDER BY w.worker_id")
        now = time.time()
        out = []
        for r in rows:
            record = _worker_record(r)
            if category is not None and category not in record.categories:
                continue
            if seen_within_s is not None and now - record.last_seen > seen_within_s:
                continue
            out.append(record)
        return out


class _Both:
    """INTERIM (helper storemix): a write transaction's connection that takes both SQL text with `?` arguments
    (the sqlite3 connection) and SQLAlchemy Core statements (a SQLAlchemy connection over the same one)."""

    def __init__(self, db: sqlite3.Connection, sa: Connection) -> None:
        self._db, self._sa = db, sa

    def execute(self, statement: Any, params: Any = None) -> Any:
        if isinstance(statement, str):
            return self._db.execute(statement, params or ())
        return self._sa.execute(statement, params or None)

    def executemany(self, statement: str, rows: Any) -> Any:
        return self._db.executemany(statement, rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sa, name)


# ----- rows into records (the only place that reads a row by column name) -----

def _job_record(r: sqlite3.Row) -> JobRecord:
    return JobRecord(job_id=r["job_id"], name=r["name"], spec_json=r["spec_json"], status=JobStatus(r["status"]),
                     rounds_total=r["rounds_total"], rounds_done=r["rounds_done"],
                     model_spec_json=r["model_spec_json"], error=r["error"], created=r["created"],
                     updated=r["updated"], submitter=r["submitter"])


def _event_record(r: sqlite3.Row) -> EventRecord:
    return EventRecord(seq=r["seq"], job_id=r["job_id"], time=r["time"], kind=r["kind"], round=r["round"],
                       worker_id=r["worker_id"], message=r["message"])


def _worker_record(r: sqlite3.Row) -> WorkerRecord:
    return WorkerRecord(
        worker_id=r["worker_id"], categories=tuple(json.loads(r["categories_json"])),
        histogram=tuple(json.loads(r["histogram_json"])),
        dp=DPPolicy(enabled=bool(r["dp_enabled"]), **json.loads(r["dp_json"])), epsilon_spent=r["recorded"],
        device=r["device"], num_samples=r["num_samples"], last_seen=r["last_seen"], state=WorkerState(r["state"]),
        input_shape=tuple(json.loads(r["input_shape_json"])), num_classes=r["num_classes"],
        evaluation_samples=r["evaluation_samples"])
