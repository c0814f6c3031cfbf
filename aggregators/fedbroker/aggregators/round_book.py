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

The book is the thin front of its parts, and keeps the sync rounds' uploads and closes itself: `job_table`
(the jobs, their locks, the commits and the watchers: the public collaborator every part receives),
`admission` (may this upload enter?), `job_state` (the rounds' state machine, the job's algorithms), `rows`
(which update lives in which row), `combine` (the close), `async_buffers` (asynchronous mode, FedBuff),
`secure_rounds` (aggregation.secure) and `spool` (the records on disk). Each decides what is on disk before
which of its replies.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from fedbroker.aggregators import admission
from fedbroker.aggregators.async_buffers import AsyncBuffers
from fedbroker.aggregators.async_state import AsyncState, Folded, Issued
from fedbroker.aggregators.combine import ProbeLoader, combine
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
)
from fedbroker.aggregators.job_table import JobTable, closed_during_upload, receiving
from fedbroker.aggregators.ownership import JobOwnership
from fedbroker.aggregators.probe_sets import probe_arrays
from fedbroker.aggregators.rows import Reservation
from fedbroker.aggregators.secure_rounds import SecureRounds, new_session
from fedbroker.aggregators.spool import Spool, update_record
from fedbroker.aggregators.spool_restore import restore_jobs, restore_one
from fedbroker.aggregators.weighting.base import UpdateMeta
from fedbroker.errors import ConfigError, NotFound, Rejection, UploadRejected
from fedbroker.job.spec import ModelSpec, parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec
from fedbroker.secagg.secure_round import UNMASK_WAIT_S
from fedbroker.weights.plan import ModelPlan, all_shapes, trainable_shapes

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
        site_dp_seed: int | None = None,
        ownership: JobOwnership | None = None,
    ) -> None:
        self.max_update_bytes = max_update_bytes
        self.probe_sets = probe_sets  # (dataset, size, seed) -> (x, y): the probe sets the GA's fitness reads
        self.selection_time_limit_s = selection_time_limit_s
        self.alignment_time_limit_s = alignment_time_limit_s  # then the close falls back to the weighted mean
        self.site_dp_seed = site_dp_seed  # privacy.site's noise: None (production) draws it from os.urandom
        if ownership is not None and not spool_dir:
            raise ConfigError("aggregator.spool_dir", "aggregation replicas (aggregator.database_url) need a spool "
                                                      "every replica reaches: a shared volume's folder")
        spool = Spool(spool_dir, lock_wait_s=spool_lock_wait_s,  # SpoolInUse: held (one service, no replicas)
                      fence=ownership.fenced if ownership is not None else None) if spool_dir else None
        self.table = JobTable(clock=clock, spool=spool, ownership=ownership)
        try:
            self.installed = InstalledJobs(spool, claim=None if ownership is None else  # each job's settings (InstallJob)
                                           lambda job_id: self.table.claim(job_id, create=True))
            self.buffers = AsyncBuffers(self.table, self.installed)
            self.secure = SecureRounds(self.table, unmask_s=secure_unmask_s)
            if ownership is not None and spool is not None:  # replicas: each job loaded when this one takes it
                ownership.bind(exists=spool.has_job, take=self._take_over, drop=self._drop)
            elif spool is not None:
                self._restore(spool)
        except BaseException:
            self.stop()  # a book that failed to start holds no folder
            raise

    def _restore(self, spool: Spool) -> None:
        jobs = self.table.jobs
        for job in restore_jobs(spool, self.installed.for_round):  # a record that does not load is quarantined, not fatal
            jobs[job.job_id] = job
        if jobs:
            log.info("restored %d job(s) from the spool %s", len(jobs), spool.root)
        for job in jobs.values():
            self.buffers.restored(job)

    def _take_over(self, job_id: str) -> None:
        """This replica now owns the job (`JobOwnership.ensure`): its settings and its state from the shared
        spool, as a restarted service restores them (an open secure round fails: its keys died with its owner)."""
        spool = self.table.spool
        assert spool is not None  # replicas always have one (__init__)
        self.installed.load(job_id)
        job = restore_one(spool, job_id, self.installed.for_round)
        if job is None:
            return  # installed, no model yet (or a record that did not load: quarantined)
        with self.table.lock:
            self.table.jobs[job_id] = job
            self.table.touch(job)
        self.buffers.restored(job)

    def _drop(self, job_id: str) -> None:
        """Another replica owns the job now: forget it here (its files stay, they are the new owner's)."""
        with self.table.lock:
            self.table.jobs.pop(job_id, None)
        self.installed.forget(job_id)

    def stop(self) -> None:
        """The service stopped: release the spool for the next service on it once the writes under way have
        ended. This book's threads still running (gRPC cannot stop a handler) then fail on any write
        (`SpoolClosed`) instead of changing files the next service's records name. Idempotent."""
        if self.table.spool is not None:
            self.table.spool.close()
        if self.table.ownership is not None:  # another replica may take each job at once
            self.table.ownership.stop()

    # ----- global model -----

    def put_global(self, job_id: str, version: int, spec_json: str, tensors: Mapping[str, np.ndarray]) -> None:
        """Install a job's initial (or restored) global model; it must match its spec exactly."""
        if not job_id:
            raise UploadRejected(Rejection.BAD_HEADER, "job_id is empty")
        spec = parse_model(json.loads(spec_json))
        admission.check_global_model(all_shapes(spec, self._plan(job_id)), tensors)
        state = {name: np.array(arr, dtype=np.float32) for name, arr in tensors.items()}
        self.table.claim(job_id, create=True)
        with self.table.lock:
            job = self.table.jobs.get(job_id)
            if job is not None and job.holds(version, spec_json, state):
                return  # a restarted coordinator re-installing what we hold: keep the open round and its uploads
        if self.table.spool is not None:
            self.table.spool.save_global(job_id, version, spec_json, state)
        with self.table.lock:
            job = self.table.jobs.get(job_id)
            if job is None:
                job = self.table.jobs[job_id] = Job(job_id, spec, 0, {version: state}, {version: spec_json})
            else:
                job.install(version, spec, spec_json, state)
            self.table.commit(job)

    def _plan(self, job_id: str) -> ModelPlan:
        """The job's model plan (what trains); the default plan for a job whose settings are not installed."""
        try:
            return self.installed.get(job_id).installed.plan
        except NotFound:
            return ModelPlan()

    def global_model(self, job_id: str, version: int = 0) -> tuple[int, str, dict[str, np.ndarray]]:
        """A kept global version (0: the newest), with its spec: what workers download."""
        job = self.table.job(job_id)
        with self.table.lock:
            v = version or job.version
            if v not in job.versions:
                raise NotFound(f"job {job_id!r} has no global model version {v} (kept: {sorted(job.versions)})")
            return v, job.specs[v], job.versions[v]

    def settings_for(self, job_id: str, worker_id: str) -> pb.JobSettings:
        """A job's installed settings for one of its participants (a worker that lost them: it restarted); a
        worker the job never asked for an update learns nothing of it."""
        job, installed = self.table.job(job_id), self.installed.get(job_id).installed
        with self.table.lock:
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
        job = self.table.job(job_id)
        members = frozenset(participants)
        if not members:
            raise UploadRejected(Rejection.BAD_REQUEST, f"round {round_number} of job {job_id!r} has no participants")
        algorithms = self.installed.for_round(job_id, aggregation)
        section = asdict(algorithms.installed.aggregation)
        counts = {w: [int(c) for c in h] for w, h in (histograms or {}).items()}
        limits = {w: int(n) for w, n in (num_samples or {}).items()}
        clock = self.table.clock
        with self.table.lock:
            changed = job.open(round_number, members, deadline, seed=seed, build=lambda: new_round(
                round_number, members, deadline, algorithms, section, counts, job.spec, job.spare_rows,
                sample_limits=limits, secure=new_session(job_id, round_number, job.version, members, job.spec,
                                                         opened=clock(), deadline=deadline, clock=clock,
                                                         group_size=algorithms.installed.aggregation.secure_group_size,
                                                         distributed=algorithms.installed.privacy.distributed,
                                                         limits=limits)
                if algorithms.installed.aggregation.secure else None))
            if changed:
                self.table.commit(job)
            return job.version

    def status(self, job_id: str, round_number: int) -> tuple[list[str], bool]:
        """Who got in, and whether the round is open; in async mode `round_number` is a task number: its
        worker if that task's update was accepted, and open while the task is outstanding."""
        job = self.table.job(job_id)
        with self.table.lock:
            state = job.asynchronous
            return state.task_status(round_number) if state is not None else job.status(round_number)

    def worker_status(self, job_id: str, round_number: int, worker_id: str) -> tuple[bool, bool]:
        """`status` for one worker: whether its update is in, and whether the round (async: its task numbered
        `round_number`, open while outstanding) still takes it."""
        job = self.table.job(job_id)
        with self.table.lock:
            state = job.asynchronous
            if state is not None:
                return state.worker_task_status(worker_id, round_number)
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
        job = self.table.jobs[header.job_id]
        if job.asynchronous is not None:
            tensors, digest = codec.receive_payload(stream, header, size, buffer=None)
            job.check_update(tensors, who=f"worker {header.worker_id!r}",
                             declared=self.installed.get(header.job_id).max_update_value)
            return self.buffers.accept(header, tensors, digest)
        reservation = self._reserve(header)
        try:
            tensors, digest = codec.receive_payload(stream, header, size,
                                                    buffer=reservation.slot.bytes if reservation else None)
            job.check_update(tensors, who=f"worker {header.worker_id!r}",
                             declared=self.installed.get(header.job_id).max_update_value)
            return self._accept(header, tensors, digest, reservation)
        finally:
            if reservation is not None:
                with self.table.lock:  # a refused upload gives its row back
                    reservation.release_unused()

    def _admit(self, header: pb.UpdateHeader) -> Receipt | AfterClose | None:
        """None for a new update that may be received; the first receipt for a retry while its round is open
        (after the close: what to judge it by once read); else UploadRejected."""
        self.table.claim(header.job_id)
        job = self.table.jobs.get(header.job_id)
        if job is None:
            raise UploadRejected(Rejection.UNKNOWN_JOB, f"unknown job {header.job_id!r}")
        if job.asynchronous is not None:
            return self.buffers.admit(job, header)
        with self.table.lock:
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
            admission.check_membership(header, standing, now=self.table.clock())
            plan = rnd.algorithms.installed.plan if rnd is not None else self._plan(job.job_id)
            shapes, secure = trainable_shapes(job.spec, plan), rnd.secure if rnd is not None else None
        if secure is not None or header.masked:  # a secure round's masked vector (or a masked upload elsewhere)
            SecureRounds.check_header(header, secure)
        else:
            admission.check_trains(header, job.spec, plan)
            admission.check_header(header, shapes, max_samples=standing.sample_limits.get(header.worker_id))
        return None

    def _reserve(self, header: pb.UpdateHeader) -> Reservation | None:
        """A free row of the round's rows to receive into, so accepting the update copies nothing."""
        with self.table.lock:
            rnd = self.table.jobs[header.job_id].round
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
        job = self.table.job(header.job_id)
        size = sum(arr.nbytes for arr in tensors.values())
        with self.table.accept_lock:
            with self.table.lock:
                rnd = receiving(job, header)
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
            if self.table.spool is not None:
                spooled = self.table.spool.save_update(job.job_id, rnd.number, seq, update_record(entry, seq), tensors)
            with self.table.lock:
                if job.round is not rnd or rnd.closed:
                    if spooled is not None and self.table.spool is not None:
                        self.table.spool.discard(spooled, job.job_id)
                    raise closed_during_upload(header)
                rnd.accept(entry, tensors, reservation.take(rnd.rows) if reservation is not None else None)
                self.table.touch(job)
        return Receipt(header.job_id, header.round, header.worker_id, False, size, digest)

    def close(self, job_id: str, round_number: int) -> CloseResult:
        """Aggregate what was accepted into the next global version.

        Safe to repeat: a close of a round that is being closed waits for that close and returns its result
        (or, if it failed and the round is open again, closes it itself); a close of the last closed round
        returns its result again.
        """
        started = time.perf_counter()
        job = self.table.job(job_id)
        with self.table.closed:
            while True:
                repeated = job.repeated_close(round_number)
                if repeated is not None:
                    return repeated  # a repeated close (the coordinator lost our reply, or restarted)
                if not job.closing(round_number):
                    break
                self.table.closed.wait()  # the first close is aggregating: its result is ours too
            rnd = job.begin_close(round_number)
            accepted = dict(rnd.accepted)
            current = job.versions[job.version]
            spec = job.spec
        try:
            return self._close(job, rnd, accepted, current, spec, started)
        except BaseException:
            with self.table.lock:  # nothing changed: the round stays open and the coordinator may close it again
                job.abort_close(rnd)
            raise
        finally:
            with self.table.closed:  # a repeated close waiting for this one: its result (or the round) is there
                self.table.closed.notify_all()

    def abandon(self, job_id: str, round_number: int) -> list[UpdateSummary]:
        """Drop a cancelled job's open round without aggregating it (`Job.abandon`); the discarded uploads.
        A close under way is waited for first, so an abandon never cuts an aggregation in half."""
        job = self.table.job(job_id)
        with self.table.closed:
            while job.closing(round_number):
                self.table.closed.wait()
            dropped = job.abandon(round_number)
            self.table.commit(job)  # the record no longer names the round: the spool prunes its uploads
        return [UpdateSummary(a.worker_id, a.num_samples, a.epsilon, a.train_loss, 0.0) for a in dropped]

    def _close(self, job: Job, rnd: Round, accepted: dict[str, Accepted], current: dict[str, np.ndarray],
               spec: ModelSpec, started: float) -> CloseResult:
        combined = self.secure.combine_secure(rnd, current, spec) if rnd.secure is not None else combine(
            rnd, accepted, current, spec, seed=job.seed, selection_time_limit_s=self.selection_time_limit_s,
            alignment_time_limit_s=self.alignment_time_limit_s, probe_sets=self.probe_sets,
            site_clip=job.site_clip, noise_seed=self.site_dp_seed, memory=job.robust_memory)
        coefficient = dict(zip(combined.chosen, combined.weights))
        updates = [
            UpdateSummary(w, a.num_samples, a.epsilon, a.train_loss, float(coefficient.get(w, 0.0)))
            for w, a in sorted(accepted.items())
        ]
        version = job.version + 1
        new_spec_json = combined.spec.to_json()
        if self.table.spool is not None:
            self.table.spool.save_global(job.job_id, version, new_spec_json, combined.state)
            if combined.memory is not None:
                self.table.spool.save_robust(job.job_id, version, combined.memory)
        seconds = time.perf_counter() - started
        result = combined.report(version, new_spec_json, seconds, updates)
        with self.table.lock:
            job.finish_close(rnd, result, current, combined.state, combined.spec, combined.memory)
            if combined.site_clip is not None:  # committed with the version: a restart resumes from it
                job.site_clip = combined.site_clip
            self.table.commit(job)
        return result

    # ----- asynchronous mode (FedBuff): `async_buffers` -----

    def open_buffer(self, job_id: str, config: Mapping[str, Any], *,
                    num_samples: Mapping[str, int] | None = None) -> int:
        """Put the job in asynchronous mode (`AsyncBuffers.open_buffer`)."""
        return self.buffers.open_buffer(job_id, config, num_samples=num_samples)

    def issue_tasks(self, job_id: str, workers: Sequence[str], *,
                    num_samples: Mapping[str, int] | None = None) -> list[tuple[str, Issued]]:
        """A new task on the newest version for each worker (`AsyncBuffers.issue_tasks`)."""
        return self.buffers.issue_tasks(job_id, workers, num_samples=num_samples)

    def close_buffer(self, job_id: str) -> tuple[int, list[Folded]]:
        """The job ended (`AsyncBuffers.close_buffer`)."""
        return self.buffers.close_buffer(job_id)

    def buffer_status(self, job_id: str, since_version: int = 0) -> tuple[int, AsyncState]:
        """The newest version and the async state (`AsyncBuffers.buffer_status`)."""
        return self.buffers.buffer_status(job_id, since_version)

    # ----- events -----

    def watch(self, after: int, timeout: float) -> tuple[int, list[JobSnapshot]]:
        """Wait up to `timeout` for a change after generation `after` (`JobTable.watch`)."""
        return self.table.watch(after, timeout)
