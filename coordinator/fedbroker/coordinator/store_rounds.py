"""The part of the coordinator's state store (`StateStore`, which mixes it in) that holds a job's rounds and
who takes part in each: a round is recorded (its participants `published`) before the aggregation service hears
of it, each participant's upload, refusal or failure as it comes, and the close (or failure) with the job's
progress in one transaction, so a restarted coordinator resumes from the last closed round's checkpoint.

As in store.py, every write is one transaction and no database row leaves the store: reads return records.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import Row, bindparam, case, func, select, update
from sqlalchemy.engine import Connection

from fedbroker.coordinator.records import ParticipantRecord, RoundRecord
from fedbroker.coordinator.store_notes import StoreAccess, write_event, write_events
from fedbroker.coordinator.store_sql import greatest, replace
from fedbroker.coordinator.tables import jobs, participants, rounds
from fedbroker.job.status import ParticipantStatus, RoundStatus

p, r_ = participants, rounds
# A participant's row still counted on to answer: a worker's report sets its status.
_ANSWERABLE = ("published", "failed", "missed")
# What the aggregation service dropped unaggregated (AbandonRound): (worker id, samples, ε, training loss).
Discarded = Iterable[tuple[str, int, float, float]]


def keep_discarded(conn: Connection, job_id: str, round_number: int, discarded: Discarded, *, why: str) -> None:
    """The uploads the service dropped unaggregated (a failed, abandoned or cancelled round's), each kept on its
    participant's row with the ε its worker spent on it, in the transaction that ends the round: its ε is on
    the record whether or not any later round closes. A row's ε only grows (a report may have put it there)."""
    rows = [dict(w=w, n=n, e=e, l=loss) for w, n, e, loss in discarded]
    if rows:
        conn.execute(update(p).where(p.c.job_id == job_id, p.c.round == round_number, p.c.worker_id == bindparam("w"),
                                     p.c.status != "aggregated")
                     .values(status="discarded", reason=f"uploaded, then discarded unaggregated: {why}",
                             epsilon=greatest(func.coalesce(p.c.epsilon, 0.0), bindparam("e")),
                             train_loss=bindparam("l"), num_samples=bindparam("n")), rows)


class RoundTables(StoreAccess):
    """Mixed into `StateStore`: the `rounds` and `participants` tables (module docstring)."""

    def open_round(self, job_id: str, round_number: int, participants: Sequence[str], *,
                   deadline: float | None = None, started: float | None = None) -> None:
        """Record a round (its participants `published`) before the aggregation service hears of it."""
        def write(conn: Connection) -> None:
            conn.execute(p.delete().where(p.c.job_id == job_id, p.c.round == round_number))
            replace(conn, r_, dict(job_id=job_id, round=round_number, status="open", participants=len(participants),
                                   started=started if started is not None else time.time(), deadline=deadline))
            if participants:
                conn.execute(p.insert(), [dict(job_id=job_id, round=round_number, worker_id=w, status="published")
                                          for w in participants])
            write_event(conn, job_id, "round_opened", round_number=round_number,
                        message=f"{len(participants)} participant(s): {', '.join(participants)}")

        self._write(f"open round {round_number} of job {job_id!r}", write)

    def round(self, job_id: str, round_number: int) -> RoundRecord | None:
        """One round of a job, or None when it was never opened."""
        rows = self._exec(select(r_).where(r_.c.job_id == job_id, r_.c.round == round_number))
        return _round_record(rows[0]) if rows else None

    def set_round_deadline(self, job_id: str, round_number: int, deadline: float) -> None:
        """Move an open round's deadline (a resumed or re-opened round gets a fresh one)."""
        self._run(f"move the deadline of round {round_number} of job {job_id!r}",
                  update(r_).where(r_.c.job_id == job_id, r_.c.round == round_number).values(deadline=deadline))

    def set_uploaded(self, job_id: str, round_number: int, workers: Sequence[str]) -> None:
        """The participants whose update the aggregation service has accepted so far."""
        this_round = (p.c.job_id == job_id, p.c.round == round_number)

        def write(conn: Connection) -> None:  # a few statements however many workers: this runs on every event
            waiting = set(conn.execute(select(p.c.worker_id).where(
                *this_round, p.c.status == "published", p.c.worker_id.in_(list(workers)))).scalars()) if workers else set()
            newly = [w for w in dict.fromkeys(workers) if w in waiting]
            if newly:
                conn.execute(update(p).where(*this_round, p.c.worker_id.in_(newly)).values(status="uploaded"))
                write_events(conn, job_id, "uploaded", round_number=round_number, worker_ids=newly,
                             message="update accepted by the aggregation service")
            conn.execute(update(r_).where(r_.c.job_id == job_id, r_.c.round == round_number)
                         .values(uploaded=len(workers)))

        self._write(f"record the uploads of round {round_number} of job {job_id!r}", write)

    def reset_uploads(self, job_id: str, round_number: int) -> None:
        """The aggregation service lost the round's uploads (it restarted without its spool): wait for them
        again, and for the workers whose task failed meanwhile (most likely on the lost job): they get it again."""
        self._run(f"reset the uploads of round {round_number} of job {job_id!r}",
                  update(p).where(p.c.job_id == job_id, p.c.round == round_number,
                                  p.c.status.in_(["uploaded", "failed"])).values(status="published"))

    def record_outcome(self, job_id: str, round_number: int, worker_id: str, status: ParticipantStatus, reason: str, *,
                       epsilon: float = 0.0) -> bool:
        """A refusal or failure reported by a worker; False when (job, round, worker) was never asked.
        `epsilon` > 0: the worker trained before it failed (its upload refused), so the ε is spent and kept at
        once, whatever the row says and whatever comes next: a row still counted on takes the report's status, a
        row whose part is settled (its upload counted, discarded or aggregated, or its round cancelled or
        abandoned) keeps its status and takes the ε. A row's ε only grows (a job's ε on a site is cumulative),
        so a later, lower report never takes back what an earlier word put on the record."""
        spent = epsilon if epsilon > 0 else None
        this = (p.c.job_id == job_id, p.c.round == round_number, p.c.worker_id == worker_id)

        def write(conn: Connection) -> bool:
            was = conn.execute(select(p.c.status).where(*this)).scalar()
            if was is None:
                return False
            values: dict[str, Any]
            if was in _ANSWERABLE:  # a straggler may explain itself late
                values = dict(status=str(status), reason=reason)
            elif spent is None:
                return False  # its part is settled and the report carries no ε to keep
            else:  # its reason is added once, when the row first takes an ε (a report cannot grow it unbounded)
                values = dict(reason=case((p.c.reason == "", reason), (p.c.epsilon.is_(None), p.c.reason + "; " + reason),
                                          else_=p.c.reason))
            if spent is not None:
                values["epsilon"] = greatest(func.coalesce(p.c.epsilon, 0.0), spent)
            conn.execute(update(p).where(*this).values(**values))
            write_event(conn, job_id, status, round_number=round_number, worker_id=worker_id, message=reason)
            return True

        return self._write(f"record the outcome of worker {worker_id!r} in round {round_number} of job {job_id!r}",
                           write)

    def participants(self, job_id: str, round_number: int | None = None) -> list[ParticipantRecord]:
        """A job's participants (of one round), by round, then worker id."""
        query = select(p).where(p.c.job_id == job_id).order_by(p.c.round, p.c.worker_id)
        if round_number is not None:
            query = query.where(p.c.round == round_number)
        return [_participant_record(r) for r in self._exec(query)]

    def close_round(self, job_id: str, round_number: int, *, model_version: int, aggregated: Sequence[str],
                    updates: Iterable[tuple[str, int, float, float]], accuracy: float | None, loss: float | None,
                    seconds: float, checkpoint: str, stats: dict[str, float], model_spec_json: str,
                    reasons: Mapping[str, str] | None = None) -> None:
        """Record a closed round and advance the job in one transaction: resume starts after it. `reasons`: why
        an uploaded update was not aggregated or was down-weighted (a robust rule's verdict), by worker."""
        updates = list(updates)
        mean_loss = sum(u[3] for u in updates) / len(updates) if updates else None
        chosen = set(aggregated)
        this_round = (p.c.job_id == job_id, p.c.round == round_number)

        one = (*this_round, p.c.worker_id == bindparam("w"))  # one statement, executed for many rows

        def write(conn: Connection) -> None:
            if updates:
                conn.execute(update(p).where(*one).values(status=bindparam("s"),
                                                          epsilon=greatest(func.coalesce(p.c.epsilon, 0.0), bindparam("e")),
                                                          train_loss=bindparam("l"), num_samples=bindparam("n")),
                             [dict(w=w, s="aggregated" if w in chosen else "uploaded", e=e, l=loss_, n=n)
                              for w, n, e, loss_ in updates])
            if reasons:
                conn.execute(update(p).where(*one).values(reason=bindparam("r")),
                             [dict(w=w, r=r) for w, r in reasons.items()])
            conn.execute(update(p).where(*this_round, p.c.status == "published")
                         .values(status="missed", reason="no upload before the round closed"))
            conn.execute(update(r_).where(r_.c.job_id == job_id, r_.c.round == round_number).values(
                status="closed", uploaded=len(updates), aggregated=len(chosen), accuracy=accuracy, loss=loss,
                mean_train_loss=mean_loss, seconds=seconds, model_version=model_version, checkpoint=checkpoint,
                stats_json=json.dumps(stats), closed=time.time()))
            conn.execute(update(jobs).where(jobs.c.job_id == job_id).values(
                rounds_done=round_number, model_spec_json=model_spec_json, updated=time.time()))
            write_event(conn, job_id, "round_closed", round_number=round_number,
                        message=f"version {model_version}: {len(chosen)} of {len(updates)} update(s) aggregated"
                           + (f", accuracy {accuracy:.4f}" if accuracy is not None else "")
                           + (f", loss {loss:.4f}" if loss is not None else ""))

        self._write(f"record the close of round {round_number} of job {job_id!r}", write)

    def fail_round(self, job_id: str, round_number: int, seconds: float, *,
                   why: str = "too few uploads to close it", discarded: Discarded = ()) -> None:
        """Record a round that failed (too few uploads, or a secure round that could not be unmasked): no
        version came of it; the uploads the service dropped keep their ε (`keep_discarded`)."""
        def write(conn: Connection) -> None:
            keep_discarded(conn, job_id, round_number, discarded, why=f"round {round_number} failed")
            conn.execute(update(r_).where(r_.c.job_id == job_id, r_.c.round == round_number)
                         .values(status="failed", seconds=seconds, closed=time.time()))
            write_event(conn, job_id, "round_failed", round_number=round_number, message=why)

        self._write(f"record round {round_number} of job {job_id!r} as failed", write)

    def abandon_round(self, job_id: str, round_number: int, seconds: float, *, why: str,
                      discarded: Discarded = ()) -> None:
        """Record a round given up for another (a secure round the aggregation service lost: secure_reopen.py):
        no version came of it; the uploads the service still dropped keep their ε (`keep_discarded`); its
        participants still counted on are marked failed with `why`, keeping the ε their rows hold. A worker's
        report of what it trained lands on its row before or after this (`record_outcome`)."""
        def write(conn: Connection) -> None:
            keep_discarded(conn, job_id, round_number, discarded, why=f"round {round_number} was abandoned")
            conn.execute(update(p).where(p.c.job_id == job_id, p.c.round == round_number,
                                         p.c.status.in_(["published", "uploaded"])).values(status="failed", reason=why))
            conn.execute(update(r_).where(r_.c.job_id == job_id, r_.c.round == round_number)
                         .values(status="abandoned", seconds=seconds, closed=time.time()))
            write_event(conn, job_id, "round_abandoned", round_number=round_number, message=why)

        self._write(f"record round {round_number} of job {job_id!r} as abandoned", write)

    def rounds(self, job_id: str | None = None) -> list[RoundRecord]:
        """A job's rounds (every job's, by job), oldest first."""
        query = select(r_).order_by(r_.c.job_id, r_.c.round)
        if job_id:
            query = query.where(r_.c.job_id == job_id)
        return [_round_record(r) for r in self._exec(query)]

    def last_checkpoint(self, job_id: str) -> RoundRecord | None:
        """The job's last closed round: its version and checkpoint are where the job resumes from."""
        rows = self._exec(select(r_).where(r_.c.job_id == job_id, r_.c.status == "closed")
                          .order_by(r_.c.round.desc()).limit(1))
        return _round_record(rows[0]) if rows else None


# ----- rows into records (the only place that reads a row of these tables by column name) -----

def _round_record(row: Row[Any]) -> RoundRecord:
    r = row._mapping
    return RoundRecord(job_id=r["job_id"], round=r["round"], status=RoundStatus(r["status"]),
                       participants=r["participants"], uploaded=r["uploaded"], aggregated=r["aggregated"],
                       accuracy=r["accuracy"], loss=r["loss"], mean_train_loss=r["mean_train_loss"],
                       seconds=r["seconds"], model_version=r["model_version"], checkpoint=r["checkpoint"],
                       stats=json.loads(r["stats_json"] or "{}"), started=r["started"], closed=r["closed"],
                       deadline=r["deadline"])


def _participant_record(row: Row[Any]) -> ParticipantRecord:
    r = row._mapping
    return ParticipantRecord(job_id=r["job_id"], round=r["round"], worker_id=r["worker_id"],
                             status=ParticipantStatus(r["status"]), reason=r["reason"], epsilon=r["epsilon"],
                             train_loss=r["train_loss"], num_samples=r["num_samples"])
