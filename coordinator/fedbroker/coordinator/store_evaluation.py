"""The part of the coordinator's state store (`StateStore` mixes it in) that keeps federated evaluation: which
sites were asked to score which round's global version and until when, and what each reported.

A report is recorded only against a row written when its task was published: an evaluation for a job, round,
worker or version nobody asked for, or one after its deadline, changes nothing (`EvaluationVerdict`). A round
is settled once every site asked has answered or its deadline passed (those left are `missed`); its federated
score (the count-weighted mean, `fedbroker.federated_evaluation.combine`) is then final, and one
`federated_score` event says so. As in store.py, every write is one transaction and no SQLite row leaves the store.
"""

from __future__ import annotations

import enum
import json
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from fedbroker.coordinator.store_notes import StoreAccess, write_event
from fedbroker.errors import ConfigError
from fedbroker.federated_evaluation import Combined, SiteScore, combine
from fedbroker.job.status import EvaluationStatus
from fedbroker.job.task import TaskConfig, parse_task
from fedbroker.tasks.scores import THRESHOLD, headline

SCHEMA = """
CREATE TABLE IF NOT EXISTS evaluation_rounds (
    job_id TEXT NOT NULL, round INTEGER NOT NULL, model_version INTEGER NOT NULL, published REAL NOT NULL,
    deadline REAL NOT NULL, settled INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (job_id, round)
);
CREATE TABLE IF NOT EXISTS evaluations (
    job_id TEXT NOT NULL, round INTEGER NOT NULL, worker_id TEXT NOT NULL, status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '', loss REAL, accuracy REAL, num_samples INTEGER, model_version INTEGER NOT NULL,
    time REAL, PRIMARY KEY (job_id, round, worker_id)
);
"""
# Added with tasks: a round's task (JSON, fedbroker.job.task) and each site's sums (JSON, fedbroker.tasks.scores).
_COLUMNS = (("evaluation_rounds", "task", "TEXT NOT NULL DEFAULT ''"), ("evaluations", "sums", "TEXT"))
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


