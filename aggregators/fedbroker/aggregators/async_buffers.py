"""The round book's asynchronous mode (FedBuff): a job's buffer, its tasks, and the versions it publishes.

Beside `round_book`, which passes on the coordinator's buffer calls and the uploads of a job in this mode.
The state itself (tasks, receipts, the buffer) is `async_state`, the arithmetic `fedbuff`; here are the
rules for what is on disk before which reply: a folded update's file before its receipt, and a buffer that
fills becomes the next global version (its model, then the job's record) before that receipt too. A
restart finishes a version whose buffer was full when the service died (`restored`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
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
from fedbroker.aggregators.fedbuff import StaleUpdate
from fedbroker.aggregators.installed_jobs import InstalledJobs
from fedbroker.aggregators.job_state import AfterClose, Job, Receipt
from fedbroker.aggregators.job_table import JobTable
from fedbroker.aggregators.weighting.base import UpdateMeta
from fedbroker.errors import ConfigError, Conflict, Rejection, UploadRejected
from fedbroker.job.spec import parameter_shapes
from fedbroker.proto import fedbroker_pb2 as pb

log = logging.getLogger(__name__)


class AsyncBuffers:
    """The buffer calls of one round book's jobs (see the module docstring)."""

    def __init__(self, table: JobTable, installed: InstalledJobs) -> None:
        self.table = table
        self.installed = installed

    def open_buffer(self, job_id: str, config: Mapping[str, Any], *,
                    num_samples: Mapping[str, int] | None = None) -> int:
        """Put the job in asynchronous mode (idempotent: a job already in it keeps its buffer and tasks).
        `config`: aggregation, buffer_size, max_staleness, staleness, staleness_params, server_lr, seed."""
        table = self.table
        job = table.job(job_id)
        with table.lock:
            algorithms = self.installed.for_round(job_id, config.get("aggregation"))
            if algorithms.installed.privacy.site.enabled:  # the buffer would fold unclipped, un-noised updates
                raise ConfigError("privacy.site", "needs schedule.mode sync (the buffer does not clip or noise)")
            state = new_async_state(dict(config), {w: int(n) for w, n in (num_samples or {}).items()}, algorithms)
            if job.asynchronous is not None:
                job.asynchronous.sample_limits.update(state.sample_limits)  # workers registered since
                table.commit(job)
                return job.version
            if job.round is not None and not job.round.closed:
                raise Conflict(f"job {job_id!r} has an open round: it is not in asynchronous mode")
            job.asynchronous = state
            job.seed = int(config.get("seed", 0))
            metrics.BUFFER_CAPACITY.inc(state.buffer.buffer_size)
            table.commit(job)
            return job.version

    def issue_tasks(self, job_id: str, workers: Sequence[str], *,
                    num_samples: Mapping[str, int] | None = None) -> list[tuple[str, Issued]]:
        """A new task on the newest version for each worker, on disk before the reply (the coordinator
        publishes the tasks only then); a worker's previous task is superseded. `num_samples`: the workers'
        registered sample counts (each worker needs one, sent now or known from before: `AsyncState.issue`)."""
        job = self.table.job(job_id)
        if len(set(workers)) != len(workers) or not all(isinstance(w, str) and w for w in workers):
            raise UploadRejected(Rejection.BAD_REQUEST, "workers must be distinct, non-empty ids")
        limits = {w: int(n) for w, n in (num_samples or {}).items()}
        with self.table.lock:
            state = _async(job)
            if state.closed:
                raise Conflict(f"the buffer of job {job_id!r} is closed: the job ended")
            issued = state.issue(list(workers), job.version, limits)
            self.table.commit(job)
            return issued

    def close_buffer(self, job_id: str) -> tuple[int, list[Folded]]:
        """The job ended (idempotent): outstanding tasks end, nothing more is issued or accepted. The newest
        version, and the buffer's updates: accepted, in no version (the coordinator records their ε)."""
        job = self.table.job(job_id)
        with self.table.accept_lock, self.table.lock:
            state = _async(job)
            if state.close():
                metrics.BUFFER_CAPACITY.dec(state.buffer.buffer_size)
                metrics.BUFFERED.dec(len(state.folded))
                self.table.commit(job)
            return job.version, list(state.folded)

    def buffer_status(self, job_id: str, since_version: int = 0) -> tuple[int, AsyncState]:
        """The newest version and the async state (read under the lock; the caller copies what it needs)."""
        job = self.table.job(job_id)
        with self.table.lock:
            state = _async(job)
            return job.version, copy_for_status(state, since_version)

    def restored(self, job: Job) -> None:
        """A restored async job: its buffer counts in the metrics, and a buffer that was full when the service
        died (every update's receipt sent, the version not yet committed) becomes that version now."""
        state = job.asynchronous
        if state is None:
            return
        metrics.BUFFER_CAPACITY.inc(state.buffer.buffer_size)
        metrics.BUFFERED.inc(len(state.folded))
        if state.buffer.full:
            with self.table.accept_lock:
                self.publish_version(job, state)

    # ----- uploads -----

    def admit(self, job: Job, header: pb.UpdateHeader) -> Receipt | AfterClose | None:
        """None for a new update the worker's outstanding task may send; the first receipt for a retry (after
        the buffer closed: what to judge it by once read); else UploadRejected."""
        with self.table.lock:
            state = _async(job)
            first = state.receipt(header.worker_id, header.round)
            if first is not None:  # a retry of an accepted upload: its first receipt, counted once
                receipt = Receipt(header.job_id, header.round, header.worker_id, True, first.bytes_received,
                                  first.sha256)
                if state.closed:  # the job ended: only that very update gets it back
                    return AfterClose(receipt, f"job {header.job_id!r} has ended: its buffer is closed")
                return receipt
            issued = _outstanding(state, header)
            _check_fresh(job, state, issued, header)
            shapes = parameter_shapes(job.spec)
            limit = state.sample_limit(header.job_id, header.worker_id)
        admission.check_header(header, shapes, max_samples=limit)
        return None

    def accept(self, header: pb.UpdateHeader, tensors: dict[str, np.ndarray], digest: str) -> Receipt:
        """Fold an update into the buffer: its file is on disk before the receipt goes back; a buffer that
        fills makes the next version, on disk (global model, then the record) before the receipt too."""
        table = self.table
        job = table.job(header.job_id)
        size = sum(arr.nbytes for arr in tensors.values())
        meta = UpdateMeta(worker_id=header.worker_id, num_samples=int(header.num_samples),
                          ish=header.ish if header.has_ish else None, loss=header.validation_loss or header.train_loss)
        with table.accept_lock:  # one accept at a time: the buffer and the versions change only here
            with table.lock:
                state = _async(job)
                first = state.receipt(header.worker_id, header.round)
                if first is not None:
                    return Receipt(header.job_id, header.round, header.worker_id, True, first.bytes_received,
                                   first.sha256)
                issued = _outstanding(state, header)
                tau = _check_fresh(job, state, issued, header)
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
            if table.spool is not None:
                table.spool.save_buffered(job.job_id, job.version, seq, folded_record(entry, seq), tensors)
            with table.lock:
                state.fold(entry, tensors, base)
                table.touch(job)
            metrics.STALENESS.observe(tau)
            metrics.BUFFERED.inc()
            if state.buffer.full:
                self.publish_version(job, state)
        return Receipt(header.job_id, header.round, header.worker_id, False, size, digest)

    def publish_version(self, job: Job, state: AsyncState) -> None:
        """The full buffer becomes the next global version (the caller holds `accept_lock`)."""
        table = self.table
        version = job.version + 1
        new_state = state.buffer.apply(job.versions[job.version])
        spec_json = job.specs[job.version]
        if table.spool is not None:
            table.spool.save_global(job.job_id, version, spec_json, new_state)
        with table.lock:
            job.versions[version] = new_state
            job.specs[version] = spec_json
            for old in [v for v in job.versions if v < version - max(state.max_staleness, 1)]:
                del job.versions[old]
                job.specs.pop(old, None)
            state.publish(version, table.clock())
            table.commit(job)
        metrics.VERSIONS.inc()
        metrics.BUFFERED.dec(state.buffer.buffer_size)
        log.info("job %s: version %d published from %d buffered update(s)", job.job_id, version,
                 state.buffer.buffer_size)


def _async(job: Job) -> AsyncState:
    if job.asynchronous is None:
        raise Conflict(f"job {job.job_id!r} is not in asynchronous mode (OpenBuffer first)")
    return job.asynchronous


def _outstanding(state: AsyncState, header: pb.UpdateHeader) -> Issued:
    issued = state.outstanding(header.worker_id, header.round)
    if state.closed:
        raise UploadRejected(Rejection.ROUND_CLOSED, f"job {header.job_id!r} has ended: its buffer is closed")
    if issued is None:
        raise UploadRejected(Rejection.ROUND_CLOSED, f"task {header.round} of job {header.job_id!r} is not worker "
                                                     f"{header.worker_id!r}'s outstanding task")
    return issued


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
