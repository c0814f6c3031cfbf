"""The part of the coordinator's state store (`StateStore`, which mixes it in) that keeps a worker's ε honest:
what the tasks it was issued can add to its ε (the bound on the ε a task outcome may claim for its job), the audit trail of
operators' corrections, the asynchronous trainings whose ε no version records, and a site's own record (its jobs,
their ε and what it shared with each: the SiteRecord call, which a site compares with its ledger). In a job with
distributed DP a site also reports its local-floor ε (its own noise share alone); it is kept beside the participant
row's ε (`epsilon_local_floor`, a column added to older state files on first use) and never priced or charged.

Its tables are created on first use, so a state file written before them gets them then. As in store.py, every
write is one transaction and no SQLite row leaves the store: reads return records.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterable

from fedbroker.coordinator.records import EpsilonCorrection, SiteJobRecord
from fedbroker.coordinator.store_notes import StoreAccess, write_event
from fedbroker.job.status import JobStatus, ParticipantStatus

SCHEMA = """
CREATE TABLE IF NOT EXISTS issued_epsilon (worker_id TEXT NOT NULL, deadline REAL NOT NULL, cost REAL NOT NULL);
CREATE TABLE IF NOT EXISTS epsilon_corrections (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, worker_id TEXT NOT NULL, time REAL NOT NULL, by TEXT NOT NULL,
    old REAL NOT NULL, new REAL NOT NULL, ledger_sha256 TEXT NOT NULL, ledger_epsilon REAL NOT NULL,
    note TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS site_shares (
    job_id TEXT NOT NULL, worker_id TEXT NOT NULL, what TEXT NOT NULL, time REAL NOT NULL,
    PRIMARY KEY (job_id, worker_id, what)
);
"""
# The ε this coordinator priced for worker `w` (a row with a worker_id): per job the largest ε its participant
# rows hold (a job's ε on the worker's data is cumulative), summed over the jobs.
PRICED = ("(SELECT COALESCE(SUM(m), 0) FROM (SELECT MAX(p.epsilon) AS m FROM participants p"
          " WHERE p.worker_id = w.worker_id AND p.epsilon IS NOT NULL GROUP BY p.job_id))")
# A participant's row that shows the site trained in that round: an update received, or ε reported with a failure.
_TRAINED = "(p.status IN ('uploaded', 'aggregated', 'discarded') OR p.epsilon IS NOT NULL)"
# what a site shared is a short name (histogram, statistics, evaluation), never its content
_SHARE_NAME = re.compile(r"[a-z][a-z0-9_.-]{0,63}")
MAX_SUMMARY_CHARS = 2000  # a round-0 row's summary of an asynchronous job's trainings never aggregated


class EpsilonTables(StoreAccess):
    """Mixed into `StateStore`: its transactions (`_write`) and reads (`_exec`) over three more tables."""

    _epsilon_tables_ready = False

    def _epsilon_tables(self) -> None:
        if not self._epsilon_tables_ready:
            def create(db: sqlite3.Connection) -> None:
                for statement in (s for s in SCHEMA.split(";") if s.strip()):
                    db.execute(statement)
                columns = {name for (name,) in db.execute("SELECT name FROM pragma_table_info('issued_epsilon')")}
                if "job_id" not in columns:  # a state file of an older version: its rows price no job
                    db.execute("ALTER TABLE issued_epsilon ADD COLUMN job_id TEXT NOT NULL DEFAULT ''")
                db.execute("CREATE INDEX IF NOT EXISTS issued_epsilon_by_job ON issued_epsilon (worker_id, job_id)")
                columns = {name for (name,) in db.execute("SELECT name FROM pragma_table_info('participants')")}
                if "epsilon_local_floor" not in columns:  # a state file from before distributed DP: no floors yet
                    db.execute("ALTER TABLE participants ADD COLUMN epsilon_local_floor REAL")

            self._write("create its ε tables", create)
            self._epsilon_tables_ready = True

    def note_issued_epsilon(self, tasks: Iterable[tuple[str, str, float, float]], *, forget_before: float) -> None:
        """Tasks issued, each (worker id, job id, deadline, the most ε its training can add): what the coordinator
        priced, bounding the ε a worker's report for that job may claim (participants.EpsilonBounds). Rows whose
        deadline is before `forget_before` are dropped: long settled."""
        rows = list(tasks)
        self._epsilon_tables()

        def write(db: sqlite3.Connection) -> None:
            db.executemany("INSERT INTO issued_epsilon (worker_id, job_id, deadline, cost) VALUES (?, ?, ?, ?)", rows)
            db.execute("DELETE FROM issued_epsilon WHERE deadline < ?", (forget_before,))

        self._write(f"record the ε bound of {len(rows)} task(s)", write)

    def issued_epsilon(self, worker_id: str, job_id: str) -> float:
        """The most ε the tasks of `job_id` issued to a worker can have added to its ε on the worker's data."""
        self._epsilon_tables()
        rows = self._exec("SELECT COALESCE(SUM(cost), 0) AS total FROM issued_epsilon WHERE worker_id = ?"
                          " AND job_id = ?", (worker_id, job_id))
        ((total,),) = rows
        return float(total)

    def correct_epsilon(self, worker_id: str, *, epsilon: float, by: str, ledger_sha256: str, ledger_epsilon: float,
                        note: str = "") -> EpsilonCorrection | None:
        """Set the operator's figure for a worker's ε (it may lower the record, never below what the participant
        rows priced: store.recorded_epsilon takes the higher) and keep the correction in the audit trail, in one
        transaction; None when no worker has that id."""
        self._epsilon_tables()
        now = time.time()

        def write(db: sqlite3.Connection) -> EpsilonCorrection | None:
            row = db.execute(f"SELECT MAX(w.epsilon_spent, {PRICED}) AS recorded FROM workers w WHERE w.worker_id = ?",
                             (worker_id,)).fetchone()
            if row is None:
                return None
            old = float(row[0])
            db.execute("UPDATE workers SET epsilon_spent = ? WHERE worker_id = ?", (epsilon, worker_id))
            seq = db.execute(
                "INSERT INTO epsilon_corrections (worker_id, time, by, old, new, ledger_sha256, ledger_epsilon, note)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (worker_id, now, by, old, epsilon, ledger_sha256, ledger_epsilon, note)).lastrowid
            return EpsilonCorrection(seq=int(seq or 0), worker_id=worker_id, time=now, by=by, old=old, new=epsilon,
                                     ledger_sha256=ledger_sha256, ledger_epsilon=ledger_epsilon, note=note)

        return self._write(f"correct the ε recorded for worker {worker_id!r}", write)

    def epsilon_corrections(self, worker_id: str | None = None) -> list[EpsilonCorrection]:
        """The audit trail of ε corrections (of one worker), oldest first."""
        self._epsilon_tables()
        if worker_id is None:
            rows = self._exec("SELECT * FROM epsilon_corrections ORDER BY seq")
        else:
            rows = self._exec("SELECT * FROM epsilon_corrections WHERE worker_id = ? ORDER BY seq", (worker_id,))
        return [_correction_record(r) for r in rows]

    def record_local_floor(self, job_id: str, round_number: int, worker_id: str, floor: float) -> bool:
        """Keep the local-floor ε a site reported for a distributed-DP job beside its participant row's ε (the
        largest report: the floor only grows); False when the site was never asked for that round."""
        self._epsilon_tables()
        return self._write(
            f"record the local-floor ε of worker {worker_id!r} in round {round_number} of job {job_id!r}",
            lambda db: db.execute(
                "UPDATE participants SET epsilon_local_floor = MAX(COALESCE(epsilon_local_floor, 0), ?) WHERE"
                " job_id = ? AND round = ? AND worker_id = ?", (floor, job_id, round_number, worker_id)).rowcount > 0)

    def local_floors(self, worker_id: str) -> dict[str, float]:
        """Job id → the largest local-floor ε the site reported for it (distributed-DP jobs only)."""
        self._epsilon_tables()
        rows = self._exec("SELECT job_id, MAX(epsilon_local_floor) AS floor FROM participants WHERE worker_id = ?"
                          " AND epsilon_local_floor IS NOT NULL GROUP BY job_id ORDER BY job_id", (worker_id,))
        return {r["job_id"]: float(r["floor"]) for r in rows}

    def record_async_training(self, job_id: str, worker_id: str, *, task: int, status: ParticipantStatus,
                              reason: str, epsilon: float) -> None:
        """An asynchronous job's training whose update no version holds (refused as stale, or failed after
        training): its ε is spent on the worker's data all the same. Kept as the worker's participant row of round
        0 (ε: the largest such report, the job's total on its data; the reason counts the trainings) and as one
        event per training (`fedbroker jobs logs`)."""
        def write(db: sqlite3.Connection) -> None:
            row = db.execute("SELECT reason, epsilon FROM participants WHERE job_id = ? AND round = 0 AND"
                             " worker_id = ?", (job_id, worker_id)).fetchone()
            was, spent = ("", epsilon) if row is None else (row[0], max(epsilon, float(row[1] or 0.0)))
            before = was.split(" ", 1)[0]
            count = int(before) + 1 if before.isdigit() else 1
            summary = f"{count} training(s) not aggregated; the last, task {task}: {reason}"[:MAX_SUMMARY_CHARS]
            db.execute("INSERT OR REPLACE INTO participants (job_id, round, worker_id, status, reason, epsilon)"
                       " VALUES (?, 0, ?, ?, ?, ?)", (job_id, worker_id, status, summary, spent))
            write_event(db, job_id, status, worker_id=worker_id,
                        message=f"task {task}: trained, not aggregated (ε {epsilon:.4g}): {reason}")

        self._write(f"record a training of worker {worker_id!r} for job {job_id!r}", write)

    def note_site_share(self, job_id: str, worker_id: str, what: str) -> None:
        """Record that a site sent `what` (histogram, statistics, evaluation) to a job: the coordinator's side of
        the site's shared log, listed by `site_jobs`. Noting it again changes nothing but the time."""
        if not _SHARE_NAME.fullmatch(what):
            raise ValueError(f"a share's name is 1-64 lower-case letters, digits, '_', '.' or '-', got {what!r}")
        self._epsilon_tables()
        self._write(f"record that worker {worker_id!r} shared its {what} with job {job_id!r}",
                    lambda db: db.execute("INSERT OR REPLACE INTO site_shares (job_id, worker_id, what, time)"
                                          " VALUES (?, ?, ?, ?)", (job_id, worker_id, what, time.time())))

    def site_jobs(self, worker_id: str) -> list[SiteJobRecord]:
        """Every job the site took part in or shared with, oldest first: its status, the highest ε the site
        reported for it (0 when it never trained), the rounds (asynchronous: versions) in which it trained, and
        what it shared."""
        self._epsilon_tables()
        rows = self._exec(
            "SELECT j.job_id, j.status, COALESCE(MAX(p.epsilon), 0) AS epsilon,"
            f" COALESCE(SUM(CASE WHEN p.round > 0 AND {_TRAINED} THEN 1 ELSE 0 END), 0) AS rounds,"
            " (SELECT GROUP_CONCAT(what, ',') FROM (SELECT what FROM site_shares s WHERE s.job_id = j.job_id"
            "   AND s.worker_id = ? ORDER BY what)) AS shared"
            " FROM jobs j LEFT JOIN participants p ON p.job_id = j.job_id AND p.worker_id = ?"
            " WHERE EXISTS (SELECT 1 FROM participants q WHERE q.job_id = j.job_id AND q.worker_id = ?)"
            "    OR EXISTS (SELECT 1 FROM site_shares s WHERE s.job_id = j.job_id AND s.worker_id = ?)"
            " GROUP BY j.job_id ORDER BY j.created, j.job_id", (worker_id, worker_id, worker_id, worker_id))
        return [_site_job_record(r) for r in rows]


# ----- rows into records (the only place that reads a row of these tables by column name) -----

def _correction_record(r: sqlite3.Row) -> EpsilonCorrection:
    return EpsilonCorrection(seq=r["seq"], worker_id=r["worker_id"], time=r["time"], by=r["by"], old=r["old"],
                             new=r["new"], ledger_sha256=r["ledger_sha256"], ledger_epsilon=r["ledger_epsilon"],
                             note=r["note"])


def _site_job_record(r: sqlite3.Row) -> SiteJobRecord:
    return SiteJobRecord(job_id=r["job_id"], status=JobStatus(r["status"]), epsilon=float(r["epsilon"]),
                         rounds=int(r["rounds"]), shared=tuple(r["shared"].split(",")) if r["shared"] else ())
