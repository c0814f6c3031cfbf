"""The aggregation service's state and rules, with no transport: the gRPC servicer only converts messages.

Per job it holds the global model (the latest two versions, so a worker that downloaded version t just
before the round closed can still fetch it) and the open round: who may upload, until when, and what
was accepted. An accepted update is either folded into a running weighted mean at once (FedAvg-style
jobs: memory O(model)) or kept until the close when selection or alignment needs every update.

With a `spool_dir`, every change is on disk before it is acknowledged (`aggregators.spool`): an accepted
update before its receipt goes back to the worker (which then acks its task and never uploads again), a
global model and the open round's definition before the coordinator's call returns. A new RoundBook on
the same folder (a restarted service) reloads all of it, so no acknowledged upload is lost. Every call
the coordinator makes is idempotent, so it may repeat any of them after a restart on either side:
`put_global` of a version the book already holds keeps the open round, `open_round` of the open round
returns its version, `close` of the last closed round returns that close's result again.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedbroker import codec
from fedbroker.aggregators.mean import ROWS, Layout, RunningWeightedMean, Slot, UpdateRows, weighted_mean_of_rows
from fedbroker.aggregators.network import from_layers, to_layers
from fedbroker.aggregators.registries import Algorithms, build_algorithms
from fedbroker.aggregators.spool import Spool, StoredJob
from fedbroker.errors import Conflict, NotFound, UploadRejected
from fedbroker.spec import AggregationConfig, ModelSpec, parameter_shapes, parse_model

log = logging.getLogger(__name__)

DEFAULT_MAX_UPDATE_BYTES = 1 << 30
KEEP_CLOSED_ROUNDS = 16  # closed rounds whose accepted workers and deadline are remembered (redeliveries, stragglers)


@dataclass(frozen=True)
class Receipt:
    job_id: str
    round: int
    worker_id: str
    duplicate: bool
    bytes_received: int
    sha256: str


@dataclass(frozen=True)
class UpdateSummary:
    worker_id: str
    num_samples: int
    epsilon: float
    train_loss: float
    weight: float


@dataclass(frozen=True)
class CloseResult:
    model_version: int
    aggregated: list[str]
    model_spec_json: str
    stats: dict[str, float]
    seconds: float
    updates: list[UpdateSummary]


@dataclass
class _Accepted:
    worker_id: str
    num_samples: int
    raw_weight: float
    sha256: str
    bytes_received: int
    meta: Any
    epsilon: float
    train_loss: float
    tensors: dict[str, np.ndarray] | None = None
    slot: Slot | None = None     # the row of the round's `rows` that holds `tensors` (rounds that keep updates)


@dataclass
class _Round:
    number: int
    participants: frozenset[str]
    deadline: float
    algorithms: Algorithms
    layout: Layout
    accepted: dict[str, _Accepted] = field(default_factory=dict)
    mean: RunningWeightedMean | None = None
    plain_mean: RunningWeightedMean | None = None   # while every weight so far is 0 (then Σw = 0 falls back to it)
    rows: UpdateRows | None = None                  # every accepted update, when selection or alignment needs them
    histograms: dict[str, list[int]] = field(default_factory=dict)
    closed: bool = False
    aggregation: dict[str, Any] = field(default_factory=dict)   # as opened (the spool re-builds algorithms from it)
    next_seq: int = 0                                           # acceptance order of the spooled updates


@dataclass
class _Job:
    job_id: str
    spec: ModelSpec
    seed: int
    versions: dict[int, dict[str, np.ndarray]]
    specs: dict[int, str]
    round: _Round | None = None
    closed_rounds: set[int] = field(default_factory=set)
    last_close: tuple[int, CloseResult] | None = None   # (round, result): a repeated close returns it
    closed_deadlines: dict[int, float] = field(default_factory=dict)  # a late upload is "late", not "round_closed"
    closed_accepted: dict[int, list[str]] = field(default_factory=dict)  # recent rounds: who got in (status)
    spare_rows: UpdateRows | None = None   # the last running mean's rows: the next round receives into them

    @property
    def version(self) -> int:
        return max(self.versions)


class RoundBook:
    def __init__(
        self,
        *,
        max_update_bytes: int = DEFAULT_MAX_UPDATE_BYTES,
        selection_time_limit_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        spool_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.max_update_bytes = max_update_bytes
        self.selection_time_limit_s = selection_time_limit_s
        self.clock = clock
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._accept_lock = threading.Lock()  # one accept at a time; status and downloads go on meanwhile
        self._spool = Spool(spool_dir) if spool_dir else None
        if self._spool is not None:
            for stored in self._spool.load():
                job = self._restore(stored)
                self._jobs[job.job_id] = job
            if self._jobs:
                log.info("restored %d job(s) from the spool %s", len(self._jobs), spool_dir)

    # ----- global model -----

    def put_global(self, job_id: str, version: int, spec_json: str, tensors: Mapping[str, np.ndarray]) -> None:
        """Install a job's initial (or restored) global model; it must match its spec exactly."""
        if not job_id:
            raise UploadRejected("bad_header", "job_id is empty")
        spec = parse_model(json.loads(spec_json))
        _check_matches(parameter_shapes(spec), tensors, who="the global model")
        _check_finite(tensors, who="the global model")
        state = {name: np.array(arr, dtype=np.float32) for name, arr in tensors.items()}
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and _same_model(job, version, spec_json, state):
                return  # a restarted coordinator re-installing what we hold: keep the open round and its uploads
        if self._spool is not None:
            self._spool.save_global(job_id, version, spec_json, state)
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                job = self._jobs[job_id] = _Job(job_id, spec, 0, {version: state}, {version: spec_json})
            else:
                job.spec = spec
                job.versions = {version: state}
                job.specs = {version: spec_json}
                job.round = None
                job.last_close = None
                job.spare_rows = None  # the dropped round's uploads may still hold rows of them
            self._commit(job)

    def global_model(self, job_id: str, version: int = 0) -> tuple[int, str, dict[str, np.ndarray]]:
        job = self._job(job_id)
        with self._lock:
            v = version or job.version
            if v not in job.versions:
                raise NotFound(f"job {job_id!r} has no global model version {v} (kept: {sorted(job.versions)})")
            return v, job.specs[v], job.versions[v]

    # ----- rounds -----

    def open_round(self, job_id: str, round_number: int, participants: Iterable[str], deadline: float,
                   aggregation: Mapping[str, Any], *, seed: int = 0,
                   histograms: Mapping[str, Sequence[int]] | None = None) -> int:
        job = self._job(job_id)
        members = frozenset(participants)
        if not members:
            raise UploadRejected("bad_request", f"round {round_number} of job {job_id!r} has no participants")
        algorithms = build_algorithms(AggregationConfig(**aggregation))
        with self._lock:
            if job.round is not None and job.round.number == round_number and not job.round.closed:
                if job.round.participants != members:
                    raise Conflict(f"round {round_number} of job {job_id!r} is already open with other participants")
                if deadline > job.round.deadline:  # a resumed coordinator gives a round more time, never less
                    job.round.deadline = deadline
                    self._commit(job)
                return job.version  # idempotent: a coordinator retrying after a lost reply, or restarted
            if round_number in job.closed_rounds:
                raise Conflict(f"round {round_number} of job {job_id!r} is already closed")
            job.seed = seed
            job.round = _new_round(round_number, members, deadline, algorithms, dict(aggregation),
                                   {w: [int(c) for c in h] for w, h in (histograms or {}).items()}, job.spec,
                                   job.spare_rows)
            self._commit(job)
            return job.version

    def status(self, job_id: str, round_number: int) -> tuple[list[str], bool]:
        job = self._job(job_id)
        with self._lock:
            rnd = job.round
            if rnd is None or rnd.number != round_number:  # a worker with a redelivered task of a closed round
                return list(job.closed_accepted.get(round_number, [])), False
            return sorted(rnd.accepted), not rnd.closed

    def receive_update(self, messages: Iterable[Any]) -> Receipt:
        """Validate and accept one streamed update; idempotent on (job, round, worker)."""
        duplicate: list[Receipt] = []

        def check(header: Any) -> None:
            receipt = self._check_header(header)
            if receipt is not None:
                duplicate.append(receipt)
                raise _Duplicate

        reserved: list[_Reserved] = []

        def into(header: Any, nbytes: int) -> np.ndarray | None:
            """A free row of the round's mean (or store) to receive into, so accepting it copies nothing."""
            with self._lock:
                rnd = self._jobs[header.job_id].round
                if rnd is None or sys.byteorder != "little" or [t.name for t in header.tensors] != list(rnd.layout.shapes):
                    return None  # tensors in another order: received apart and copied into a row on acceptance
                slot = rnd.mean.reserve(rnd.layout) if rnd.mean is not None else rnd.rows.take() if rnd.rows else None
                if slot is None:
                    return None
                reserved.append(_Reserved(rnd, slot))
                return slot.bytes

        try:
            header, tensors, digest = codec.receive(messages, max_bytes=self.max_update_bytes, on_header=check,
                                                    into=into)
            _check_finite(tensors, who=f"worker {header.worker_id!r}")
            return self._accept(header, tensors, digest, reserved[0] if reserved else None)
        except _Duplicate:
            return duplicate[0]
        finally:
            if reserved and not reserved[0].used:
                with self._lock:
                    _release(reserved[0].round, reserved[0].slot)

    def _check_header(self, header: Any) -> Receipt | None:
        job = self._jobs.get(header.job_id)
        if job is None:
            raise UploadRejected("unknown_job", f"unknown job {header.job_id!r}")
        with self._lock:
            rnd = job.round if job.round is not None and job.round.number == header.round else None
            if rnd is not None and header.worker_id in rnd.accepted:  # a retry, even after the close: first receipt
                done = rnd.accepted[header.worker_id]
                return Receipt(header.job_id, header.round, header.worker_id, True, done.bytes_received, done.sha256)
            deadline = rnd.deadline if rnd is not None else job.closed_deadlines.get(header.round)
            if (deadline is not None and self.clock() > deadline
                    and (rnd is None or header.worker_id in rnd.participants)):
                raise UploadRejected(  # a straggler, whether or not the round has closed at its deadline yet
                    "late", f"worker {header.worker_id!r}: round {header.round} deadline passed; late update refused"
                )
            if header.round in job.closed_rounds or (rnd is not None and rnd.closed):
                raise UploadRejected("round_closed", f"round {header.round} of job {header.job_id!r} is already closed")
            if rnd is None:
                raise UploadRejected("unknown_round", f"round {header.round} of job {header.job_id!r} is not open")
            if header.worker_id not in rnd.participants:
                raise UploadRejected(
                    "unknown_worker", f"worker {header.worker_id!r} is not a participant of round {header.round}"
                )
            if header.num_samples <= 0:
                raise UploadRejected("bad_header", f"num_samples must be positive, got {header.num_samples}")
            shapes = parameter_shapes(job.spec)
        wanted = {name: (shape, "float32") for name, shape in shapes.items()}
        got = {t.name: (tuple(t.shape), t.dtype) for t in header.tensors}
        _check_specs(wanted, got, who=f"worker {header.worker_id!r}")
        return None

    def _accept(self, header: Any, tensors: dict[str, np.ndarray], digest: str,
                reserved: _Reserved | None) -> Receipt:
        from fedbroker.aggregators.weighting import UpdateMeta

        meta = UpdateMeta(
            worker_id=header.worker_id,
            num_samples=int(header.num_samples),
            ish=header.ish if header.has_ish else None,
            loss=header.validation_loss or header.train_loss,
        )
        job = self._job(header.job_id)
        size = sum(arr.nbytes for arr in tensors.values())
        closed = UploadRejected("round_closed", f"round {header.round} of job {header.job_id!r} closed during the upload")
        with self._accept_lock:
            with self._lock:
                rnd = job.round
                if rnd is None or rnd.number != header.round or rnd.closed:
                    raise closed
                if header.worker_id in rnd.accepted:  # a concurrent retry won the race: count it once
                    done = rnd.accepted[header.worker_id]
                    return Receipt(header.job_id, header.round, header.worker_id, True, done.bytes_received, done.sha256)
                try:
                    raw = float(rnd.algorithms.weighting.raw_weight(meta))
                except ValueError as exc:
                    raise UploadRejected("bad_header", str(exc)) from exc
                entry = _Accepted(header.worker_id, meta.num_samples, raw, digest, size, meta,
                                  epsilon=header.epsilon, train_loss=header.train_loss)
                seq = rnd.next_seq
                rnd.next_seq += 1
            spooled = None
            if self._spool is not None:  # durable before the receipt: the worker acks its task on the receipt
                spooled = self._spool.save_update(job.job_id, rnd.number, seq, dict(_entry_record(entry), seq=seq),
                                                 tensors)
            with self._lock:
                if job.round is not rnd or rnd.closed:
                    if spooled is not None:
                        Spool.discard(spooled)
                    raise closed
                slot = None
                if reserved is not None and reserved.round is rnd:
                    slot, reserved.used = reserved.slot, True
                _fold(rnd, entry, tensors, slot)
        return Receipt(header.job_id, header.round, header.worker_id, False, size, digest)

    def close(self, job_id: str, round_number: int) -> CloseResult:
        """Aggregate what was accepted into the next global version."""
        started = time.perf_counter()
        job = self._job(job_id)
        with self._lock:
            if job.last_close is not None and job.last_close[0] == round_number:
                return job.last_close[1]  # a repeated close (the coordinator lost our reply, or restarted)
            rnd = job.round
            if rnd is None or rnd.number != round_number:
                raise NotFound(f"round {round_number} of job {job_id!r} is not open")
            if rnd.closed:
                raise Conflict(f"round {round_number} of job {job_id!r} is already closed")
            if not rnd.accepted:
                raise Conflict(f"round {round_number} of job {job_id!r} cannot close with no accepted update")
            rnd.closed = True
            accepted = dict(rnd.accepted)
            current = job.versions[job.version]
            spec = job.spec
        try:
            return self._close(job, rnd, accepted, current, spec, started)
        except BaseException:
            with self._lock:  # nothing changed: the round stays open and the coordinator may close it again
                rnd.closed = False
            raise

    def _close(self, job: _Job, rnd: _Round, accepted: dict[str, _Accepted], current: dict[str, np.ndarray],
               spec: ModelSpec, started: float) -> CloseResult:
        round_number = rnd.number
        rng = np.random.default_rng([job.seed, round_number])
        stats: dict[str, float] = {"accepted": float(len(accepted))}
        if rnd.mean is not None:
            chosen = sorted(accepted)
            new_state, weights = self._incremental_result(rnd, accepted, stats)
        else:
            chosen, weights = self._choose(rnd, accepted, current, rng, stats)
            spec, new_state = self._combine(rnd, spec, [accepted[w] for w in chosen], weights, rng, stats)
        coefficient = dict(zip(chosen, weights))
        updates = [
            UpdateSummary(w, a.num_samples, a.epsilon, a.train_loss, float(coefficient.get(w, 0.0)))
            for w, a in sorted(accepted.items())
        ]
        stats["aggregated"] = float(len(chosen))
        version = job.version + 1
        new_spec_json = spec.to_json()
        if self._spool is not None:
            self._spool.save_global(job.job_id, version, new_spec_json, new_state)
        seconds = time.perf_counter() - started
        result = CloseResult(version, chosen, new_spec_json, stats, seconds, updates)
        with self._lock:
            job.versions = {job.version: current, version: new_state}
            job.specs = {v: job.specs[v] for v in job.versions if v in job.specs}
            job.spec = spec
            job.specs[version] = new_spec_json
            job.closed_rounds.add(round_number)
            if rnd.mean is not None:  # an upload still streaming into one of them keeps its row until refused
                job.spare_rows = rnd.mean.rows
            job.closed_deadlines[round_number] = rnd.deadline
            job.closed_accepted[round_number] = sorted(accepted)
            for old in sorted(job.closed_accepted)[:-KEEP_CLOSED_ROUNDS]:
                del job.closed_accepted[old]
                job.closed_deadlines.pop(old, None)
            job.last_close = (round_number, result)
            self._commit(job)
        return result

    def _incremental_result(self, rnd: _Round, accepted: dict[str, _Accepted],
                            stats: dict[str, float]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        assert rnd.mean is not None
        raw = np.array([accepted[w].raw_weight for w in sorted(accepted)])
        weights, fell_back = rnd.algorithms.weighting.normalise(raw)
        stats["weighting_fallback"] = float(fell_back)
        if fell_back:
            if rnd.plain_mean is None:  # only weightings whose raw weights are always > 0 skip the plain mean
                raise Conflict("every update of this round has weight zero and no unweighted mean was kept")
            log.warning("round %d: every weight is zero; falling back to the unweighted mean", rnd.number)
            return rnd.plain_mean.result(), weights
        return rnd.mean.result(), weights

    def _choose(self, rnd: _Round, accepted: dict[str, _Accepted], current: Mapping[str, np.ndarray],
                rng: np.random.Generator, stats: dict[str, float]) -> tuple[list[str], np.ndarray]:
        """Selection picks which updates enter the mean; weighting gives their coefficients."""
        from fedbroker.aggregators.selection import Candidate

        selection = rnd.algorithms.selection
        vectors = selection.needs_vectors(rnd.number)
        ids = sorted(accepted)
        candidates = [
            Candidate(worker_id=w, vector=_vector(accepted[w]) if vectors else np.zeros(0),
                      num_samples=accepted[w].num_samples, reported_loss=accepted[w].meta.loss)
            for w in ids
        ]
        chosen_by = selection.choose(
            candidates, round_index=rnd.number, global_vector=_flatten(current) if vectors else np.zeros(0),
            rng=rng, deadline=time.monotonic() + self.selection_time_limit_s,
        )
        if chosen_by.reason:
            log.warning("selection for round %d fell back: %s", rnd.number, chosen_by.reason)
        stats.update({f"selection_{k}": float(v) for k, v in chosen_by.stats.items()})
        chosen = list(chosen_by.chosen)
        weights, fell_back = rnd.algorithms.weighting.normalise(np.array([accepted[w].raw_weight for w in chosen]))
        stats["weighting_fallback"] = float(fell_back)
        return chosen, weights

    def _combine(self, rnd: _Round, spec: ModelSpec, updates: list[_Accepted], weights: np.ndarray,
                 rng: np.random.Generator, stats: dict[str, float]) -> tuple[ModelSpec, dict[str, np.ndarray]]:
        """The weighted mean, or the alignment's global network (whose widths may differ from `spec`)."""
        if rnd.algorithms.alignment_name == "none":
            assert rnd.rows is not None and all(u.slot is not None for u in updates)
            return spec, dict(weighted_mean_of_rows(rnd.rows, [u.slot for u in updates if u.slot], weights, rnd.layout))
        clients = [to_layers(spec, u.tensors or {}) for u in updates]
        result = rnd.algorithms.alignment.align(
            clients, weights=weights, rng=rng, round_index=rnd.number, class_shares=self._class_shares(rnd, updates),
        )
        stats.update({f"alignment_{k}": float(v) for k, v in result.stats.items()})
        return from_layers(spec, result.layers)

    @staticmethod
    def _class_shares(rnd: _Round, updates: list[_Accepted]) -> np.ndarray | None:
        """Each chosen worker's label counts (clients × classes), when every one of them sent a histogram."""
        rows = [rnd.histograms.get(u.worker_id) for u in updates]
        if not rows or any(not r for r in rows):
            return None
        width = max(len(r) for r in rows if r)
        return np.array([list(r or []) + [0] * (width - len(r or [])) for r in rows], dtype=np.float64)

    # ----- the spool -----

    def _commit(self, job: _Job) -> None:
        """Write the job's record (under `_lock`); its global versions are on disk already."""
        if self._spool is None:
            return
        rnd = job.round if job.round is not None and not job.round.closed else None
        last = None
        if job.last_close is not None:
            n, r = job.last_close
            last = {"round": n, "model_version": r.model_version, "aggregated": r.aggregated,
                    "model_spec_json": r.model_spec_json, "stats": r.stats, "seconds": r.seconds,
                    "updates": [vars(u) for u in r.updates]}
        self._spool.save_record(job.job_id, {
            "seed": job.seed,
            "versions": sorted(job.versions),
            "closed_rounds": sorted(job.closed_rounds),
            "closed_accepted": {str(n): w for n, w in job.closed_accepted.items()},
            "closed_deadlines": {str(n): d for n, d in job.closed_deadlines.items()},
            "last_close": last,
            "round": None if rnd is None else {
                "number": rnd.number, "participants": sorted(rnd.participants), "deadline": rnd.deadline,
                "aggregation": rnd.aggregation, "histograms": rnd.histograms,
            },
        })

    def _restore(self, stored: StoredJob) -> _Job:
        record = stored.record
        versions = {v: tensors for v, (_, tensors) in stored.globals.items()}
        specs = {v: spec_json for v, (spec_json, _) in stored.globals.items()}
        job = _Job(record["job_id"], parse_model(json.loads(specs[max(specs)])), int(record["seed"]), versions, specs,
                   closed_rounds={int(n) for n in record["closed_rounds"]},
                   closed_accepted={int(n): list(w) for n, w in record.get("closed_accepted", {}).items()},
                   closed_deadlines={int(n): float(d) for n, d in record.get("closed_deadlines", {}).items()})
        last = record.get("last_close")
        if last:
            job.last_close = (int(last["round"]), CloseResult(
                int(last["model_version"]), list(last["aggregated"]), last["model_spec_json"],
                {k: float(v) for k, v in last["stats"].items()}, float(last["seconds"]),
                [UpdateSummary(**u) for u in last["updates"]]))
        r = record.get("round")
        if r:
            aggregation = dict(r["aggregation"])
            job.round = _new_round(int(r["number"]), frozenset(r["participants"]), float(r["deadline"]),
                                   build_algorithms(AggregationConfig(**aggregation)), aggregation,
                                   {w: list(h) for w, h in r["histograms"].items()}, job.spec)
            for meta, tensors in self._spool.updates(stored, job.round.number) if self._spool else ():
                entry = _entry_from_record(meta)
                job.round.next_seq = int(meta["seq"]) + 1
                _fold(job.round, entry, tensors, None)
            log.info("job %s: round %d reopened with %d accepted update(s) from the spool", job.job_id,
                     job.round.number, len(job.round.accepted))
        return job

    def _job(self, job_id: str) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise NotFound(f"unknown job {job_id!r}")
        return job


class _Duplicate(Exception):
    """Internal: stop reading a stream whose update was already accepted."""


@dataclass
class _Reserved:
    """The row an upload is being received into, and whether its acceptance took it."""

    round: _Round
    slot: Slot
    used: bool = False


def _new_round(number: int, members: frozenset[str], deadline: float, algorithms: Algorithms,
               aggregation: dict[str, Any], histograms: dict[str, list[int]], spec: ModelSpec,
               spare_rows: UpdateRows | None = None) -> _Round:
    layout = Layout(parameter_shapes(spec))
    return _Round(
        number, members, deadline, algorithms, layout,
        mean=RunningWeightedMean(layout, rows=spare_rows) if algorithms.incremental else None,
        plain_mean=RunningWeightedMean(layout) if algorithms.incremental and not algorithms.weights_positive else None,
        rows=None if algorithms.incremental else UpdateRows(layout.size, per_block=ROWS),
        histograms=histograms, aggregation=aggregation,
    )


def _fold(rnd: _Round, entry: _Accepted, tensors: dict[str, np.ndarray], slot: Slot | None) -> None:
    """Count an accepted update in its round (under the book's lock); `slot` is the row it was received into."""
    if rnd.mean is not None:
        if rnd.plain_mean is not None:
            rnd.plain_mean.add(tensors, 1.0)  # copies: `slot` belongs to the weighted mean
        rnd.mean.add(tensors, entry.raw_weight, slot=slot)
        if entry.raw_weight > 0:  # Σw > 0 from now on: the unweighted fallback can no longer be needed
            rnd.plain_mean = None
    else:
        assert rnd.rows is not None
        if slot is None:  # restored from the spool, or sent in another tensor order: copy into a row
            slot = rnd.rows.take()
            assert slot is not None  # the store grows as needed
            rnd.layout.write(tensors, slot.values)
        entry.slot = slot
        entry.tensors = rnd.layout.views(slot.values)
    rnd.accepted[entry.worker_id] = entry


def _release(rnd: _Round, slot: Slot) -> None:
    """Give back the row of an upload that was refused (or lost a race to a retry of itself)."""
    if rnd.mean is not None:
        rnd.mean.release(slot)
    elif rnd.rows is not None:
        rnd.rows.give_back(slot)


def _entry_record(entry: _Accepted) -> dict[str, Any]:
    m = entry.meta
    return {"worker_id": entry.worker_id, "num_samples": entry.num_samples, "raw_weight": entry.raw_weight,
            "sha256": entry.sha256, "bytes_received": entry.bytes_received, "epsilon": entry.epsilon,
            "train_loss": entry.train_loss, "ish": m.ish, "loss": m.loss}


def _entry_from_record(r: Mapping[str, Any]) -> _Accepted:
    from fedbroker.aggregators.weighting import UpdateMeta

    meta = UpdateMeta(worker_id=r["worker_id"], num_samples=int(r["num_samples"]), ish=r["ish"], loss=r["loss"])
    return _Accepted(r["worker_id"], int(r["num_samples"]), float(r["raw_weight"]), r["sha256"],
                     int(r["bytes_received"]), meta, epsilon=float(r["epsilon"]), train_loss=float(r["train_loss"]))


def _same_model(job: _Job, version: int, spec_json: str, state: Mapping[str, np.ndarray]) -> bool:
    held = job.versions.get(version)
    if held is None or job.specs.get(version) != spec_json or held.keys() != state.keys():
        return False
    return all(np.array_equal(held[name], arr) for name, arr in state.items())


def _vector(entry: _Accepted) -> np.ndarray:
    """An update as one flat vector: its row when it has one (no copy)."""
    return entry.slot.values if entry.slot is not None else _flatten(entry.tensors or {})


def _flatten(tensors: Mapping[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ravel(a) for a in tensors.values()]) if tensors else np.zeros(0)


def _check_specs(wanted: Mapping[str, tuple[tuple[int, ...], str]], got: Mapping[str, tuple[tuple[int, ...], str]], *, who: str) -> None:
    unknown = sorted(set(got) - set(wanted))
    if unknown:
        raise UploadRejected("unknown_tensor", f"{who}: unknown tensor {unknown[0]!r}; the model has {sorted(wanted)}")
    missing = sorted(set(wanted) - set(got))
    if missing:
        raise UploadRejected("missing_tensor", f"{who}: tensor {missing[0]!r} is missing")
    for name, (shape, dtype) in wanted.items():
        got_shape, got_dtype = got[name]
        if got_shape != shape:
            raise UploadRejected("wrong_shape", f"{who}: tensor {name!r} has shape {list(got_shape)}, expected {list(shape)}")
        if got_dtype != dtype:
            raise UploadRejected("wrong_dtype", f"{who}: tensor {name!r} has dtype {got_dtype}, expected {dtype}")


def _check_matches(shapes: Mapping[str, tuple[int, ...]], tensors: Mapping[str, np.ndarray], *, who: str) -> None:
    _check_specs(
        {n: (s, "float32") for n, s in shapes.items()},
        {n: (tuple(a.shape), "float32") for n, a in tensors.items()},
        who=who,
    )


FINITE_BLOCK = 1 << 16  # values checked at a time: no model-sized boolean temporary


def _check_finite(tensors: Mapping[str, np.ndarray], *, who: str) -> None:
    flags = np.empty(FINITE_BLOCK, dtype=bool)
    for name, arr in tensors.items():
        flat = np.asarray(arr).reshape(-1)
        for start in range(0, flat.size, FINITE_BLOCK):
            block = flat[start:start + FINITE_BLOCK]
            if not np.isfinite(block, out=flags[: block.size]).all():
                raise UploadRejected("non_finite", f"{who}: tensor {name!r} contains NaN or Inf")
