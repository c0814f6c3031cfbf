"""The part of the coordinator's state store (`StateStore` mixes it in) that keeps federated evaluation: which
sites were asked to score which round's global version and until when, and what each reported.

A report is recorded only against a row written when its task was published: an evaluation for a job, round,
worker or version nobody asked for, or one after its deadline, changes nothing (`EvaluationVerdict`). A round
is settled once every site asked has answered or its deadline passed (those left are `missed`); its federated
score (the count-weighted mean, `fedbroker.federated_evaluation.combine`) is then final, and one
`federated_score` event says so. As in store.py, every write is one transaction and no database row leaves the
store.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Join, Row, Select, func, select, update
from sqlalchemy.engine import Connection

from fedbroker.coordinator import tables
from fedbroker.coordinator.store_notes import StoreAccess, write_event
from fedbroker.coordinator.store_sql import upsert
from fedbroker.errors import ConfigError
from fedbroker.federated_evaluation import Combined, SiteScore, combine
from fedbroker.job.status import EvaluationStatus
from fedbroker.job.task import TaskConfig, parse_task
from fedbroker.tasks.scores import THRESHOLD, headline

_CHOICE = "evaluation"   # the key, in a round's stored task, of the job's evaluation.score and .threshold


class EvaluationVerdict(enum.StrEnum):
    """What became of a report: recorded, a copy of one recorded (idempotent), or refused and why."""

    RECORDED = "recorded"
    DUPLICATE = "duplicate"
    NOT_ASKED = "not_asked"            # no such job, round or worker among those sent the task
    WRONG_VERSION = "wrong_version"    # the round was asked about another global version
    LATE = "late"                      # after the round's evaluation deadline
    CONFLICT = "conflict"              # a second report for the same task that differs from the first


@dataclass(frozen=True, kw_only=True)
class EvaluationRecord:
    """One site's evaluation of one round: its status, and its score once it reported one."""

    job_id: str
    round: int
    worker_id: str
    status: EvaluationStatus
    reason: str
    loss: float | None
    accuracy: float | None
    num_samples: int | None
    model_version: int
    time: float | None
    sums: Mapping[str, float] | None = None


@dataclass(frozen=True, kw_only=True)
class EvaluationRound:
    """A round whose global version the sites were asked to score: when, until when, and how it stands."""

    job_id: str
    round: int
    model_version: int
    published: float
    deadline: float
    settled: bool
    asked: int
    answered: int
    score: Combined | None


