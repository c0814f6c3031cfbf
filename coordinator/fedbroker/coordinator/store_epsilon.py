"""The part of the coordinator's state store (`StateStore`, which mixes it in) that keeps a worker's ε honest:
what the tasks it was issued can add to its ε (the bound on the ε a task outcome may claim for its job), the audit trail of
operators' corrections, the asynchronous trainings whose ε no version records, and a site's own record (its jobs,
their ε and what it shared with each: the SiteRecord call, which a site compares with its ledger). In a job with
distributed DP a site also reports its local-floor ε (its own noise share alone); it is kept beside the participant
row's ε (`epsilon_local_floor`) and never priced or charged.

As in store.py, every write is one transaction and no database row leaves the store: reads return records.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Row, Subquery, and_, case, func, or_, select, update
from sqlalchemy.engine import Connection

from fedbroker.coordinator.records import EpsilonCorrection, SiteJobRecord
from fedbroker.coordinator.store_notes import StoreAccess, write_event
from fedbroker.coordinator.store_sql import greatest, replace
from fedbroker.coordinator.tables import epsilon_corrections, issued_epsilon, jobs, participants, site_shares, workers
from fedbroker.job.status import JobStatus, ParticipantStatus

p = participants
# A participant's row that shows the site trained in that round: an update received, or ε reported with a failure.
_TRAINED = or_(p.c.status.in_(["uploaded", "aggregated", "discarded"]), p.c.epsilon.is_not(None))
# what a site shared is a short name (histogram, statistics, evaluation), never its content
_SHARE_NAME = re.compile(r"[a-z][a-z0-9_.-]{0,63}")
MAX_SUMMARY_CHARS = 2000  # a round-0 row's summary of an asynchronous job's trainings never aggregated


def priced(worker_id: str | None = None) -> Subquery:
    """The ε this coordinator priced per worker (columns `worker_id`, `priced`): per job the largest ε its
    participant rows hold (a job's ε on the worker's data is cumulative), summed over the jobs; of one worker
    when `worker_id` is given (a worker with no ε-bearing row has no row here: read it as 0)."""
    per_job = select(p.c.worker_id, func.max(p.c.epsilon).label("m")).where(p.c.epsilon.is_not(None))
    if worker_id is not None:
        per_job = per_job.where(p.c.worker_id == worker_id)
    jobs_of = per_job.group_by(p.c.worker_id, p.c.job_id).subquery("per_job")
    return (select(jobs_of.c.worker_id, func.coalesce(func.sum(jobs_of.c.m), 0.0).label("priced"))
            .group_by(jobs_of.c.worker_id).subquery("priced"))


class EpsilonTables(StoreAccess):
    """Mixed into `StateStore`: its transactions (`_write`) and reads (`_exec`) over three more tables."""

    def _epsilon_tables(self) -> None:
        """The tables exist from the store's first migration on (kept for the mixins that still call it)."""

    def note_issued_epsilon(self, tasks: Iterable[tuple[str, str, float, float]], *, forget_before: float) -> None:
        """Tasks issued, each (worker id, job id, deadline, the most ε its training can add): what the coordinator
        priced, bounding the ε a worker's report for that job may claim (participants.EpsilonBounds). Rows whose
        deadline is before `forget_before` are dropped: long settled."""
        rows = [dict(worker_id=w, job_id=j, deadline=d, cost=c) for w, j, d, c in tasks]

        def write(conn: Connection) -> None:
            if rows:
                conn.execute(issued_epsilon.insert(), rows)
            conn.execute(issued_epsilon.delete().where(issued_epsilon.c.deadline < forget_before))

        self._write(f"record the ε bound of {len(rows)} task(s)", write)

    def issued_epsilon(self, worker_id: str, job_id: str) -> float:
        """The most ε the tasks of `job_id` issued to a worker can have added to its ε on the worker's data."""
        i = issued_epsilon
        rows = self._exec(select(func.coalesce(func.sum(i.c.cost), 0.0).label("total"))
                          .where(i.c.worker_id == worker_id, i.c.job_id == job_id))
        return float(rows[0].total)

    def correct_epsilon(self, worker_id: str, *, epsilon: float, by: str, ledger_sha256: str, ledger_epsilon: float,
                        note: str = "") -> EpsilonCorrection | None:
        """Set the operator's figure for a worker's ε (it may lower the record, never below what the participant
        rows priced: store.recorded_epsilon takes the higher) and keep the correction in the audit trail, in one
        transaction; None when no worker has that id."""
        now = time.time()
        by_worker = priced(worker_id)

        def write(conn: Connection) -> EpsilonCorrection | None:
            row = conn.execute(
                select(greatest(workers.c.epsilon_spent, func.coalesce(by_worker.c.priced, 0.0)).label("recorded"))
                .select_from(workers.outerjoin(by_worker, by_worker.c.worker_id == workers.c.worker_id))
                .where(workers.c.worker_id == worker_id)).first()
            if row is None:
                return None
            old = float(row.recorded)
            conn.execute(update(workers).where(workers.c.worker_id == worker_id).values(epsilon_spent=epsilon))
            result = conn.execute(epsilon_corrections.insert().values(
                worker_id=worker_id, time=now, by=by, old=old, new=epsilon, ledger_sha256=ledger_sha256,
                ledger_epsilon=ledger_epsilon, note=note))
            seq = (result.inserted_primary_key or (0,))[0]
            return EpsilonCorrection(seq=int(seq or 0), worker_id=worker_id, time=now, by=by, old=old, new=epsilon,
                                     ledger_sha256=ledger_sha256, ledger_epsilon=ledger_epsilon, note=note)

        return self._write(f"correct the ε recorded for worker {worker_id!r}", write)

    def epsilon_corrections(self, worker_id: str | None = None) -> list[EpsilonCorrection]:
        """The audit trail of ε corrections (of one worker), oldest first."""
        c = epsilon_corrections
        query = select(c).order_by(c.c.seq)
        if worker_id is not None:
            query = query.where(c.c.worker_id == worker_id)
        return [_correction_record(r) for r in self._exec(query)]

    def record_local_floor(self, job_id: str, round_number: int, worker_id: str, floor: float) -> bool:
        """Keep the local-floor ε a site reported for a distributed-DP job beside its participant row's ε (the
        largest report: the floor only grows); False when the site was never asked for that round."""
        return self._run(
            f"record the local-floor ε of worker {worker_id!r} in round {round_number} of job {job_id!r}",
            update(p).where(p.c.job_id == job_id, p.c.round == round_number, p.c.worker_id == worker_id)
            .values(epsilon_local_floor=greatest(func.coalesce(p.c.epsilon_local_floor, 0.0), floor))) > 0

    def local_floors(self, worker_id: str) -> dict[str, float]:
        """Job id → the largest local-floor ε the site reported for it (distributed-DP jobs only)."""
        rows = self._exec(select(p.c.job_id, func.max(p.c.epsilon_local_floor).label("floor"))
                          .where(p.c.worker_id == worker_id, p.c.epsilon_local_floor.is_not(None))
                          .group_by(p.c.job_id).order_by(p.c.job_id))
        return {r.job_id: float(r.floor) for r in rows}

    def record_async_training(self, job_id: str, worker_id: str, *, task: int, status: ParticipantStatus,
                              reason: str, epsilon: float) -> None:
        """An asynchronous job's training whose update no version holds (refused as stale, or failed after
        training): its ε is spent on the worker's data all the same. Kept as the worker's participant row of round
        0 (ε: the largest such report, the job's total on its data; the reason counts the trainings) and as one
        event per training (`fedbroker jobs logs`)."""
        def write(conn: Connection) -> None:
            row = conn.execute(select(p.c.reason, p.c.epsilon).where(
                p.c.job_id == job_id, p.c.round == 0, p.c.worker_id == worker_id)).first()
            was, spent = ("", epsilon) if row is None else (row.reason, max(epsilon, float(row.epsilon or 0.0)))
            before = was.split(" ", 1)[0]
            count = int(before) + 1 if before.isdigit() else 1
            summary = f"{count} training(s) not aggregated; the last, task {task}: {reason}"[:MAX_SUMMARY_CHARS]
            replace(conn, p, dict(job_id=job_id, round=0, worker_id=worker_id, status=str(status), reason=summary,
                                  epsilon=spent))
            write_event(conn, job_id, status, worker_id=worker_id,
                        message=f"task {task}: trained, not aggregated (ε {epsilon:.4g}): {reason}")

        self._write(f"record a training of worker {worker_id!r} for job {job_id!r}", write)

    def note_site_share(self, job_id: str, worker_id: str, what: str) -> None:
        """Record that a site sent `what` (histogram, statistics, evaluation) to a job: the coordinator's side of
        the site's shared log, listed by `site_jobs`. Noting it again changes nothing but the time."""
        if not _SHARE_NAME.fullmatch(what):
            raise ValueError(f"a share's name is 1-64 lower-case letters, digits, '_', '.' or '-', got {what!r}")
        self._write(f"record that worker {worker_id!r} shared its {what} with job {job_id!r}",
                    lambda conn: replace(conn, site_shares, dict(job_id=job_id, worker_id=worker_id, what=what,
                                                                 time=time.time())))

    def site_jobs(self, worker_id: str) -> list[SiteJobRecord]:
        """Every job the site took part in or shared with, oldest first: its status, the highest ε the site
        reported for it (0 when it never trained), the rounds (asynchronous: versions) in which it trained, and
        what it shared."""
        s, q = site_shares, p.alias("q")
        took_part = select(q.c.job_id).where(q.c.job_id == jobs.c.job_id, q.c.worker_id == worker_id).exists()
        shared_with = select(s.c.job_id).where(s.c.job_id == jobs.c.job_id, s.c.worker_id == worker_id).exists()
        trained = func.sum(case((and_(p.c.round > 0, _TRAINED), 1), else_=0))
        rows = self._exec(
            select(jobs.c.job_id, jobs.c.status, func.coalesce(func.max(p.c.epsilon), 0.0).label("epsilon"),
                   func.coalesce(trained, 0).label("rounds"))
            .select_from(jobs.outerjoin(p, and_(p.c.job_id == jobs.c.job_id, p.c.worker_id == worker_id)))
            .where(or_(took_part, shared_with))
            .group_by(jobs.c.job_id, jobs.c.status, jobs.c.created).order_by(jobs.c.created, jobs.c.job_id))
        shared: dict[str, list[str]] = {}
        for r in self._exec(select(s.c.job_id, s.c.what).where(s.c.worker_id == worker_id).order_by(s.c.what)):
            shared.setdefault(r.job_id, []).append(r.what)
        return [_site_job_record(r, tuple(shared.get(r.job_id, ()))) for r in rows]


# ----- rows into records (the only place that reads a row of these tables by column name) -----

def _correction_record(row: Row[Any]) -> EpsilonCorrection:
    r = row._mapping
    return EpsilonCorrection(seq=r["seq"], worker_id=r["worker_id"], time=r["time"], by=r["by"], old=r["old"],
                             new=r["new"], ledger_sha256=r["ledger_sha256"], ledger_epsilon=r["ledger_epsilon"],
                             note=r["note"])


def _site_job_record(row: Row[Any], shared: tuple[str, ...]) -> SiteJobRecord:
    r = row._mapping
    return SiteJobRecord(job_id=r["job_id"], status=JobStatus(r["status"]), epsilon=float(r["epsilon"]),
                         rounds=int(r["rounds"]), shared=shared)