def create_evaluation_tables(db: sqlite3.Connection) -> None:
    """In the store's opening transaction (its migration): a state file written before them gets them then."""
    for statement in SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)
    for table, column, kind in _COLUMNS:  # a state file from before tasks gets them
        if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")


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

        def write(db: sqlite3.Connection) -> None:
            db.execute("INSERT OR IGNORE INTO evaluation_rounds (job_id, round, model_version, published, deadline, task)"
                       " VALUES (?, ?, ?, ?, ?, ?)", (job_id, round_number, model_version, now, deadline,
                                                      json.dumps(stored, sort_keys=True)))
            db.executemany("INSERT OR IGNORE INTO evaluations (job_id, round, worker_id, status, model_version)"
                           " VALUES (?, ?, ?, 'asked', ?)", [(job_id, round_number, w, model_version) for w in workers])
            write_event(db, job_id, "evaluation_asked", round_number=round_number,
                        message=f"version {model_version} to {len(workers)} site(s): {', '.join(workers)}")

        self._write(f"record the evaluation tasks of round {round_number} of job {job_id!r}", write)

    def evaluation_undelivered(self, job_id: str, round_number: int, workers: Sequence[str]) -> None:
        """Sites whose task could not be published: missed at once (nothing will come from them)."""
        if not workers:
            return
        self._write(f"record undelivered evaluation tasks of job {job_id!r}", lambda db: db.executemany(
            "UPDATE evaluations SET status = 'missed', reason = 'its evaluation task could not be published', time = ?"
            " WHERE job_id = ? AND round = ? AND worker_id = ? AND status = 'asked'",
            [(time.time(), job_id, round_number, w) for w in workers]))

    def record_evaluation(self, job_id: str, round_number: int, worker_id: str, *, model_version: int,
                          refused: bool, reason: str, accuracy: float, loss: float, num_samples: int,
                          sums: Mapping[str, float] | None = None) -> EvaluationVerdict:
        """A site's report, if it answers a task this coordinator published and is in time; settles the round
        when it was the last one outstanding. `sums`: the task's sums (fedbroker.tasks.scores), checked."""
        status = EvaluationStatus.REFUSED if refused else EvaluationStatus.EVALUATED
        sums_json = json.dumps(dict(sums), sort_keys=True) if sums and not refused else None
        score = (None, None, None, None) if refused else (loss, accuracy, num_samples, sums_json)

        def write(db: sqlite3.Connection) -> EvaluationVerdict:
            now = time.time()
            row = db.execute("SELECT e.status, e.reason, e.loss, e.accuracy, e.num_samples, e.sums, r.model_version,"
                             " r.deadline"
                             " FROM evaluations e JOIN evaluation_rounds r USING (job_id, round) WHERE e.job_id = ? AND"
                             " e.round = ? AND e.worker_id = ?", (job_id, round_number, worker_id)).fetchone()
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
            db.execute("UPDATE evaluations SET status = ?, reason = ?, loss = ?, accuracy = ?, num_samples = ?, sums = ?,"
                       " time = ?"
                       " WHERE job_id = ? AND round = ? AND worker_id = ?",
                       (status, reason, *score, now, job_id, round_number, worker_id))
            write_event(db, job_id, "evaluated" if not refused else "evaluation_refused", round_number=round_number,
                        worker_id=worker_id, message=reason if refused else
                        f"version {model_version}: {_metric(db, job_id, round_number)} {accuracy:.4f}, loss {loss:.4f} on "
                        f"{num_samples} held-out samples")
            _settle(db, job_id, round_number, now)
            return EvaluationVerdict.RECORDED

        return self._write(f"record the evaluation of worker {worker_id!r} in round {round_number} of job {job_id!r}",
                           write)

    def settle_evaluations(self, job_id: str) -> list[int]:
        """Settle the job's rounds whose deadline has passed (their outstanding sites `missed`); those settled now."""
        if not self._exec("SELECT 1 FROM evaluation_rounds WHERE job_id = ? AND settled = 0 AND deadline < ? LIMIT 1",
                          (job_id, time.time())):
            return []  # the common case, read without taking the write lock

        def write(db: sqlite3.Connection) -> list[int]:
            now = time.time()
            rounds = [int(r) for (r,) in db.execute(
                "SELECT round FROM evaluation_rounds WHERE job_id = ? AND settled = 0 AND deadline < ? ORDER BY round",
                (job_id, now)).fetchall()]
            return [r for r in rounds if _settle(db, job_id, r, now)]

        return self._write(f"settle the evaluations of job {job_id!r}", write)

    def evaluations(self, job_id: str, round_number: int | None = None) -> list[EvaluationRecord]:
        """Every site's evaluation of the job's rounds (of one round), by round, then worker id; a site still
        `asked` after the deadline reads as `missed`."""
        rows = self._exec("SELECT e.*, r.deadline FROM evaluations e JOIN evaluation_rounds r USING (job_id, round)"
                          " WHERE e.job_id = ? AND (? IS NULL OR e.round = ?) ORDER BY e.round, e.worker_id",
                          (job_id, round_number, round_number))
        now = time.time()
        return [_evaluation_record(r, now=now) for r in rows]

    def evaluation_rounds(self, job_id: str, round_number: int | None = None) -> list[EvaluationRound]:
        """The job's evaluated rounds (or one), oldest first, each with its federated score so far."""
        rounds = self._exec("SELECT * FROM evaluation_rounds WHERE job_id = ? AND (? IS NULL OR round = ?)"
                            " ORDER BY round", (job_id, round_number, round_number))
        by_round: dict[int, list[EvaluationRecord]] = {}
        for e in self.evaluations(job_id, round_number):
            by_round.setdefault(e.round, []).append(e)
        return [_evaluation_round(r, by_round) for r in rounds]


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