class EvaluationTables(StoreAccess):
    """Mixed into `StateStore`: its transactions (`_write`) and reads (`_exec`) over two more tables."""

    def ask_evaluation(self, job_id: str, round_number: int, *, model_version: int, workers: Sequence[str],
                       deadline: float, task: TaskConfig | None = None, score: str = "",
                       threshold: float = THRESHOLD) -> None:
        """The sites sent the round's evaluation task (before it is published, so no report can come first). A
        round asked again (a coordinator that died while publishing) keeps what was reported. `score`,
        `threshold`: the job's `evaluation.score` and `evaluation.threshold`, kept with the round's task."""
        now = time.time()
        stored = {**(task or TaskConfig()).to_dict(), _CHOICE: {"score": score, "threshold": threshold}}

        def write(conn: Connection) -> None:
            upsert(conn, tables.evaluation_rounds, {
                "job_id": job_id, "round": round_number, "model_version": model_version, "published": now,
                "deadline": deadline, "task": json.dumps(stored, sort_keys=True)}, keys=("job_id", "round"))
            upsert(conn, tables.evaluations, [
                {"job_id": job_id, "round": round_number, "worker_id": w, "status": EvaluationStatus.ASKED.value,
                 "model_version": model_version} for w in workers], keys=("job_id", "round", "worker_id"))
            write_event(conn, job_id, "evaluation_asked", round_number=round_number,
                        message=f"version {model_version} to {len(workers)} site(s): {', '.join(workers)}")

        self._write(f"record the evaluation tasks of round {round_number} of job {job_id!r}", write)

    def evaluation_undelivered(self, job_id: str, round_number: int, workers: Sequence[str]) -> None:
        """Sites whose task could not be published: missed at once (nothing will come from them)."""
        if not workers:
            return
        e = tables.evaluations
        self._run(f"record undelivered evaluation tasks of job {job_id!r}", update(e).where(
            e.c.job_id == job_id, e.c.round == round_number, e.c.worker_id.in_(list(workers)),
            e.c.status == EvaluationStatus.ASKED.value).values(
            status=EvaluationStatus.MISSED.value, reason="its evaluation task could not be published", time=time.time()))

    def record_evaluation(self, job_id: str, round_number: int, worker_id: str, *, model_version: int,
                          refused: bool, reason: str, accuracy: float, loss: float, num_samples: int,
                          sums: Mapping[str, float] | None = None) -> EvaluationVerdict:
        """A site's report, if it answers a task this coordinator published and is in time; settles the round
        when it was the last one outstanding. `sums`: the task's sums (fedbroker.tasks.scores), checked."""
        status = EvaluationStatus.REFUSED if refused else EvaluationStatus.EVALUATED
        sums_json = json.dumps(dict(sums), sort_keys=True) if sums and not refused else None
        score = (None, None, None, None) if refused else (loss, accuracy, num_samples, sums_json)
        e, r = tables.evaluations, tables.evaluation_rounds

        def write(conn: Connection) -> EvaluationVerdict:
            now = time.time()
            row = conn.execute(select(e.c.status, e.c.reason, e.c.loss, e.c.accuracy, e.c.num_samples, e.c.sums,
                                      r.c.model_version, r.c.deadline).select_from(_asked_in_round())
                               .where(e.c.job_id == job_id, e.c.round == round_number, e.c.worker_id == worker_id)
                               ).first()
            if row is None:
                return EvaluationVerdict.NOT_ASKED
            was, reason_was, *score_was, version, deadline = row
            if version != model_version:
                return EvaluationVerdict.WRONG_VERSION
            if was == EvaluationStatus.MISSED:
                return EvaluationVerdict.LATE
            if was != EvaluationStatus.ASKED:
                same = (was, *score_was) == (status, *score) and (not refused or reason_was == reason)
                return EvaluationVerdict.DUPLICATE if same else EvaluationVerdict.CONFLICT
            if now > deadline:
                return EvaluationVerdict.LATE
            loss_, accuracy_, samples_, sums_ = score
            conn.execute(update(e).where(e.c.job_id == job_id, e.c.round == round_number, e.c.worker_id == worker_id)
                         .values(status=status.value, reason=reason, loss=loss_, accuracy=accuracy_,
                                 num_samples=samples_, sums=sums_, time=now))
            write_event(conn, job_id, "evaluated" if not refused else "evaluation_refused", round_number=round_number,
                        worker_id=worker_id, message=reason if refused else
                        f"version {model_version}: {_metric(conn, job_id, round_number)} {accuracy:.4f}, loss "
                        f"{loss:.4f} on {num_samples} held-out samples")
            _settle(conn, job_id, round_number, now)
            return EvaluationVerdict.RECORDED

        return self._write(f"record the evaluation of worker {worker_id!r} in round {round_number} of job {job_id!r}",
                           write)

    def settle_evaluations(self, job_id: str) -> list[int]:
        """Settle the job's rounds whose deadline has passed (their outstanding sites `missed`); those settled now."""
        r = tables.evaluation_rounds

        def due(now: float) -> Select[int]:
            return select(r.c.round).where(r.c.job_id == job_id, r.c.settled == 0, r.c.deadline < now)

        if not self._exec(due(time.time()).limit(1)):
            return []  # the common case, read without taking the write lock

        def write(conn: Connection) -> list[int]:
            now = time.time()
            rounds = [int(n) for n in conn.execute(due(now).order_by(r.c.round)).scalars()]
            return [n for n in rounds if _settle(conn, job_id, n, now)]

        return self._write(f"settle the evaluations of job {job_id!r}", write)

    def evaluations(self, job_id: str, round_number: int | None = None) -> list[EvaluationRecord]:
        """Every site's evaluation of the job's rounds (of one round), by round, then worker id; a site still
        `asked` after the deadline reads as `missed`."""
        e = tables.evaluations
        query = (select(e, tables.evaluation_rounds.c.deadline).select_from(_asked_in_round())
                 .where(e.c.job_id == job_id).order_by(e.c.round, e.c.worker_id))
        if round_number is not None:
            query = query.where(e.c.round == round_number)
        rows = self._exec(query)
        now = time.time()
        return [_evaluation_record(r, now=now) for r in rows]

    def evaluation_rounds(self, job_id: str, round_number: int | None = None) -> list[EvaluationRound]:
        """The job's evaluated rounds (or one), oldest first, each with its federated score so far."""
        r = tables.evaluation_rounds
        query = select(r).where(r.c.job_id == job_id).order_by(r.c.round)
        if round_number is not None:
            query = query.where(r.c.round == round_number)
        rounds = self._exec(query)
        by_round: dict[int, list[EvaluationRecord]] = {}
        for e in self.evaluations(job_id, round_number):
            by_round.setdefault(e.round, []).append(e)
        return [_evaluation_round(row, by_round) for row in rounds]


def _asked_in_round() -> Join:
    """Each site's evaluation beside its round (the version asked about, the deadline)."""
    e, r = tables.evaluations, tables.evaluation_rounds
    return e.join(r, (e.c.job_id == r.c.job_id) & (e.c.round == r.c.round))


def _scores(rows: Sequence[EvaluationRecord]) -> list[SiteScore]:
    return [SiteScore(accuracy=e.accuracy, loss=e.loss, num_samples=e.num_samples, sums=e.sums or {}) for e in rows
            if e.status == EvaluationStatus.EVALUATED and e.accuracy is not None and e.loss is not None
            and e.num_samples]


