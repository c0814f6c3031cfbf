"""The coordinator's durable state: jobs, workers, rounds, participants, events, on SQLAlchemy Core.

One code path, two engines (`store_sql.py`): an embedded SQLite file in the state directory (the default), or a
PostgreSQL database (`coordinator.database_url`) that a standby coordinator can share. Every write commits at once,
so a restarted coordinator finds each job where it stopped: the last closed round and its checkpoint, and the round
that was open (its participants and deadline), which it resumes instead of starting over.

Every write is one transaction (SQLite: `BEGIN IMMEDIATE`; PostgreSQL: the store's advisory lock) that is rolled
back on any database error (a lock held past the busy timeout, a full disk, a server gone): the error reaches the
caller as `StateUnavailable` (gRPC UNAVAILABLE). A job's thread rides such an outage out (`retrying_writes`);
intake (SubmitJob, the control queue) fails at once, so a submission that could not be written gets no job id.
A store given a `fence` (a standby coordinator's lease) calls it first in every write transaction: a coordinator
that lost the lead is refused (`LeaseLost`, never retried) before it writes anything.

Reads return the frozen records of `records.py`: no database row leaves the store.

`StateStore.in_directory` is how a coordinator process opens an embedded state: the folder (0700) is locked
(`state_dir.py`) so a second coordinator on it is refused, and the SQLite file is created 0600 like the
checkpoints. Opening any store migrates it to the schema this code knows (`store_schema`, Alembic) and refuses
one a newer release wrote.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from sqlalchemy import Engine, Executable, Row, func, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from fedbroker.config import DPPolicy
from fedbroker.coordinator import tables as t
from fedbroker.coordinator.records import EventRecord, JobRecord, WorkerRecord
from fedbroker.coordinator.schema import current_version
from fedbroker.coordinator.state_dir import StateDirLock, database_of, mark_database, owner_only
from fedbroker.coordinator.store_epsilon import EpsilonTables, priced
from fedbroker.coordinator.store_evaluation import EvaluationTables
from fedbroker.coordinator.store_notes import JobNotes, write_event
from fedbroker.coordinator.store_rounds import Discarded, RoundTables, keep_discarded
from fedbroker.coordinator.store_schema import upgrade
from fedbroker.coordinator.store_shares import ShareTables
from fedbroker.coordinator.store_site_dp import SiteDPTables
from fedbroker.coordinator.store_sites import SiteTables
from fedbroker.coordinator.store_sql import (
    begin_write,
    database_url,
    describe,
    greatest,
    lock_writes,
    make_engine,
    upsert,
)
from fedbroker.errors import ConfigError, Unavailable
from fedbroker.job.status import FINISHED, JobStatus, WorkerState
from fedbroker.retry import Backoff, retry_call

log = logging.getLogger(__name__)
T = TypeVar("T")
Fence = Callable[[Connection], None]

DB_FILE = "coordinator.sqlite"
# Between tries of a write that a job's thread rides out (a lock held elsewhere, a full disk, a server restarting).
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
    """The coordinator's database; `location`: a SQLite file's path (or `:memory:`) or a SQLAlchemy URL
    (`postgresql+psycopg://user@host/db`); `busy_timeout_s`: how long a write waits for a lock (or a pooled
    connection) before it fails; `fence`: called first in every write transaction (module docstring). Its jobs and
    workers are here; rounds and their participants: store_rounds.py; ε bounds and corrections: store_epsilon.py;
    a job's history and events of their own: store_notes.py; what sites shared with a job before round 1:
    store_shares.py; federated evaluation: store_evaluation.py; what an operator reads about the sites:
    store_sites.py; site-level DP: store_site_dp.py. Tables: tables.py."""

    def __init__(self, location: str, *, busy_timeout_s: float = 5.0, lock: StateDirLock | None = None,
                 fence: Fence | None = None) -> None:
        url = database_url(location)
        self.path = describe(url)  # how messages name it (a URL without its password)
        self.busy_timeout_s = busy_timeout_s
        self.fence = fence
        self._dir_lock = lock
        self._local = threading.local()  # the calling thread's write-retry policy (retrying_writes)
        self.sqlite = url.get_backend_name() == "sqlite"
        # SQLite: one writer at a time in this process (the file's lock serializes processes); `:memory:` is one
        # connection, so its reads take the lock too
        self._writes = threading.Lock()
        self._memory = self.sqlite and self.path == ":memory:"
        try:
            self.engine: Engine = make_engine(url, busy_timeout_s=busy_timeout_s)
        except SQLAlchemyError as exc:
            raise StateUnavailable(f"the coordinator's state store {self.path} could not be opened: "
                                   f"{_brief(exc)}") from exc
        try:
            self._migrate()
        except BaseException:
            self.engine.dispose()
            raise

    @classmethod
    def from_url(cls, url: str, *, busy_timeout_s: float = 5.0, fence: Fence | None = None) -> StateStore:
        """A store on a database URL (`coordinator.database_url`): PostgreSQL for clusters, or a SQLite file."""
        return cls(url, busy_timeout_s=busy_timeout_s, fence=fence)

    @classmethod
    def for_coordinator(cls, state_dir: str, database_url: str = "", *, busy_timeout_s: float = 5.0) -> StateStore:
        """A coordinator process's state: in `database_url` when set (the state directory, 0700, then keeps the
        checkpoints and a mark saying where the state is: a backup of the folder alone is refused), else
        `in_directory(state_dir)`."""
        if not database_url:
            return cls.in_directory(state_dir, busy_timeout_s=busy_timeout_s)
        store = cls.from_url(database_url, busy_timeout_s=busy_timeout_s)
        try:
            mark_database(state_dir, store.path)
        except OSError:
            store.close()
            raise
        return store

    @classmethod
    def in_directory(cls, state_dir: str, *, busy_timeout_s: float = 5.0) -> StateStore:
        """A coordinator's state: `state_dir` (created 0700) locked for this process, its SQLite file in it.
        `StateDirInUse` when another coordinator holds it; `close()` releases it. A folder whose coordinator keeps its
        state in a database (`for_coordinator`) is refused: an empty SQLite file there would be read as its state."""
        elsewhere = database_of(state_dir)
        if elsewhere:
            raise ConfigError("coordinator.state_dir", f"the coordinator of {state_dir} keeps its state in {elsewhere}, "
                                                       f"not in this folder: open it there (coordinator.database_url)")
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        owner_only(state_dir, 0o700)
        lock = StateDirLock(state_dir)
        try:
            return cls(os.path.join(state_dir, DB_FILE), busy_timeout_s=busy_timeout_s, lock=lock)
        except BaseException:
            lock.release()
            raise

    def _migrate(self) -> None:
        """Bring the database to the schema this code knows (`store_schema`); a newer one is refused (`SchemaTooNew`)."""
        self._transaction("be migrated", lambda conn: upgrade(conn, path=self.path), fenced=False)

    def schema_version(self) -> int:
        """The database's schema version (its Alembic revision): `store_schema.HEAD` once open."""
        with self._reading() as conn:
            return current_version(conn, self.path)

    def close(self) -> None:
        """Close the database's connections and release the state directory (if this store holds it)."""
        with self._writes:
            self.engine.dispose()
            if self._dir_lock is not None:
                self._dir_lock.release()
                self._dir_lock = None

    @contextlib.contextmanager
    def retrying_writes(self, *, for_s: float, sleep: Callable[[float], object] = time.sleep,
                        stopping: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """Within this block, a write from the calling thread that fails (rolled back) is tried again with
        backoff for up to `for_s` seconds (each write), then `StateUnavailable` propagates; `stopping()` true ends the
        retrying at once. For a job's thread, which must ride a store outage out rather than die in it;
        other threads (SubmitJob) keep failing at once. A lost lease (`LeaseLost`) is never retried."""
        previous = getattr(self._local, "retry", None)
        self._local.retry = _RetryPolicy(for_s, sleep, stopping)
        try:
            yield
        finally:
            self._local.retry = previous

    def _write(self, what: str, fn: Callable[[Connection], T]) -> T:
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

    def _transaction(self, what: str, fn: Callable[[Connection], T], *, fenced: bool = True) -> T:
        """One write transaction: the write lock first, then the fence, then `fn`; any database error rolls it
        back (the connection's context does) and becomes `StateUnavailable`; anything else (LeaseLost) propagates."""
        with self._writes if self.sqlite else contextlib.nullcontext():
            try:
                with self.engine.connect() as conn:
                    begin_write(conn)
                    with conn.begin():
                        lock_writes(conn)
                        if fenced and self.fence is not None:
                            self.fence(conn)
                        return fn(conn)
            except SQLAlchemyError as exc:
                raise StateUnavailable(f"the coordinator's state store {self.path} could not {what}: "
                                       f"{_brief(exc)} (rolled back: nothing of it was recorded)") from exc

    @contextlib.contextmanager
    def _reading(self) -> Iterator[Connection]:
        with self._writes if self._memory else contextlib.nullcontext(), self.engine.connect() as conn:
            yield conn

    def _exec(self, statement: Executable, params: Mapping[str, Any] | None = None) -> Sequence[Row[Any]]:
        """A read (one statement; its transaction ends with it)."""
        try:
            with self._reading() as conn:
                return conn.execute(statement, dict(params or {})).all()
        except SQLAlchemyError as exc:
            raise StateUnavailable(f"the coordinator's state store {self.path} could not be read: "
                                   f"{_brief(exc)}") from exc

    def _run(self, what: str, statement: Executable, params: Mapping[str, Any] | None = None) -> int:
        """One write statement in its own transaction; the number of rows it changed."""
        return self._write(what, lambda conn: int(conn.execute(statement, dict(params or {})).rowcount or 0))

    # ----- jobs -----

    def add_job(self, job_id: str, name: str, spec_json: str, rounds_total: int, model_spec_json: str, *,
                submitter: str = "") -> None:
        """`submitter`: the identity whose token submitted it, the only one that may cancel or download it."""
        now = time.time()

        def write(conn: Connection) -> None:
            conn.execute(t.jobs.insert().values(
                job_id=job_id, name=name, spec_json=spec_json, status=JobStatus.PENDING, rounds_total=rounds_total,
                model_spec_json=model_spec_json, created=now, updated=now, submitter=submitter))
            write_event(conn, job_id, "submitted", message=f"{rounds_total} round(s)"
                        + (f", by {submitter}" if submitter else ""))

        self._write(f"record job {job_id!r}", write)

    def set_job_status(self, job_id: str, status: JobStatus, error: str = "") -> bool:
        """Record a job's status; whether it was written. A job that has ended never changes again, and only
        a pending (or resumed running) job becomes `running`: one asked to cancel, or cancelled while its
        thread was starting, never runs (a restarted coordinator finishes the cancel). On False for
        `running`, the caller must not run the job."""
        def write(conn: Connection) -> bool:
            before = conn.execute(select(t.jobs.c.status).where(t.jobs.c.job_id == job_id)).scalar()
            if before is None:
                return False
            if before in FINISHED or (status == JobStatus.RUNNING and before not in _RUNNABLE):
                return False
            conn.execute(update(t.jobs).where(t.jobs.c.job_id == job_id)
                         .values(status=status, error=error, updated=time.time()))
            if before != status or error:
                write_event(conn, job_id, status, message=error)
            return True

        return self._write(f"record job {job_id!r} as {status}", write)

    def request_cancel(self, job_id: str, *, by: str) -> bool:
        """Mark a pending or running job `cancelling` (durably: a coordinator that stops before its thread
        acts on it cancels it when it starts again); False when it had ended already."""
        def write(conn: Connection) -> bool:
            changed = conn.execute(
                update(t.jobs).where(t.jobs.c.job_id == job_id,
                                     t.jobs.c.status.in_([JobStatus.PENDING, JobStatus.RUNNING]))
                .values(status=JobStatus.CANCELLING, updated=time.time())).rowcount > 0
            if changed:
                write_event(conn, job_id, JobStatus.CANCELLING, message=f"cancel requested{' by ' + by if by else ''}")
            return changed

        return self._write(f"record a cancel of job {job_id!r}", write)

    def cancel_job(self, job_id: str, *, by: str, round_number: int | None = None,
                   discarded: Discarded = ()) -> bool:
        """Record a cancelled job in one transaction: its open round (if any) abandoned, never closed; the
        uploads the aggregation service discarded kept with the ε their workers spent on them; the
        participants that had not uploaded marked cancelled. Only a job that has not ended: a cancel that
        lands as the job completes (or fails) changes nothing and returns False."""
        why = f"cancelled by {by}" if by else "cancelled"
        p = t.participants

        def write(conn: Connection) -> bool:
            now = time.time()
            if conn.execute(update(t.jobs).where(t.jobs.c.job_id == job_id, t.jobs.c.status.not_in(sorted(FINISHED)))
                            .values(status=JobStatus.CANCELLED, error=why, updated=now)).rowcount == 0:
                return False
            if round_number is not None:
                this_round = (p.c.job_id == job_id, p.c.round == round_number)
                keep_discarded(conn, job_id, round_number, discarded, why=f"the job was {why}")
                conn.execute(update(p).where(*this_round, p.c.status.in_(["published", "uploaded"]))
                             .values(status="cancelled", reason=f"the job was {why}"))
                conn.execute(update(t.rounds).where(t.rounds.c.job_id == job_id, t.rounds.c.round == round_number,
                                                    t.rounds.c.status == "open")
                             .values(status="abandoned", closed=now, seconds=now - t.rounds.c.started))
                write_event(conn, job_id, "round_abandoned", round_number=round_number,
                            message="abandoned at the aggregation service: no new version")
            write_event(conn, job_id, JobStatus.CANCELLED, message=why)
            return True

        return self._write(f"record job {job_id!r} as cancelled", write)

    def events(self, job_id: str, *, after: int = 0, limit: int = 1000) -> list[EventRecord]:
        """A job's events in the order they happened, those with seq > `after`, at most `limit`."""
        e = t.events
        rows = self._exec(select(e).where(e.c.job_id == job_id, e.c.seq > after).order_by(e.c.seq).limit(limit))
        return [_event_record(r) for r in rows]

    def job(self, job_id: str) -> JobRecord | None:
        """The job, or None when no job has that id."""
        rows = self._exec(select(t.jobs).where(t.jobs.c.job_id == job_id))
        return _job_record(rows[0]) if rows else None

    def jobs(self, status: JobStatus | None = None) -> list[JobRecord]:
        """Every job (or those in `status`), oldest first: the order a restart resumes them in."""
        query = select(t.jobs).order_by(t.jobs.c.created)
        if status:
            query = query.where(t.jobs.c.status == status)
        return [_job_record(r) for r in self._exec(query)]

    # ----- workers -----

    def upsert_worker(self, *, worker_id: str, categories: Iterable[str], histogram: Iterable[int], dp: DPPolicy,
                      epsilon_spent: float, device: str, num_samples: int, input_shape: Iterable[int] = (),
                      num_classes: int = 0, evaluation_samples: int = 0) -> None:
        """A registration. `epsilon_spent` only raises the worker's floor (an operator's or a test's figure): the
        control queue passes 0, since a site's claim is never recorded (`recorded_epsilon`)."""
        now = time.time()
        numbers = {k: v for k, v in asdict(dp).items() if k != "enabled"}
        row = dict(worker_id=worker_id, categories_json=json.dumps(list(categories)),
                   histogram_json=json.dumps([int(c) for c in histogram]), dp_enabled=int(dp.enabled),
                   dp_json=json.dumps(numbers), epsilon_spent=epsilon_spent, device=device, num_samples=num_samples,
                   registered=now, last_seen=now, input_shape_json=json.dumps([int(d) for d in input_shape]),
                   num_classes=num_classes, evaluation_samples=evaluation_samples)
        kept = {"worker_id", "registered", "epsilon_spent"}  # the first registration's time, and ε only rises

        def changes(excluded: Any) -> dict[str, Any]:
            return {**{k: excluded[k] for k in row if k not in kept},
                    "epsilon_spent": greatest(t.workers.c.epsilon_spent, excluded.epsilon_spent)}

        self._write(f"record the registration of worker {worker_id!r}",
                    lambda conn: upsert(conn, t.workers, row, keys=["worker_id"], update=changes))

    def touch_worker(self, worker_id: str, *, state: WorkerState) -> bool:
        """A heartbeat (its ε claim is advisory, never recorded); False when no worker has that id."""
        return self._run(
            f"record a heartbeat of worker {worker_id!r}",
            update(t.workers).where(t.workers.c.worker_id == worker_id).values(last_seen=time.time(), state=state),
        ) > 0

    def recorded_epsilon(self, worker_id: str) -> float | None:
        """The ε recorded for a worker (None: unknown worker): what this coordinator priced itself, the sum over
        its jobs of the ε its participant rows hold (`priced_epsilon`), or the operator's audited correction
        when that is higher. Never a heartbeat's or registration's claim: anyone able to publish one could lock
        the site out (a worker whose ledger holds less than its record refuses to train)."""
        rows = self._exec(select(t.workers.c.epsilon_spent).where(t.workers.c.worker_id == worker_id))
        if not rows:
            return None
        return max(float(rows[0].epsilon_spent), self.priced_epsilon(worker_id))

    def priced_epsilon(self, worker_id: str) -> float:
        """The ε this coordinator's own participant rows hold for a worker: per job, the largest ε recorded for
        it (an update's, or a training reported failed or not aggregated), summed over its jobs."""
        by_worker = priced(worker_id)
        rows = self._exec(select(by_worker.c.priced))
        return float(rows[0].priced) if rows else 0.0

    def workers(self, category: str | None = None, *, seen_within_s: float | None = None) -> list[WorkerRecord]:
        """Registered workers by id: those serving `category`, and seen within `seen_within_s` (active)."""
        w, by_worker = t.workers, priced()
        recorded = greatest(w.c.epsilon_spent, func.coalesce(by_worker.c.priced, 0.0)).label("recorded")
        rows = self._exec(select(w, recorded).outerjoin(by_worker, by_worker.c.worker_id == w.c.worker_id)
                          .order_by(w.c.worker_id))
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


# ----- rows into records (the only place that reads a row by column name) -----

def _brief(exc: SQLAlchemyError) -> str:
    """The database's own words, without SQLAlchemy's statement and parameters (which may hold a site's data)."""
    said = str(getattr(exc, "orig", None) or exc).strip()
    return said.splitlines()[0] if said else type(exc).__name__


def _job_record(row: Row[Any]) -> JobRecord:
    r = row._mapping
    return JobRecord(job_id=r["job_id"], name=r["name"], spec_json=r["spec_json"], status=JobStatus(r["status"]),
                     rounds_total=r["rounds_total"], rounds_done=r["rounds_done"],
                     model_spec_json=r["model_spec_json"], error=r["error"], created=r["created"],
                     updated=r["updated"], submitter=r["submitter"])


def _event_record(row: Row[Any]) -> EventRecord:
    r = row._mapping
    return EventRecord(seq=r["seq"], job_id=r["job_id"], time=r["time"], kind=r["kind"], round=r["round"],
                       worker_id=r["worker_id"], message=r["message"])


def _worker_record(row: Row[Any]) -> WorkerRecord:
    r = row._mapping
    return WorkerRecord(
        worker_id=r["worker_id"], categories=tuple(json.loads(r["categories_json"])),
        histogram=tuple(json.loads(r["histogram_json"])),
        dp=DPPolicy(enabled=bool(r["dp_enabled"]), **json.loads(r["dp_json"])), epsilon_spent=float(r["recorded"]),
        device=r["device"], num_samples=r["num_samples"], last_seen=r["last_seen"], state=WorkerState(r["state"]),
        input_shape=tuple(json.loads(r["input_shape_json"])), num_classes=r["num_classes"],
        evaluation_samples=r["evaluation_samples"])
