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
returns its version, `close` of the last closed round returns that close's result again, and a `close`
repeated while the first is still aggregating (a client that lost its connection) waits for that close
and returns its result: it is never told "already closed".

The book is the thin coordinator of its parts: `admission` (may this upload enter?), `job_state` (the rounds'
state machine, the job's algorithms), `async_state` (async tasks), `rows` (which update lives in which row),
`combine` (the close), `secure_rounds` (aggregation.secure) and `spool` (the records on disk). It holds the
locks and decides what is on disk before which reply.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from fedbroker.aggregators import admission, metrics
from fedbroker.aggregators.async_state import (
    AsyncState,
    Folded,
    Issued,
    copy_for_status,
    folded_record,
    new_async_state,
)
from fedbroker.aggregators.combine import ProbeLoader, combine
from fedbroker.aggregators.fedbuff import StaleUpdate
from fedbroker.aggregators.installed_jobs import InstalledJobs
from fedbroker.aggregators.job_state import (
    Accepted,
    AfterClose,
    CloseResult,
    Job,
    JobSnapshot,
    Receipt,
    Round,
    UpdateSummary,
    new_round,
    snapshot,
)
from fedbroker.aggregators.probe_sets import probe_arrays
from fedbroker.aggregators.rows import Reservation
from fedbroker.aggregators.secure_rounds import SecureRounds, new_session
from fedbroker.aggregators.spool import Spool, job_record, restore_jobs, update_record
from fedbroker.aggregators.weighting.base import UpdateMeta
from fedbroker.errors import Conflict, NotFound, Rejection, UnknownJob, UploadRejected
from fedbroker.job.spec import ModelSpec, parameter_shapes, parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec
from fedbroker.secagg.secure_round import UNMASK_WAIT_S

log = logging.getLogger(__name__)

DEFAULT_MAX_UPDATE_BYTES = 1 << 30


class RoundBook:
    """Every job the service holds, and the rules for its rounds and buffers (see the module docstring)."""

    def __init__(
        self,
        *,
        max_update_bytes: int = DEFAULT_MAX_UPDATE_BYTES,
        selection_time_limit_s: float = 30.0,
        alignment_time_limit_s: float = 120.0,
        clock: Callable[[], float] = time.time,
        spool_dir: str | os.PathLike[str] | None = None, spool_lock_wait_s: float = 0.0,
        probe_sets: ProbeLoader = probe_arrays,
        secure_unmask_s: float = UNMASK_WAIT_S,
    ) -> None:
        self.max_update_bytes = max_update_bytes
        self.probe_sets = probe_sets  # (dataset, size, seed) -> (x, y): the probe sets the GA's fitness reads
        self.selection_time_limit_s = selection_time_limit_s
        self.alignment_time_limit_s = alignment_time_limit_s  # then the close falls back to the weighted mean
        self.clock = clock
        self.secure_unmask_s, self.secure = secure_unmask_s, SecureRounds(self)  # the close's wait for unmask shares
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._closed = threading.Condition(self._lock)  # notified whenever a close ends, done or not
        self._accept_lock = threading.Lock()  # one accept at a time; status and downloads go on meanwhile
        self._watchers = threading.Condition(self._lock)  # notified whenever a job changes (`watch`)
        self._generation = 0                              # counts the changes
        self._changed_at: dict[str, int] = {}             # job → the generation of its last change
        self.installed = InstalledJobs()
        self._spool = Spool(spool_dir, lock_wait_s=spool_lock_wait_s) if spool_dir else None  # SpoolInUse: held
        if self._spool is not None:
            try:
                self.installed = InstalledJobs(self._spool)  # each job's settings, parsed once (InstallJob)
                self._restore(self._spool)
            except BaseException:
                self._spool.close()  # a book that failed to start holds no folder
                raise

    def _restore(self, spool: Spool) -> None:
        for job in restore_jobs(spool, self.installed.for_round):  # a record that does not load is quarantined, not fatal
            self._jobs[job.job_id] = job
        if self._jobs:
            log.info("restored %d job(s) from the spool %s", len(self._jobs), spool.root)
        for job in self._jobs.values():
            self._restored_buffer(job)

    def stop(self) -> None:
        """The service stopped: release the spool for the next service on it once the writes under way have
        ended. This book's threads still running (gRPC cannot stop a handler) then fail on any write
        (`SpoolClosed`) instead of changing files the next service's records name. Idempotent."""
        if self._spool is not None:
            self._spool.close()

    # ----- global model -----

    def put_global(self, job_id: str, version: int, spec_json: str, tensors: Mapping[str, np.ndarray]) -> None:
        """Install a job's initial (or restored) global model; it must match its spec exactly."""
        if not job_id:
            raise UploadRejected(Rejection.BAD_HEADER, "job_id is empty")
        spec = parse_model(json.loads(spec_json))
        admission.check_global_model(parameter_shapes(spec), tensors)
        state = {name: np.array(arr, dtype=np.float32) for name, arr in tensors.items()}
        with self._lock:
            job = self._jobs.get(job_id)
            if job is not None and job.holds(version, spec_json, state):
                return  # a restarted coordinator re-installing what we hold: keep the open round and its uploads
        if self._spool is not None:
            self._spool.save_global(job_id, version, spec_json, state)
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                job = self._jobs[job_id] = Job(job_id, spec, 0, {version: state}, {version: spec_json})
            else:
                job.install(version, spec, spec_json, state)
            self._commit(job)

    def global_model(self, job_id: str, version: int = 0) -> tuple[int, str, dict[str, np.ndarray]]:
        """A kept global version (0: the newest), with its spec: what workers download."""
        job = self._job(job_id)
        with self._lock:
            v = version or job.version
            if v not in job.versions:
                raise NotFound(f"job {job_id!r} has no global model version {v} (kept: {sorted(job.versions)})")
            return v, job.specs[v], job.versions[v]

    def settings_for(self, job_id: str, worker_id: str) -> pb.JobSettings:
        """A job's installed settings for one of its participants (a worker that lost them: it restarted); a
        worker the job never asked for an update learns nothing of it."""
        job, installed = self._job(job_id), self.installed.get(job_id).installed
        with self._lock:
            asked = job.asked(worker_id)
        if not asked:
            raise UploadRejected(Rejection.UNKNOWN_WORKER, f"worker {worker_id!r} is not a participant of job {job_id!r}")
        return installed.message

    # ----- rounds -----

    def open_round(self, job_id: str, round_number: int, participants: Iterable[str], deadline: float,
                   aggregation: Mapping[str, Any] | None = None, *, seed: int = 0,
                   histograms: Mapping[str, Sequence[int]] | None = None,
                   num_samples: Mapping[str, int] | None = None) -> int:
        """Open round `round_number` (idempotent) with the job's installed settings (`aggregation`: an older
        coordinator's section instead). `num_samples`: each participant's registered sample count, the most its
        upload may claim (a participant not in it is unbounded)."""
        job = self._job(job_id)
        members = frozenset(participants)
        if not members:
            raise UploadRejected(Rejection.BAD_REQUEST, f"round {round_number} of job {job_id!r} has no participants")
        algorithms = self.installed.for_round(job_id, aggregation)
        section = asdict(algorithms.installed.aggregation)
        counts = {w: [int(c) for c in h] for w, h in (histograms or {}).items()}
        limits = {w: int(n) for w, n in (num_samples or {}).items()}
        with self._lock:
            changed = job.open(round_number, members, deadline, seed=seed, build=lambda: new_round(
                round_number, members, deadline, algorithms, section, counts, job.spec, job.spare_rows,
                sample_limits=limits, secure=new_session(job_id, round_number, job.version, members, job.spec,
                                                         opened=self.clock(), deadline=deadline, clock=self.clock)
                if algorithms.installed.aggregation.secure else None))
            if changed:
                self._commit(job)
            return job.version

    def status(self, job_id: str, round_number: int) -> tuple[list[str], bool]:
        """Who got in, and whether the round is open; in async mode `round_number` is a task number: its
        worker if that task's update was accepted, and open while the task is outstanding."""
        job = self._job(job_id)
        with self._lock:
            state = job.asynchronous
            if state is not None:
                return ([w for w, r in state.accepted.items() if r.task == round_number],
                        any(i.task == round_number for i in state.issued.values()))
            return job.status(round_number)

    def worker_status(self, job_id: str, round_number: int, worker_id: str) -> tuple[bool, bool]:
        """`status` for one worker: whether its update is in, and whether the round (async: its task numbered
        `round_number`, open while outstanding) still takes it."""
        job = self._job(job_id)
        with self._lock:
            state = job.asynchronous
            if state is not None:
                done, issued = state.accepted.get(worker_id), state.issued.get(worker_id)
                return (done is not None and done.task == round_number,
                        issued is not None and issued.task == round_number)
            return job.worker_status(round_number, worker_id)

    def receive_update(self, messages: Iterable[pb.UpdateChunk]) -> Receipt:
        """Validate and accept one streamed update; idempotent on (job, round, worker).

        The header is judged before any data is read: a retry of an accepted update gets its first receipt
        at once while its round is open, a refused one reads no payload. Once the round has closed it takes
        nothing new, so a retry is read and answered with its first receipt only if it is the very update
        the round took (its digest). A new update is received into a free row when it can be.
        """
        stream = iter(messages)
        header, size = codec.receive_header(stream, max_bytes=self.max_update_bytes)
        first = self._admit(header)
        if isinstance(first, AfterClose):
            return first.judge(codec.receive_payload(stream, header, size, buffer=None)[1])
        if first is not None:
            return first
        if header.masked:  # admitted to a secure round: into its masked sum, never into a row or the spool
            return self.secure.receive_masked(header, stream, size)
        if self._jobs[header.job_id].asynchronous is not None:
            tensors, digest = codec.receive_payload(stream, header, size, buffer=None)
            self._jobs[header.job_id].check_update(tensors, who=f"worker {header.worker_id!r}",
                                                 declared=self.installed.get(header.job_id).max_update_value)
            return self._accept_async(header, tensors, digest)
        reservation = self._reserve(header)
        try:
            tensors, digest = codec.receive_payload(stream, header, size,
                                                    buffer=reservation.slot.bytes if reservation else None)
            self._jobs[header.job_id].check_update(tensors, who=f"worker {header.worker_id!r}",
                                                 declared=self.installed.get(header.job_id).max_update_value)
            return self._accept(header, tensors, digest, reservation)
        finally:
            if reservation is not None:
                with self._lock:  # a refused upload gives its row back
                    reservation.release_unused()

    def _admit(self, header: pb.UpdateHeader) -> Receipt | AfterClose | None:
        """None for a new update that may be received; the first receipt for a retry while its round is open
        (after the close: what to judge it by once read); else UploadRejected."""
        job = self._jobs.get(header.job_id)
        if job is None:
            raise UploadRejected(Rejection.UNKNOWN_JOB, f"unknown job {header.job_id!r}")
        if job.asynchronous is not None:
            return self._admit_async(job, header)
        with self._lock:
            rnd = job.current(header.round)
            if rnd is not None and not rnd.closed:
                first = rnd.receipt(header.job_id, header.worker_id)
                if first is not None:  # a retry while the round is open: its first receipt
                    return first
            else:
                kept = job.kept_receipt(header.round, header.worker_id)
                if kept is not None:  # a retry after the close (maybe of a round long gone from memory)
                    return AfterClose(kept, f"round {header.round} of job {header.job_id!r} is closed")
            standing = job.standing(header.round)
            admission.check_membership(header, standing, now=self.clock())
            shapes, secure = parameter_shapes(job.spec), rnd.secure if rnd is not None else None
        if secure is not None or header.masked:  # a secure round's masked vector (or a masked upload elsewhere)
            SecureRounds.check_header(header, secure)
        else:
            admission.check_header(header, shapes, max_samples=standing.sample_limits.get(header.worker_id))
        return None

    def _reserve(self, header: pb.UpdateHeader) -> Reservation | None:
        """A free row of the round's rows to receive into, so accepting the update copies nothing."""
        with self._lock:
            rnd = self._jobs[header.job_id].round
            return rnd.rows.reserve([t.name for t in header.tensors]) if rnd is not None else None

    def _accept(self, header: pb.UpdateHeader, tensors: dict[str, np.ndarray], digest: str,
                reservation: Reservation | None) -> Receipt:
        """Count a received update: on disk before the receipt goes back (the worker acks its task on it)."""
        meta = UpdateMeta(
            worker_id=header.worker_id,
            num_samples=int(header.num_samples),
            ish=header.ish if header.has_ish else None,
            loss=header.validation_loss or header.train_loss,
        )
        job = self._job(header.job_id)
        size = sum(arr.nbytes for arr in tensors.values())
        with self._accept_lock:
            with self._lock:
                rnd = self._receiving(job, header)
                first = rnd.receipt(header.job_id, header.worker_id)
                if first is not None:  # a concurrent retry won the race: count it once
                    return first
                try:
                    raw = float(rnd.algorithms.weighting.raw_weight(meta))
                except ValueError as exc:
                    raise UploadRejected(Rejection.BAD_HEADER, str(exc)) from exc
                entry = Accepted(header.worker_id, meta.num_samples, raw, digest, size, meta,
                                 epsilon=header.epsilon, train_loss=header.train_loss)
                seq = rnd.take_seq()
            spooled = None
            if self._spool is not None:
                spooled = self._spool.save_update(job.job_id, rnd.number, seq, update_record(entry, seq), tensors)
            with self._lock:
                if job.round is not rnd or rnd.closed:
                    if spooled is not None and self._spool is not None:
                        self._spool.discard(spooled)
                    raise _closed_during_upload(header)
                rnd.accept(entry, tensors, reservation.take(rnd.rows) if reservation is not None else None)
                self._touch(job)
        return Receipt(header.job_id, header.round, header.worker_id, False, size, digest)

    @staticmethod
    def _receiving(job: Job, header: pb.UpdateHeader) -> Round:
        """The round the upload was admitted to, if it is still open."""
        rnd = job.round
        if rnd is None or rnd.number != header.round or rnd.closed:
            raise _closed_during_upload(header)
        return rnd

    def close(self, job_id: str, round_number: int) -> CloseResult:
        """Aggregate what was accepted into the next global version.

        Safe to repeat: a close of a round that is being closed waits for that close and returns its result
        (or, if it failed and the round is open again, closes it itself); a close of the last closed round
        returns its result again.
        """
        started = time.perf_counter()
        job = self._job(job_id)
        with self._closed:
            while True:
                repeated = job.repeated_close(round_number)
                if repeated is not None:
                    return repeated  # a repeated close (the coordinator lost our reply, or restarted)
                if not job.closing(round_number):
                    break
                self._closed.wait()  # the first close is aggregating: its result is ours too
            rnd = job.begin_close(round_number)
            accepted = dict(rnd.accepted)
            current = job.versions[job.version]
            spec = job.spec
        try:
            return self._close(job, rnd, accepted, current, spec, started)
        except BaseException:
            with self._lock:  # nothing changed: the round stays open and the coordinator may close it again
                job.abort_close(rnd)
            raise
        finally:
            with self._closed:  # a repeated close waiting for this one: its result (or the round) is there
                self._closed.notify_all()

    def abandon(self, job_id: str, round_number: int) -> list[UpdateSummary]:
        """Drop a cancelled job's open round without aggregating it (`Job.abandon`); the discarded uploads.
        A close under way is waited for first, so an abandon never cuts an aggregation in half."""
        job = self._job(job_id)
        with self._closed:
            while job.closing(round_number):
                self._closed.wait()
            dropped = job.abandon(round_number)
            self._commit(job)  # the record no longer names the round: the spool prunes its uploads
        return [UpdateSummary(a.worker_id, a.num_samples, a.epsilon, a.train_loss, 0.0) for a in dropped]

    def _close(self, job: Job, rnd: Round, accepted: dict[str, Accepted], current: dict[str, np.ndarray],
               spec: ModelSpec, started: float) -> CloseResult:
        combined = self.secure.combine_secure(rnd, current, spec) if rnd.secure is not None else combine(
            rnd, accepted, current, spec, seed=job.seed, selection_time_limit_s=self.selection_time_limit_s,
            alignment_time_limit_s=self.alignment_time_limit_s, probe_sets=self.probe_sets)
        coefficient = dict(zip(combined.chosen, combined.weights))
        updates = [
            UpdateSummary(w, a.num_samples, a.epsilon, a.train_loss, float(coefficient.get(w, 0.0)))
            for w, a in sorted(accepted.items())
        ]
        version = job.version + 1
        new_spec_json = combined.spec.to_json()
        if self._spool is not None:
            self._spool.save_global(job.job_id, version, new_spec_json, combined.state)
        seconds = time.perf_counter() - started
        result = combined.report(version, new_spec_json, seconds, updates)
        with self._lock:
            job.finish_close(rnd, result, current, combined.state, combined.spec)
            self._commit(job)
        return result

    # ----- asynchronous mode (FedBuff) -----

    def open_buffer(self, job_id: str, config: Mapping[str, Any], *,
                    num_samples: Mapping[str, int] | None = None) -> int:
        """Put the job in asynchronous mode (idempotent: a job already in it keeps its buffer and tasks).
        `config`: aggregation, buffer_size, max_staleness, staleness, staleness_params, server_lr, seed."""
        job = self._job(job_id)
        with self._lock:
            state = new_async_state(dict(config), {w: int(n) for w, n in (num_samples or {}).items()},
                                    self.installed.for_round(job_id, config.get("aggregation")))
            if job.asynchronous is not None:
                job.asynchronous.sample_limits.update(state.sample_limits)  # workers registered since
                self._commit(job)
                return job.version
            if job.round is not None and not job.round.closed:
                raise Conflict(f"job {job_id!r} has an open round: it is not in asynchronous mode")
            job.asynchronous = state
            job.seed = int(config.get("seed", 0))
            metrics.BUFFER_CAPACITY.inc(state.buffer.buffer_size)
            self._commit(job)
            return job.version

    def issue_tasks(self, job_id: str, workers: Sequence[str], *,
                    num_samples: Mapping[str, int] | None = None) -> list[tuple[str, Issued]]:
        """A new task on the newest version for each worker, on disk before the reply (the coordinator
        publishes the tasks only then); a worker's previous task is superseded. `num_samples`: the workers'
        registered sample counts (each worker needs one, sent now or known from before: `AsyncState.issue`)."""
        job = self._job(job_id)
        if len(set(workers)) != len(workers) or not all(isinstance(w, str) and w for w in workers):
            raise UploadRejected(Rejection.BAD_REQUEST, "workers must be distinct, non-empty ids")
        limits = {w: int(n) for w, n in (num_samples or {}).items()}
        with self._lock:
            state = self._async(job)
            if state.closed:
                raise Conflict(f"the buffer of job {job_id!r} is closed: the job ended")
            issued = state.issue(list(workers), job.version, limits)
            self._commit(job)
            return issued

    def close_buffer(self, job_id: str) -> tuple[int, list[Folded]]:
        """The job ended (idempotent): outstanding tasks end, nothing more is issued or accepted. The newest
        version, and the buffer's updates: accepted, in no version (the coordinator records their ε)."""
        job = self._job(job_id)
        with self._accept_lock, self._lock:
            state = self._async(job)
            if state.close():
                metrics.BUFFER_CAPACITY.dec(state.buffer.buffer_size)
                metrics.BUFFERED.dec(len(state.folded))
                self._commit(job)
            return job.version, list(state.folded)

    def buffer_status(self, job_id: str, since_version: int = 0) -> tuple[int, AsyncState]:
        """The newest version and the async state (read under the lock; the caller copies what it needs)."""
        job = self._job(job_id)
        with self._lock:
            state = self._async(job)
            return job.version, copy_for_status(state, since_version)

    def _restored_buffer(self, job: Job) -> None:
        """A restored async job: its buffer counts in the metrics, and a buffer that was full when the service
        died (every update's receipt sent, the version not yet committed) becomes that version now."""
        state = job.asynchronous
        if state is None:
            return
        metrics.BUFFER_CAPACITY.inc(state.buffer.buffer_size)
        metrics.BUFFERED.inc(len(state.folded))
        if state.buffer.full:
            with self._accept_lock:
                self._publish_version(job, state)

    def _async(self, job: Job) -> AsyncState:
        if job.asynchronous is None:
            raise Conflict(f"job {job.job_id!r} is not in asynchronous mode (OpenBuffer first)")
        return job.asynchronous

    def _admit_async(self, job: Job, header: pb.UpdateHeader) -> Receipt | AfterClose | None:
        with self._lock:
            state = self._async(job)
            first = state.receipt(header.worker_id, header.round)
            if first is not None:  # a retry of an accepted upload: its first receipt, counted once
                receipt = Receipt(header.job_id, header.round, header.worker_id, True, first.bytes_received,
                                  first.sha256)
                if state.closed:  # the job ended: only that very update gets it back
                    return AfterClose(receipt, f"job {header.job_id!r} has ended: its buffer is closed")
                return receipt
            issued = self._outstanding(state, header)
            self._check_fresh(job, state, issued, header)
            shapes = parameter_shapes(job.spec)
            limit = state.sample_limit(header.job_id, header.worker_id)
        admission.check_header(header, shapes, max_samples=limit)
        return None

    @staticmethod
    def _outstanding(state: AsyncState, header: pb.UpdateHeader) -> Issued:
        issued = state.outstanding(header.worker_id, header.round)
        if state.closed:
            raise UploadRejected(Rejection.ROUND_CLOSED, f"job {header.job_id!r} has ended: its buffer is closed")
        if issued is None:
            raise UploadRejected(Rejection.ROUND_CLOSED, f"task {header.round} of job {header.job_id!r} is not worker "
                                                         f"{header.worker_id!r}'s outstanding task")
        return issued

    @staticmethod
    def _check_fresh(job: Job, state: AsyncState, issued: Issued, header: pb.UpdateHeader) -> int:
        tau = job.version - issued.base
        try:
            state.buffer.check(tau)
        except StaleUpdate as exc:
            state.refused_stale += 1
            raise UploadRejected(Rejection.STALE, f"worker {header.worker_id!r}, task {header.round}: trained from "
                                                  f"version {issued.base}, the newest is {job.version}: {exc}") from None
        if issued.base not in job.versions:  # kept for as long as max_staleness allows
            raise UploadRejected(Rejection.STALE, f"version {issued.base} of job {header.job_id!r} is no longer kept")
        return tau

    def _accept_async(self, header: pb.UpdateHeader, tensors: dict[str, np.ndarray], digest: str) -> Receipt:
        """Fold an update into the buffer: its file is on disk before the receipt goes back; a buffer that
        fills makes the next version, on disk (global model, then the record) before the receipt too."""
        job = self._job(header.job_id)
        size = sum(arr.nbytes for arr in tensors.values())
        meta = UpdateMeta(worker_id=header.worker_id, num_samples=int(header.num_samples),
                          ish=header.ish if header.has_ish else None, loss=header.validation_loss or header.train_loss)
        with self._accept_lock:  # one accept at a time: the buffer and the versions change only here
            with self._lock:
                state = self._async(job)
                first = state.receipt(header.worker_id, header.round)
                if first is not None:
                    return Receipt(header.job_id, header.round, header.worker_id, True, first.bytes_received,
                                   first.sha256)
                issued = self._outstanding(state, header)
                tau = self._check_fresh(job, state, issued, header)
                try:
                    raw = float(state.algorithms.weighting.raw_weight(meta))
                except ValueError as exc:
                    raise UploadRejected(Rejection.BAD_HEADER, str(exc)) from exc
                if not (raw > 0 and np.isfinite(raw)):
                    raise UploadRejected(Rejection.BAD_HEADER, f"the update's weight must be positive, got {raw:g}")
                entry = Folded(header.worker_id, header.round, issued.base, tau, raw, state.buffer.staleness(tau),
                               meta.num_samples, header.epsilon, header.train_loss, digest, size)
                base = job.versions[issued.base]
                seq = len(state.folded)
            if self._spool is not None:
                self._spool.save_buffered(job.job_id, job.version, seq, folded_record(entry, seq), tensors)
            with self._lock:
                state.fold(entry, tensors, base)
                self._touch(job)
            metrics.STALENESS.observe(tau)
            metrics.BUFFERED.inc()
            if state.buffer.full:
                self._publish_version(job, state)
        return Receipt(header.job_id, header.round, header.worker_id, False, size, digest)

    def _publish_version(self, job: Job, state: AsyncState) -> None:
        """The full buffer becomes the next global version (the caller holds `_accept_lock`)."""
        version = job.version + 1
        new_state = state.buffer.apply(job.versions[job.version])
        spec_json = job.specs[job.version]
        if self._spool is not None:
            self._spool.save_global(job.job_id, version, spec_json, new_state)
        with self._lock:
            job.versions[version] = new_state
            job.specs[version] = spec_json
            for old in [v for v in job.versions if v < version - max(state.max_staleness, 1)]:
                del job.versions[old]
                job.specs.pop(old, None)
            state.publish(version, self.clock())
            self._commit(job)
        metrics.VERSIONS.inc()
        metrics.BUFFERED.dec(state.buffer.buffer_size)
        log.info("job %s: version %d published from %d buffered update(s)", job.job_id, version,
                 state.buffer.buffer_size)

    # ----- the spool -----

    def _commit(self, job: Job) -> None:
        """Write the job's record (under `_lock`); its global versions are on disk already. Watchers hear of it."""
        if self._spool is not None:
            self._spool.save_record(job.job_id, job_record(job))
        self._touch(job)

    # ----- events -----

    def _touch(self, job: Job) -> None:
        """The job changed (under `_lock`): wake the watchers."""
        self._generation += 1
        self._changed_at[job.job_id] = self._generation
        self._watchers.notify_all()

    def watch(self, after: int, timeout: float) -> tuple[int, list[JobSnapshot]]:
        """Wait up to `timeout` for a change after generation `after` (0: everything); the generation reached
        and a snapshot of every job that changed since `after` (none on a timeout)."""
        with self._watchers:
            self._watchers.wait_for(lambda: self._generation > after, timeout)
            changed = [self._jobs[j] for j, g in self._changed_at.items() if g > after and j in self._jobs]
            return self._generation, [snapshot(job) for job in changed]

    def _job(self, job_id: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise UnknownJob(f"unknown job {job_id!r}")
        return job


def _closed_during_upload(header: pb.UpdateHeader) -> UploadRejected:
    return UploadRejected(Rejection.ROUND_CLOSED, f"round {header.round} of job {header.job_id!r} closed during the upload")