def _metric(db: sqlite3.Connection, job_id: str, round_number: int) -> str:
    row = db.execute("SELECT task FROM evaluation_rounds WHERE job_id = ? AND round = ?", (job_id, round_number)).fetchone()
    text = row[0] if row else None
    return headline(_task(text), _choice(text)[0])[0]


def _settle(db: sqlite3.Connection, job_id: str, round_number: int, now: float) -> bool:
    """Settle one round if every site answered or its deadline passed: the rest `missed`, one `federated_score`
    event with the final score. Whether it settled now."""
    head = db.execute("SELECT deadline, settled FROM evaluation_rounds WHERE job_id = ? AND round = ?",
                      (job_id, round_number)).fetchone()
    if head is None:
        return False
    deadline, settled = head
    (waiting,) = db.execute("SELECT COUNT(*) FROM evaluations WHERE job_id = ? AND round = ? AND status = 'asked'",
                            (job_id, round_number)).fetchone()
    if settled or (waiting and now <= deadline):
        return False
    db.execute("UPDATE evaluations SET status = 'missed', reason = 'no report before the deadline', time = ?"
               " WHERE job_id = ? AND round = ? AND status = 'asked'", (now, job_id, round_number))
    db.execute("UPDATE evaluation_rounds SET settled = 1 WHERE job_id = ? AND round = ?", (job_id, round_number))
    rows = db.execute("SELECT status, accuracy, loss, num_samples, sums FROM evaluations WHERE job_id = ? AND round = ?",
                      (job_id, round_number)).fetchall()
    (task_text,) = db.execute("SELECT task FROM evaluation_rounds WHERE job_id = ? AND round = ?",
                              (job_id, round_number)).fetchone()
    score = _combine((SiteScore(accuracy=accuracy, loss=loss, num_samples=num_samples, sums=json.loads(sums or "{}"))
                      for status, accuracy, loss, num_samples, sums in rows if status == EvaluationStatus.EVALUATED),
                     task_text)
    write_event(db, job_id, "federated_score", round_number=round_number, message=(
        f"{score.metric} {score.accuracy:.4f}, loss {score.loss:.4f} on {score.num_samples} held-out samples of "
        f"{score.sites} of {len(rows)} site(s)" if score is not None else f"no score: none of {len(rows)} site(s) "
                                                                         f"evaluated"))
    return True


# ----- rows into records (the only place that reads a row of these tables by column name) -----

def _evaluation_record(r: sqlite3.Row, *, now: float) -> EvaluationRecord:
    """A site's evaluation; one still `asked` after its round's deadline (`r["deadline"]`) reads as `missed`."""
    status = EvaluationStatus(r["status"])
    overdue = status == EvaluationStatus.ASKED and now > r["deadline"]
    return EvaluationRecord(
        job_id=r["job_id"], round=r["round"], worker_id=r["worker_id"],
        status=EvaluationStatus.MISSED if overdue else status,
        reason="no report before the deadline" if overdue else r["reason"], loss=r["loss"],
        accuracy=r["accuracy"], num_samples=r["num_samples"], model_version=r["model_version"], time=r["time"],
        sums=json.loads(r["sums"]) if r["sums"] else None)


def _evaluation_round(r: sqlite3.Row, by_round: Mapping[int, Sequence[EvaluationRecord]]) -> EvaluationRound:
    """An evaluated round with its sites' evaluations (`by_round`) and the federated score so far."""
    sites = by_round.get(r["round"], [])
    return EvaluationRound(
        job_id=r["job_id"], round=r["round"], model_version=r["model_version"], published=r["published"],
        deadline=r["deadline"], settled=bool(r["settled"]), asked=len(sites),
        answered=sum(e.status in (EvaluationStatus.EVALUATED, EvaluationStatus.REFUSED) for e in sites),
        score=_combine(_scores(sites), r["task"]))
