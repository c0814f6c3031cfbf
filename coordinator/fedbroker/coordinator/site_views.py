"""The operator's view of the sites over gRPC (ListSites, SiteDetail, SiteLogs: `fedbroker sites`): every site
that ever registered, with what its registration and heartbeats said, the ε recorded for it, its jobs, its own
history and the warnings and errors it forwarded. Scientists and viewers may read it; a site may not (it would
learn the other sites' data shapes, policies and ε: service.PERMISSIONS).

Every text that came from a site was stripped of control characters when it was stored (store_sites.py)."""

from __future__ import annotations

import time

from fedbroker.coordinator.records import SiteInfo, WorkerRecord
from fedbroker.coordinator.store import StateStore
from fedbroker.errors import NotFound
from fedbroker.job.status import FINISHED
from fedbroker.proto import fedbroker_pb2 as pb

DEFAULT_LOG_RECORDS = 200


def site_row(store: StateStore, w: WorkerRecord, info: SiteInfo | None, *, heartbeat_timeout_s: float,
             now: float, revoked: bool = False) -> pb.SiteRow:
    """One site as `fedbroker sites list` shows it; a revoked one (no broker user may speak for it: never selected)
    is inactive, in state `revoked`, whatever its last heartbeat said."""
    jobs = store.site_jobs(w.worker_id)
    current = sum(j.status not in FINISHED for j in jobs)
    row = pb.SiteRow(
        worker_id=w.worker_id, last_heartbeat_unix=w.last_seen, last_seen_seconds_ago=max(0.0, now - w.last_seen),
        active=not revoked and now - w.last_seen <= heartbeat_timeout_s, state="revoked" if revoked else w.state,
        categories=list(w.categories),
        input_shape=list(w.input_shape), num_classes=w.num_classes, num_samples=w.num_samples, device=w.device,
        dp_enabled=w.dp.enabled, epsilon_recorded=w.epsilon_spent, current_jobs=current, past_jobs=len(jobs) - current)
    if w.dp.enabled:
        row.dp_policy.CopyFrom(pb.DPPolicy(noise_multiplier=w.dp.noise_multiplier, max_grad_norm=w.dp.max_grad_norm,
                                           delta=w.dp.delta, epsilon_budget=w.dp.epsilon_budget, mode=w.dp.mode,
                                           local_floor_epsilon=w.dp.local_floor_epsilon))
    if info is not None:
        row.software_version, row.first_registered_unix = info.software_version, info.first_registered
        row.restarts, row.broker_user, row.log_records = info.restarts, info.broker_user, info.log_records
        row.last_error, row.last_error_unix = info.last_error, info.last_error_time or 0.0
    return row


def list_sites_reply(store: StateStore, *, heartbeat_timeout_s: float,
                     revoked: frozenset[str] = frozenset()) -> pb.ListSitesReply:
    """Every site that ever registered here, by id (`revoked`: those no broker user may speak for any more)."""
    now, infos = time.time(), store.site_infos()
    reply = pb.ListSitesReply(heartbeat_timeout_s=heartbeat_timeout_s)
    for w in store.workers():
        reply.sites.append(site_row(store, w, infos.get(w.worker_id), heartbeat_timeout_s=heartbeat_timeout_s,
                                    now=now, revoked=w.worker_id in revoked))
    return reply


def _worker(store: StateStore, worker_id: str) -> WorkerRecord:
    worker = next((w for w in store.workers() if w.worker_id == worker_id), None)
    if worker is None:
        known = [w.worker_id for w in store.workers()]
        shown = ", ".join(known[:20]) + (f" and {len(known) - 20} more" if len(known) > 20 else "")
        raise NotFound(f"no site {worker_id[:140]!r} ever registered at this coordinator (sites: {shown or 'none'})")
    return worker


def site_detail_reply(store: StateStore, worker_id: str, *, heartbeat_timeout_s: float,
                      revoked: frozenset[str] = frozenset()) -> pb.SiteDetailReply:
    """One site: its row, its jobs (current and past) and its kept history; NotFound for an id never registered."""
    worker = _worker(store, worker_id)
    reply = pb.SiteDetailReply()
    reply.site.CopyFrom(site_row(store, worker, store.site_infos().get(worker_id),
                                 heartbeat_timeout_s=heartbeat_timeout_s, now=time.time(),
                                 revoked=worker_id in revoked))
    for job in store.site_jobs(worker_id):
        reply.jobs.add(job_id=job.job_id, status=job.status, epsilon=job.epsilon, rounds=job.rounds,
                       shared=list(job.shared))
    for e in store.site_events(worker_id):
        reply.events.add(seq=e.seq, time_unix=e.time, kind=e.kind, message=e.message, count=e.count,
                         first_time_unix=e.first_time)
    return reply


def site_logs_reply(store: StateStore, request: pb.SiteLogsRequest) -> pb.SiteLogsReply:
    """The site's newest forwarded records after `request.after`; NotFound for an id never registered."""
    _worker(store, request.worker_id)
    reply = pb.SiteLogsReply()
    for r in store.site_logs(request.worker_id, after=request.after, limit=request.limit or DEFAULT_LOG_RECORDS):
        reply.records.add(seq=r.seq, received_unix=r.received, site_time_unix=r.site_time, level=r.level,
                          logger=r.logger, message=r.message, sender=r.sender, claimed=r.claimed,
                          dropped_before=r.dropped_before)
    return reply
