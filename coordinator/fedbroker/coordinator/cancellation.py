"""Ending a cancelled job in its own thread: what was under way at the aggregation service is dropped, never
made into a version, and the store records the job cancelled with the ε its discarded uploads cost.

A coordinator that stops before the service answers leaves the job `cancelling` in the store: the next
start finishes the cancel.
"""

from __future__ import annotations

import logging

from fedbroker.coordinator import metrics
from fedbroker.coordinator.asynchronous import record_not_aggregated
from fedbroker.coordinator.job_context import JobContext
from fedbroker.coordinator.job_run import Stopped
from fedbroker.errors import Rejection
from fedbroker.job.status import RoundStatus
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.plumbing import RemoteError

log = logging.getLogger(__name__)


def cancel_job(ctx: JobContext, job_id: str) -> None:
    """Abandon the job's open round at the aggregation service (its uploads are dropped, never aggregated:
    no version comes of it; a worker still training gets `round_closed` for its upload, and a worker yet to
    start finds the round closed and trains nothing) and record the job cancelled, with the ε the discarded
    uploads cost their workers."""
    by = ctx.cancels.requested_by(job_id)
    row = ctx.store.job(job_id)
    if row is not None and row.mode == "async":
        _cancel_async_job(ctx, job_id, by)
        return
    open_rounds = [r.round for r in ctx.store.rounds(job_id) if r.status == RoundStatus.OPEN]
    round_number = open_rounds[-1] if open_rounds else None
    discarded: list[pb.UpdateSummary] = []
    if round_number is not None:
        try:
            discarded = ctx.calls.call(job_id, f"abandon round {round_number}",
                                       lambda: ctx.aggregator.abandon_round(job_id, round_number))
        except Stopped:  # still `cancelling` in the store: the next start finishes it
            log.info("job %s: cancel left to the next start (the coordinator is stopping)", job_id)
            return
        except RemoteError as exc:  # a service that lost the job holds no round to abandon
            if exc.reason != Rejection.UNKNOWN_JOB:
                log.error("round %d of cancelled job %s could not be abandoned at the aggregation service "
                          "(%s): it is never closed, so no version comes of it", round_number, job_id, exc)
    ctx.store.cancel_job(job_id, by=by, round_number=round_number,
                         discarded=[(u.worker_id, u.num_samples, u.epsilon, u.train_loss) for u in discarded])
    metrics.ROUND_OPEN.labels(job_id).set(0)
    log.info("job %s cancelled%s%s", job_id, f" by {by}" if by else "",
             f"; round {round_number} abandoned ({len(discarded)} upload(s) discarded)"
             if round_number is not None else "")


def _cancel_async_job(ctx: JobContext, job_id: str, by: str) -> None:
    """An asynchronous job has no round to abandon: its buffer is closed at the service, so outstanding
    tasks end, late uploads are refused and the updates still in the buffer never become a version."""
    try:
        closed = ctx.calls.call(job_id, "close the buffer", lambda: ctx.aggregator.close_buffer(job_id))
        record_not_aggregated(ctx, job_id, [(u, "in the buffer when the job was cancelled") for u in closed.discarded])
    except Stopped:  # still `cancelling` in the store: the next start finishes it
        log.info("job %s: cancel left to the next start (the coordinator is stopping)", job_id)
        return
    except RemoteError as exc:
        if exc.reason != Rejection.UNKNOWN_JOB:
            log.error("the buffer of cancelled job %s could not be closed at the aggregation service (%s): "
                      "no version is recorded for it from now on", job_id, exc)
    ctx.store.cancel_job(job_id, by=by)
    metrics.ROUND_OPEN.labels(job_id).set(0)
