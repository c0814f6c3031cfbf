"""The part of the coordinator's state store (`StateStore` mixes it in) that keeps what sites shared with a job
before its round 1 (coordinator/sharing.py): the job's share phase (what it asked for, until when, the model
it agreed on) and each site's answer, with the ε the site stated and the ε it newly cost the site.

A release the site sent before (the label histogram is drawn once per data set and re-sent to every job that
asks) costs it nothing new, so it is charged once: to the first job it reached. None of this raises the ε
recorded for a worker (store.recorded_epsilon: the ε of the training tasks the coordinator priced), so the
coordinator's record never runs ahead of the ledger, whatever a reply states.

As in store.py, every write is one transaction and no database row leaves the store: reads return the records
below.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, delete, insert, select, update
from sqlalchemy.engine import Connection

from fedbroker.coordinator import tables
from fedbroker.coordinator.store_notes import StoreAccess, write_event
from fedbroker.coordinator.store_sql import replace


class ShareStatus(enum.StrEnum):
    """A site's part in a job's share phase: `asked` until it answers (`shared`, `refused`, `excluded`: what it
    sent cannot be true, its reason says why) or the phase ends without its answer (`silent`); `not_asked`: the
    job could not select it then (its reason says why), or it registered after the phase."""

    ASKED = "asked"
    SHARED = "shared"
    REFUSED = "refused"
    EXCLUDED = "excluded"
    SILENT = "silent"
    NOT_ASKED = "not_asked"


@dataclass(frozen=True)
class SharePhaseRecord:
    """What a job asked its sites for before round 1, until when, and (once `done`) the model it agreed on
    ("" when it standardises nothing: the job's own model)."""

    job_id: str
    open: bool
    histogram: bool
    statistics: bool
    lower: tuple[float, ...]
    upper: tuple[float, ...]
    features: int              # the values a site's sums must hold (the model's flattened input)
    classes: int               # the most counts a histogram may hold (the model's outputs)
    started: float
    deadline: float
    finished: float | None
    model_spec_json: str


@dataclass(frozen=True)
class ShareRecord:
    """One site's answer to a job's share request. `*_epsilon`: the ε the site stated for each release (0:
    exact); `charged_epsilon`: what the answer newly cost the site (a release it had sent before: 0)."""

    job_id: str
    worker_id: str
    status: ShareStatus
    reason: str
    time: float | None
    histogram: tuple[int, ...]
    histogram_noised: bool
    histogram_epsilon: float
    feature_sum: tuple[float, ...]
    feature_sq_sum: tuple[float, ...]
    count: int
    statistics_noised: bool
    statistics_epsilon: float
    statistics_delta: float
    charged_epsilon: float

    @property
    def shared(self) -> list[str]:
        """What the site released to the job: histogram, statistics."""
        return [what for what, sent in (("histogram", bool(self.histogram)), ("statistics", self.count > 0)) if sent]


@dataclass(frozen=True)
class ShareAnswer:
    """A reply as it is recorded (checked before: coordinator/sharing.py)."""

    refused: bool
    reason: str
    histogram: Sequence[int]
    histogram_noised: bool
    histogram_epsilon: float
    feature_sum: Sequence[float]
    feature_sq_sum: Sequence[float]
    count: int
    statistics_noised: bool
    statistics_epsilon: float
    statistics_delta: float


class ShareTables(StoreAccess):
    """Mixed into `StateStore`: its transactions (`_write`) and reads (`_exec`) over the two share tables."""



    def open_share_phase(self, job_id: str, *, histogram: bool, statistics: bool, lower: Sequence[float],
                         upper: Sequence[float], features: int, classes: int, deadline: float,
                         asked: Sequence[str], not_asked: Mapping[str, str]) -> None:
        """Record the job's requests before they go out: a reply is accepted only from a site asked here."""
        now = time.time()
        wants = " and ".join(w for w, on in (("label histogram", histogram), ("feature statistics", statistics)) if on)
        phases, shares = tables.share_phases, tables.shares

        def write(conn: Connection) -> None:
            replace(conn, phases, {  # a phase asked again (a coordinator that died while asking) starts afresh
                "job_id": job_id, "status": "open", "histogram": int(histogram), "statistics": int(statistics),
                "lower_json": json.dumps(list(lower)), "upper_json": json.dumps(list(upper)), "features": features,
                "classes": classes, "started": now, "deadline": deadline})
            conn.execute(delete(shares).where(shares.c.job_id == job_id))
            rows = [{"job_id": job_id, "worker_id": w, "status": ShareStatus.ASKED.value, "reason": ""} for w in asked]
            rows += [{"job_id": job_id, "worker_id": w, "status": ShareStatus.NOT_ASKED.value, "reason": why}
                     for w, why in not_asked.items()]
            if rows:
                conn.execute(insert(shares), rows)
            write_event(conn, job_id, "share_requested", message=f"{wants} asked of {len(asked)} site(s)"
                        + (f": {', '.join(asked)}" if asked else "") + f", within {max(0.0, deadline - now):.0f}s")
            for worker_id, why in not_asked.items():
                write_event(conn, job_id, "not_shared", worker_id=worker_id, message=f"not asked ({why}): not selected")

        self._write(f"record the share requests of job {job_id!r}", write)

    def share_phase(self, job_id: str) -> SharePhaseRecord | None:
        """The job's share phase (None: it has none)."""
        rows = self._exec(select(tables.share_phases).where(tables.share_phases.c.job_id == job_id))
        return _phase_record(rows[0]) if rows else None

    def move_share_deadline(self, job_id: str, deadline: float) -> None:
        """A resumed phase whose deadline passed while the coordinator was down gets a new one."""
        phases = tables.share_phases
        self._run(f"move the share deadline of job {job_id!r}", update(phases).where(
            phases.c.job_id == job_id, phases.c.status == "open").values(deadline=deadline))

    def record_share(self, job_id: str, worker_id: str, answer: ShareAnswer,
                     check: Callable[[SharePhaseRecord], list[str]], *, excluded: Sequence[str] = ()) -> list[str]:
        """Record a site's reply, or say why not (nothing changes then): the job must be running its share
        phase, the site asked and not answered yet, the phase's deadline not passed, and `check` (what the
        reply holds against what was asked) find nothing. A reply with reasons to be `excluded` (its statistics
        cannot be true) is recorded so, with an event naming them: the site answered, and nothing it sent is
        used. One transaction,
        so a phase that closes meanwhile takes no reply after its close."""
        now = time.time()
        shares = tables.shares

        def write(conn: Connection) -> list[str]:
            job = conn.execute(select(tables.jobs.c.status).where(tables.jobs.c.job_id == job_id)).scalar()
            if job != "running":
                return [f"job {job_id!r} is {job or 'unknown'}: it takes no share reply"]
            r = conn.execute(select(tables.share_phases).where(tables.share_phases.c.job_id == job_id)).first()
            phase = _phase_record(r) if r is not None else None
            if phase is None or not phase.open:
                return [f"job {job_id!r} is not in its share phase"]
            was = conn.execute(select(shares.c.status).where(
                shares.c.job_id == job_id, shares.c.worker_id == worker_id)).scalar() or ShareStatus.NOT_ASKED
            if was == ShareStatus.NOT_ASKED:
                return [f"worker {worker_id!r} was not asked to share with job {job_id!r}"]
            if was != ShareStatus.ASKED:
                return [f"worker {worker_id!r} already answered job {job_id!r} ({was})"]
            if now > phase.deadline:
                return [f"late: the share phase of job {job_id!r} ended {now - phase.deadline:.0f}s before"]
            problems = check(phase)
            if problems:
                return problems
            why = "; ".join(excluded) if not answer.refused else ""
            status = ShareStatus.REFUSED if answer.refused else ShareStatus.EXCLUDED if why else ShareStatus.SHARED
            charged = 0.0 if answer.refused else _new_cost(conn, worker_id, answer)
            conn.execute(update(shares).where(shares.c.job_id == job_id, shares.c.worker_id == worker_id).values(
                status=status.value, reason=why or answer.reason, time=now,
                histogram_json=_histogram_json(answer), histogram_noised=int(answer.histogram_noised),
                histogram_epsilon=answer.histogram_epsilon, feature_sum_json=_floats_json(answer.feature_sum),
                feature_sq_sum_json=_floats_json(answer.feature_sq_sum), count=answer.count,
                statistics_noised=int(answer.statistics_noised), statistics_epsilon=answer.statistics_epsilon,
                statistics_delta=answer.statistics_delta, charged_epsilon=charged))
            if why:
                write_event(conn, job_id, "statistics_excluded", worker_id=worker_id, message=(
                    f"{_what_shared(answer, charged)}; excluded: {why}; its statistics are left out of the "
                    f"agreed ones and it is not selected for this job"))
            else:
                write_event(conn, job_id, "share_refused" if answer.refused else "shared", worker_id=worker_id,
                            message=answer.reason if answer.refused else _what_shared(answer, charged))
            return []

        return self._write(f"record the share reply of worker {worker_id!r} to job {job_id!r}", write)

    def close_share_phase(self, job_id: str, *, model_spec_json: str,
                          events: Sequence[tuple[str, str, str]]) -> None:
        """End the phase: sites still `asked` are `silent`; the agreed model (if any) becomes the job's model spec;
        `events` (kind, worker id, message) are written with it."""
        phases, shares = tables.share_phases, tables.shares

        def write(conn: Connection) -> None:
            conn.execute(update(shares).where(shares.c.job_id == job_id, shares.c.status == ShareStatus.ASKED.value)
                         .values(status=ShareStatus.SILENT.value, reason="no reply before the share deadline"))
            conn.execute(update(phases).where(phases.c.job_id == job_id).values(
                status="done", finished=time.time(), model_spec_json=model_spec_json))
            if model_spec_json:
                conn.execute(update(tables.jobs).where(tables.jobs.c.job_id == job_id).values(
                    model_spec_json=model_spec_json, updated=time.time()))
            for kind, worker_id, message in events:
                write_event(conn, job_id, kind, worker_id=worker_id, message=message)

        self._write(f"record the end of the share phase of job {job_id!r}", write)

    def note_not_shared(self, job_id: str, worker_ids: Sequence[str], reason: str) -> None:
        """Sites met after the job's share phase ended (registered later): recorded once each, with an event,
        as not selected for the job."""

        shares = tables.shares

        def write(conn: Connection) -> None:
            # read, then insert: the transaction holds the store's write lock (an insert's rowcount under ON CONFLICT
            # DO NOTHING is not reliable on PostgreSQL)
            known = set(conn.execute(select(shares.c.worker_id).where(shares.c.job_id == job_id)).scalars())
            for worker_id in dict.fromkeys(worker_ids):
                if worker_id not in known:
                    conn.execute(insert(shares).values(job_id=job_id, worker_id=worker_id,
                                                       status=ShareStatus.NOT_ASKED.value, reason=reason))
                    write_event(conn, job_id, "not_shared", worker_id=worker_id, message=f"{reason}: not selected")

        self._write(f"record the sites that did not share with job {job_id!r}", write)

    def shares(self, job_id: str | None = None, *, worker_id: str | None = None) -> list[ShareRecord]:
        """The answers kept for a job (or every job), of one site (or every site), by job, then site."""
        shares = tables.shares
        query = select(shares).order_by(shares.c.job_id, shares.c.worker_id)
        if job_id is not None:
            query = query.where(shares.c.job_id == job_id)
        if worker_id is not None:
            query = query.where(shares.c.worker_id == worker_id)
        return [_share_record(r) for r in self._exec(query)]


# ----- rows into records (the only place that reads a row of these tables by column name) -----

def _share_record(r: Row[Any]) -> ShareRecord:
    m = r._mapping
    return ShareRecord(
        job_id=m["job_id"], worker_id=m["worker_id"], status=ShareStatus(m["status"]), reason=m["reason"],
        time=m["time"], histogram=tuple(json.loads(m["histogram_json"])), histogram_noised=bool(m["histogram_noised"]),
        histogram_epsilon=m["histogram_epsilon"], feature_sum=tuple(json.loads(m["feature_sum_json"])),
        feature_sq_sum=tuple(json.loads(m["feature_sq_sum_json"])), count=m["count"],
        statistics_noised=bool(m["statistics_noised"]), statistics_epsilon=m["statistics_epsilon"],
        statistics_delta=m["statistics_delta"], charged_epsilon=m["charged_epsilon"])


def _phase_record(r: Row[Any]) -> SharePhaseRecord:
    m = r._mapping
    return SharePhaseRecord(
        job_id=m["job_id"], open=m["status"] == "open", histogram=bool(m["histogram"]),
        statistics=bool(m["statistics"]), lower=tuple(json.loads(m["lower_json"])),
        upper=tuple(json.loads(m["upper_json"])), features=m["features"], classes=m["classes"],
        started=m["started"], deadline=m["deadline"], finished=m["finished"], model_spec_json=m["model_spec_json"])


def _new_cost(conn: Connection, worker_id: str, answer: ShareAnswer) -> float:
    """The ε this answer newly costs its site: each noised release it holds, unless the site sent the very
    same release (values and ε) to an earlier job, which charged it then."""
    shares = tables.shares
    sent_before = select(1).where(shares.c.worker_id == worker_id, shares.c.status == ShareStatus.SHARED.value)
    cost = 0.0
    if answer.histogram and answer.histogram_epsilon > 0 and conn.execute(sent_before.where(
            shares.c.histogram_json == _histogram_json(answer),
            shares.c.histogram_epsilon == answer.histogram_epsilon).limit(1)).first() is None:
        cost += answer.histogram_epsilon
    if answer.count and answer.statistics_epsilon > 0 and conn.execute(sent_before.where(
            shares.c.feature_sum_json == _floats_json(answer.feature_sum),
            shares.c.feature_sq_sum_json == _floats_json(answer.feature_sq_sum), shares.c.count == answer.count,
            shares.c.statistics_epsilon == answer.statistics_epsilon).limit(1)).first() is None:
        cost += answer.statistics_epsilon
    return cost


def _histogram_json(answer: ShareAnswer) -> str:
    return json.dumps([int(c) for c in answer.histogram])


def _floats_json(values: Sequence[float]) -> str:
    return json.dumps([float(v) for v in values])


def _what_shared(answer: ShareAnswer, charged: float) -> str:
    parts = []
    if answer.histogram:
        parts.append(f"label histogram ({f'noised, ε {answer.histogram_epsilon:g}' if answer.histogram_noised else 'exact'})")
    if answer.count:
        parts.append(f"feature statistics of {answer.count} rows ("
                     + (f"noised, ε {answer.statistics_epsilon:g}, δ {answer.statistics_delta:g}"
                        if answer.statistics_noised else "exact") + ")")
    return f"{' and '.join(parts) or 'nothing'}; new ε charged to the site: {charged:g}"
