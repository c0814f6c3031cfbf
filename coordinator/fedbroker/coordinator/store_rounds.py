"""The part of the coordinator's state store (`StateStore`, which mixes it in) that holds a job's rounds and
who takes part in each: a round is recorded (its participants `published`) before the aggregation service hears
of it, each participant's upload, refusal or failure as it comes, and the close (or failure) with the job's
progress in one transaction, so a restarted coordinator resumes from the last closed round's checkpoint.

As in store.py, every write is one transaction and no SQLite row leaves the store: reads return records.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence

from fedbroker.coordinator.records import ParticipantRecord, RoundRecord
from fedbroker.coordinator.store_notes import StoreAccess, write_event
from fedbroker.job.status import ParticipantStatus, RoundStatus


class RoundTables(StoreAccess):
    """Mixed into `StateStore`: the `rounds` and `participants` tables (module docstring)."""

    def open_round(self, job_id: str, round_number: int, participants: Sequence[str], *,
                   deadline: float | None = None, started: float | None = None) -> None:
        """Record a round (its participants `published`) before the aggregation service hears of it."""
        def write(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM participants WHERE job_id = ? AND round = ?", (job_id, round_number))
            db.execute(
                "INSERT OR REPLACE INTO rounds (job_id, round, status, participants, started, deadline)"
                " VALUES (?, ?, 'open', ?, ?, ?)",
                (job_id, round_number, len(participants), started if started is not None else time.time(), deadline),
            )
            db.executemany(
                "INSERT INTO participants (job_id, round, worker_id, status) VALUES (?, ?, ?, 'published')",
                [(job_id, round_number, w) for w in participants],
            )
            write_event(db, job_id, "round_opened", round_number=round_number,
                        message=f"{len(participants)} participant(s): {', '.join(participants)}")

        self._write(f"open round {round_number} of job {job_id!r}", write)

    def round(self, job_id: str, round_number: int) -> RoundRecord | None:
        """One round of a job, or None when it was never opened."""
        rows = self._exec("SELECT * FROM rounds WHERE job_id = ? AND round = ?", (job_id, round_number))
        return _round_record(rows[0]) if rows else None

    def set_round_deadline(self, job_id: str, round_number: int, deadline: float) -> None:
        """Move an open round's deadline (a resumed or re-opened round gets a fresh one)."""
        self._run(f"move the deadline of round {round_number} of job {job_id!r}",
                  "UPDATE rounds SET deadline = ? WHERE job_id = ? AND round = ?", (deadline, job_id, round_number))

    def set_uploaded(self, job_id: str, round_number: int, workers: Sequence[str]) -> None:
        """The participants whose update the aggregation service has accepted so far."""
        def write(db: sqlite3.Connection) -> None:
            for w in workers:
                if db.execute("UPDATE participants SET status = 'uploaded' WHERE job_id = ? AND round = ?"
                              " AND worker_id = ? AND status = 'published'", (job_id, round_number, w)).rowcount:
                    write_event(db, job_id, "uploaded", round_number=round_number, worker_id=w,
                                message="update accepted by the aggregation service")
            db.execute("UPDATE rounds SET uploaded = ? WHERE job_id = ? AND round = ?", (len(workers), job_id, round_number))

        self._write(f"record the uploads of round {round_number} of job {job_id!r}", write)

    def reset_uploads(self, job_id: str, round_number: int) -> None:
        """The aggregation service lost the round's uploads (it restarted without its spool): wait for them
        again, and for the workers whose task failed meanwhile (most likely on the lost job): they get it again."""
        self._run(f"reset the uploads of round {round_number} of job {job_id!r}",
                  "UPDATE participants SET status = 'published' WHERE job_id = ? AND round = ?"
                  " AND status IN ('uploaded', 'failed')", (job_id, round_number))

    def record_outcome(self, job_id: str, round_number: int, worker_id: str, status: ParticipantStatus, reason: str, *,
                       epsilon: float = 0.0) -> bool:
        """A refusal or failure reported by a worker; False when (job, round, worker) was never asked.
        `epsilon` > 0: the worker trained before it failed (its upload refused), so the ε is spent and kept,
        also for a participant of a cancelled job's abandoned round (it was still training at the cancel)."""
        spent = epsilon if epsilon > 0 else None

        def write(db: sqlite3.Connection) -> bool:
            changed = db.execute(
                "UPDATE participants SET status = ?, reason = ?, epsilon = COALESCE(?, epsilon) WHERE job_id = ?"
                " AND round = ? AND worker_id = ? AND status IN ('published', 'failed', 'missed')",  # a straggler
                (status, reason, spent, job_id, round_number, worker_id)).rowcount > 0  # may explain itself late
            if not changed and spent is not None:
                changed = db.execute(
                    "UPDATE participants SET epsilon = ?, reason = reason || '; ' || ? WHERE job_id = ? AND round = ?"
                    " AND worker_id = ? AND status = 'cancelled' AND epsilon IS NULL",
                    (spent, reason, job_id, round_number, worker_id)).rowcount > 0
            if changed:
                write_event(db, job_id, status, round_number=round_number, worker_id=worker_id, message=reason)
            return changed

        return self._write(f"record the outcome of worker {worker_id!r} in round {round_number} of job {job_id!r}",
                           write)

    def participants(self, job_id: str, round_number: int | None = None) -> list[ParticipantRecord]:
        """A job's participants (of one round), by round, then worker id."""
        if round_number is None:
            rows = self._exec("SELECT * FROM participants WHERE job_id = ? ORDER BY round, worker_id", (job_id,))
        else:
            rows = self._exec("SELECT * FROM participants WHERE job_id = ? AND round = ? ORDER BY worker_id",
                              (job_id, round_number))
        return [_participant_record(r) for r in rows]

    def close_round(self, job_id: str, round_number: int, *, model_version: int, aggregated: Sequence[str],
                    updates: Iterable[tuple[str, int, float, float]], accuracy: float | None, loss: float | None,
                    seconds: float, checkpoint: str, stats: dict[str, float], model_spec_json: str,
                    reasons: Mapping[str, str] | None = None) -> None:
        """Record a closed round and advance the job in one transaction: resume starts after it. `reasons`: why
        an uploaded update was not aggregated or was down-weighted (a robust rule's verdict), by worker."""
        updates = list(updates)
        mean_loss = sum(u[3] for u in updates) / len(updates) if updates else None
        chosen = set(aggregated)
        def write(db: sqlite3.Connection) -> None:
            for worker_id, num_samples, epsilon, train_loss in updates:
                db.execute(
                    "UPDATE participants SET status = ?, epsilon = ?, train_loss = ?, num_samples = ?"
                    " WHERE job_id = ? AND round = ? AND worker_id = ?",
                    ("aggregated" if worker_id in chosen else "uploaded", epsilon, train_loss, num_samples,
                     job_id, round_number, worker_id),
                )
            for worker_id, reason in (reasons or {}).items():
                db.execute("UPDATE participants SET reason = ? WHERE job_id = ? AND round = ? AND worker_id = ?",
                           (reason, job_id, round_number, worker_id))
            db.execute(
                "UPDATE participants SET status = 'missed', reason = 'no upload before the round closed'"
                " WHERE job_id = ? AND round = ? AND status = 'published'", (job_id, round_number),
            )
            db.execute(
                "UPDATE rounds SET status = 'closed', uploaded = ?, aggregated = ?, accuracy = ?, loss = ?,"
                " mean_train_loss = ?, seconds = ?, model_version = ?, checkpoint = ?, stats_json = ?, closed = ?"
                " WHERE job_id = ? AND round = ?",
                (len(updates), len(chosen), accuracy, loss, mean_loss, seconds, model_version, checkpoint,
                 json.dumps(stats), time.time(), job_id, round_number),
            )
            db.execute(
                "UPDATE jobs SET rounds_done = ?, model_spec_json = ?, updated = ? WHERE job_id = ?",
                (round_number, model_spec_json, time.time(), job_id),
            )
            write_event(db, job_id, "round_closed", round_number=round_number,
                        message=f"version {model_version}: {len(chosen)} of {len(updates)} update(s) aggregated"
                           + (f", accuracy {accuracy:.4f}" if accuracy is not None else "")
                           + (f", loss {loss:.4f}" if loss is not None else ""))

        self._write(f"record the close of round {round_number} of job {job_id!r}", write)

    def fail_round(self, job_id: str, round_number: int, seconds: float, *,
                   why: str = "too few uploads to close it") -> None:
        """Record a round that failed (too few uploads, or a secure round that could not be unmasked): no
        version came of it."""
        def write(db: sqlite3.Connection) -> None:
            db.execute("UPDATE rounds SET status = 'failed', seconds = ?, closed = ? WHERE job_id = ? AND round = ?",
                       (seconds, time.time(), job_id, round_number))
            write_event(db, job_id, "round_failed", round_number=round_number, message=why)

        self._write(f"record round {round_number} of job {job_id!r} as failed", write)

    def rounds(self, job_id: str | None = None) -> list[RoundRecord]:
        """A job's rounds (every job's, by job), oldest first."""
        if job_id:
            rows = self._exec("SELECT * FROM rounds WHERE job_id = ? ORDER BY round", (job_id,))
        else:
            rows = self._exec("SELECT * FROM rounds ORDER BY job_id, round")
        return [_round_record(r) for r in rows]

    def last_checkpoint(self, job_id: str) -> RoundRecord | None:
        """The job's last closed round: its version and checkpoint are where the job resumes from."""
        rows = self._exec(
            "SELECT * FROM rounds WHERE job_id = ? AND status = 'closed' ORDER BY round DESC LIMIT 1", (job_id,)
        )
        return _round_record(rows[0]) if rows else None


# ----- rows into records (the only place that reads a row of these tables by column name) -----

def _round_record(r: sqlite3.Row) -> RoundRecord:
    return RoundRecord(job_id=r["job_id"], round=r["round"], status=RoundStatus(r["status"]),
                       participants=r["participants"], uploaded=r["uploaded"], aggregated=r["aggregated"],
                       accuracy=r["accuracy"], loss=r["loss"], mean_train_loss=r["mean_train_loss"],
                       seconds=r["seconds"], model_version=r["model_version"], checkpoint=r["checkpoint"],
                       stats=json.loads(r["stats_json"] or "{}"), started=r["started"], closed=r["closed"],
                       deadline=r["deadline"])


def _participant_record(r: sqlite3.Row) -> ParticipantRecord:
    return ParticipantRecord(job_id=r["job_id"], round=r["round"], worker_id=r["worker_id"],
                             status=ParticipantStatus(r["status"]), reason=r["reason"], epsilon=r["epsilon"],
                             train_loss=r["train_loss"], num_samples=r["num_samples"])