def _task(text: str | None) -> TaskConfig:
    """A round's task as stored (none: a round asked before tasks, classification)."""
    if not text:
        return TaskConfig()
    raw = json.loads(text)
    errors: list[ConfigError] = []
    task = parse_task({k: v for k, v in raw.items() if k != _CHOICE} if isinstance(raw, dict) else raw, errors)
    return task if not errors else TaskConfig()


def _choice(text: str | None) -> tuple[str, float]:
    """(evaluation.score, evaluation.threshold) kept with a round's task (a round from before them: the defaults)."""
    raw = json.loads(text) if text else {}
    choice = raw.get(_CHOICE, {}) if isinstance(raw, dict) else {}
    score, threshold = choice.get("score", ""), choice.get("threshold", THRESHOLD)
    return (score if isinstance(score, str) else "",
            float(threshold) if isinstance(threshold, (int, float)) and 0 < threshold < 1 else THRESHOLD)


def _combine(sites: Iterable[SiteScore], text: str | None) -> Combined | None:
    """The round's federated score by its stored task and the job's choice of headline and threshold."""
    score, threshold = _choice(text)
    return combine(sites, _task(text), score=score, threshold=threshold)


def _metric(conn: Connection, job_id: str, round_number: int) -> str:
    text = conn.execute(_round_task(job_id, round_number)).scalar()
    return headline(_task(text), _choice(text)[0])[0]


def _round_task(job_id: str, round_number: int) -> Select[str]:
    r = tables.evaluation_rounds
    return select(r.c.task).where(r.c.job_id == job_id, r.c.round == round_number)


def _settle(conn: Connection, job_id: str, round_number: int, now: float) -> bool:
    """Settle one round if every site answered or its deadline passed: the rest `missed`, one `federated_score`
    event with the final score. Whether it settled now."""
    e, r = tables.evaluations, tables.evaluation_rounds
    in_round = (e.c.job_id == job_id) & (e.c.round == round_number)
    this_round = (r.c.job_id == job_id) & (r.c.round == round_number)
    head = conn.execute(select(r.c.deadline, r.c.settled).where(this_round)).first()
    if head is None:
        return False
    deadline, settled = head
    waiting = conn.execute(select(func.count()).select_from(e).where(
        in_round, e.c.status == EvaluationStatus.ASKED.value)).scalar_one()
    if settled or (waiting and now <= deadline):
        return False
    conn.execute(update(e).where(in_round, e.c.status == EvaluationStatus.ASKED.value).values(
        status=EvaluationStatus.MISSED.value, reason="no report before the deadline", time=now))
    conn.execute(update(r).where(this_round).values(settled=1))
    rows = conn.execute(select(e.c.status, e.c.accuracy, e.c.loss, e.c.num_samples, e.c.sums).where(in_round)
                        .order_by(e.c.worker_id)).all()
    task_text = conn.execute(_round_task(job_id, round_number)).scalar_one()
    score = _combine((SiteScore(accuracy=accuracy, loss=loss, num_samples=num_samples, sums=json.loads(sums or "{}"))
                      for status, accuracy, loss, num_samples, sums in rows if status == EvaluationStatus.EVALUATED),
                     task_text)
    write_event(conn, job_id, "federated_score", round_number=round_number, message=(
        f"{score.metric} {score.accuracy:.4f}, loss {score.loss:.4f} on {score.num_samples} held-out samples of "
        f"{score.sites} of {len(rows)} site(s)" if score is not None else f"no score: none of {len(rows)} site(s) "
                                                                         f"evaluated"))
    return True


# ----- rows into records (the only place that reads a row of these tables by column name) -----

def _evaluation_record(r: Row[Any], *, now: float) -> EvaluationRecord:
    """A site's evaluation; one still `asked` after its round's deadline (`deadline`) reads as `missed`."""
    m = r._mapping
    status = EvaluationStatus(m["status"])
    overdue = status == EvaluationStatus.ASKED and now > m["deadline"]
    return EvaluationRecord(
        job_id=m["job_id"], round=m["round"], worker_id=m["worker_id"],
        status=EvaluationStatus.MISSED if overdue else status,
        reason="no report before the deadline" if overdue else m["reason"], loss=m["loss"],
        accuracy=m["accuracy"], num_samples=m["num_samples"], model_version=m["model_version"], time=m["time"],
        sums=json.loads(m["sums"]) if m["sums"] else None)


def _evaluation_round(r: Row[Any], by_round: Mapping[int, Sequence[EvaluationRecord]]) -> EvaluationRound:
    """An evaluated round with its sites' evaluations (`by_round`) and the federated score so far."""
    m = r._mapping
    sites = by_round.get(m["round"], [])
    return EvaluationRound(
        job_id=m["job_id"], round=m["round"], model_version=m["model_version"], published=m["published"],
        deadline=m["deadline"], settled=bool(m["settled"]), asked=len(sites),
        answered=sum(e.status in (EvaluationStatus.EVALUATED, EvaluationStatus.REFUSED) for e in sites),
        score=_combine(_scores(sites), m["task"]))
