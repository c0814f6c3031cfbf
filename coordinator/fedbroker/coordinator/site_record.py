"""A site's own record at the coordinator (the SiteRecord call): what `fedbroker ledger` on the site compares
with its ledger. With authentication on only a worker identity may ask, and only for itself (`who_may_read`):
the record says which jobs the site served and the ε it reported, which is the site's business, not the
other sites' nor the scientists' (they see the total per worker in Status)."""

from __future__ import annotations

import time

from fedbroker.coordinator.store import StateStore
from fedbroker.errors import ConfigError, NotFound, Rejection, UploadRejected
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.auth import ROLE_WORKER, Identity


def who_may_read(caller: Identity | None, worker_id: str) -> str:
    """The worker whose record the caller may read: `worker_id` ("" = the caller's own). Refused, naming why,
    unless the caller is that worker (authentication off: anyone, for a named worker)."""
    if caller is None:
        if not worker_id:
            raise ConfigError("worker_id", "name the worker whose record to read (authentication is off here, so "
                                           "the caller's identity cannot name it)")
        return worker_id
    if caller.role != ROLE_WORKER:  # the interceptor admits only workers; kept here so the rule reads whole
        raise UploadRejected(Rejection.PERMISSION_DENIED, f"{caller.name!r} (role {caller.role}) is not a site: "
                                                          f"only a site may read its own record")
    if worker_id and worker_id != caller.name:
        raise UploadRejected(Rejection.PERMISSION_DENIED, f"{caller.name!r} may read only its own record, not "
                                                          f"worker {worker_id!r}'s")
    return caller.name


def site_record_reply(store: StateStore, worker_id: str, *, heartbeat_timeout_s: float) -> pb.SiteRecordReply:
    """The worker's registration row, the ε recorded for it, and its jobs; NotFound when it never registered."""
    worker = next((w for w in store.workers() if w.worker_id == worker_id), None)
    if worker is None:
        raise NotFound(f"no worker {worker_id!r} is registered at this coordinator: it has no record here (a site "
                       f"that never connected, or a coordinator whose state was lost)")
    since = time.time() - worker.last_seen
    reply = pb.SiteRecordReply(epsilon_recorded=worker.epsilon_spent)
    reply.worker.CopyFrom(pb.WorkerRow(
        worker_id=worker.worker_id, device=worker.device, epsilon_spent=worker.epsilon_spent,
        epsilon_budget=worker.dp.epsilon_budget if worker.dp.enabled else 0.0, last_seen_seconds_ago=since,
        active=since <= heartbeat_timeout_s))
    for job in store.site_jobs(worker_id):
        reply.jobs.add(job_id=job.job_id, status=job.status, epsilon=job.epsilon, rounds=job.rounds,
                       shared=list(job.shared))
    return reply
