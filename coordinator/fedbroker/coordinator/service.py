"""The coordinator over gRPC: a job's whole life cycle (submit, status, cancel, events, download), a thin
shell over Coordinator and StateStore.

With a token table (fedbroker.rpc.auth) a submitter's token may submit jobs and read everything; a viewer's may
read (Status, JobEvents). Only the identity that submitted a job may cancel it or download its models: the
job records its submitter. A site's (role worker) may call SiteRecord, for itself only, and nothing else
(site_record.py). The operator's view of every site (ListSites, SiteDetail, SiteLogs: site_views.py) is for
submitters and viewers, never a site. Without a table (authentication off) anyone may.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

from fedbroker.coordinator import metrics
from fedbroker.coordinator.checkpoints import load_checkpoint
from fedbroker.coordinator.federated import fill_status
from fedbroker.coordinator.records import JobRecord, RoundRecord
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.site_record import site_record_reply, who_may_read
from fedbroker.coordinator.site_views import list_sites_reply, site_detail_reply, site_logs_reply
from fedbroker.coordinator.start_weights import resolve_start
from fedbroker.errors import ConfigError, FedbrokerError, NotFound, Rejection, UploadRejected
from fedbroker.job.spec import JobSpec
from fedbroker.job.status import FINISHED, RoundStatus
from fedbroker.job.submission import accept_job_text
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc import codec
from fedbroker.rpc.aio_server import AioServer, collect
from fedbroker.rpc.auth import (
    ROLE_SUBMITTER,
    ROLE_VIEWER,
    ROLE_WORKER,
    ClientSecurity,
    Identity,
    SecuredClient,
    ServerAuth,
    ServerTLS,
    TokenLookup,
)
from fedbroker.rpc.live_auth import front_interceptors
from fedbroker.rpc.plumbing import abort, handle

SERVICE_NAME = "fedbroker.v1.Coordinator"
BLOCKING_THREADS = 8  # the store's calls at once (as the synchronous server's pool was)
PERMISSIONS: dict[str, frozenset[str]] = {
    "SubmitJob": frozenset({ROLE_SUBMITTER}),
    "Status": frozenset({ROLE_SUBMITTER, ROLE_VIEWER}),
    "JobEvents": frozenset({ROLE_SUBMITTER, ROLE_VIEWER}),
    "CancelJob": frozenset({ROLE_SUBMITTER}),       # and only the job's own submitter (`_own_job`)
    "DownloadModel": frozenset({ROLE_SUBMITTER}),   # likewise
    "SiteRecord": frozenset({ROLE_WORKER}),         # a site's own record only (`who_may_read`)
    "ListSites": frozenset({ROLE_SUBMITTER, ROLE_VIEWER}),   # every site: never a site's to read
    "SiteDetail": frozenset({ROLE_SUBMITTER, ROLE_VIEWER}),
    "SiteLogs": frozenset({ROLE_SUBMITTER, ROLE_VIEWER}),
}
MAX_FOLLOWERS = 4           # JobEvents streams held open at once: each holds one of the server's 8 threads
FOLLOW_STREAM_S = 300.0     # one following stream's life; the client resumes after its last event
EVENT_POLL_S = 0.5          # how often a following stream looks for new events


def _count_refusal(method: str, reason: str) -> None:
    if method == "SubmitJob":
        metrics.JOBS_REJECTED.labels(reason).inc()


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """Each method converts its messages and maps the coordinator's errors to status codes (`handle`)."""

    def __init__(self, coordinator: Coordinator, auth: ServerAuth | None = None) -> None:
        self.coordinator = coordinator
        self.auth = auth
        self._followers = threading.BoundedSemaphore(MAX_FOLLOWERS)

    def _caller(self, context: grpc.ServicerContext) -> Identity | None:
        return self.auth.identity(context) if self.auth is not None else None

    def _own_job(self, context: grpc.ServicerContext, job_id: str, action: str) -> JobRecord:
        """The job, if the caller submitted it (or authentication is off); else NotFound/PermissionDenied."""
        row = self.coordinator.store.job(job_id)
        if row is None:
            raise NotFound(f"no job {job_id!r}")
        caller = self._caller(context)
        if caller is not None and caller.name != row.submitter:
            raise UploadRejected(Rejection.PERMISSION_DENIED, f"only the identity that submitted job {job_id!r} "
                                                              f"may {action} it; {caller.name!r} did not")
        return row

    def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.ServicerContext) -> pb.SubmitJobReply:
        """Parse and check the job, record it, start it; its id, or the reasons it was refused."""
        def parse() -> JobSpec:
            try:
                return accept_job_text(request.job_yaml)
            except FedbrokerError as exc:
                metrics.JOBS_REJECTED.labels(exc.reason).inc()
                raise

        def record() -> pb.SubmitJobReply:
            try:
                who = caller.name if caller is not None else None
                start = resolve_start(job, request.initial_weights, store=self.coordinator.store, caller=who)
                submitted = self.coordinator.submit_job(job, submitter=who or "", start=start)
                return pb.SubmitJobReply(job_id=submitted.job_id, warnings=submitted.warnings,
                                         epsilon_projection=submitted.projection)
            except ConfigError as exc:  # the coordinator's own checks: its workers' data, the broker's timeout
                metrics.JOBS_REJECTED.labels(exc.reason).inc()
                raise

        job = handle(context, parse)
        caller = self._caller(context)
        # A job the store could not record gets no id: StateUnavailable → UNAVAILABLE, naming the store's error.
        return handle(context, record)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        """One job (or every job) with its rounds and participants, and every worker."""
        # A store that cannot be read answers UNAVAILABLE with its error (StateUnavailable), not UNKNOWN.
        return handle(context, lambda: status_reply(self.coordinator, request.job_id))

    def CancelJob(self, request: pb.CancelJobRequest, context: grpc.ServicerContext) -> pb.CancelJobReply:
        """Only the job's submitter may cancel it (`Coordinator.cancel`)."""
        def run() -> pb.CancelJobReply:
            self._own_job(context, request.job_id, "cancel")
            caller = self._caller(context)
            status = self.coordinator.cancel(request.job_id, by=caller.name if caller is not None else "")
            return pb.CancelJobReply(job_id=request.job_id, status=status)

        return handle(context, run)

    def JobEvents(self, request: pb.JobEventsRequest, context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        """The job's stored events after `after`; with `follow`, new ones as they are recorded, until the job
        ends, the client goes, or FOLLOW_STREAM_S passes (the client then asks again from its last event)."""
        store = self.coordinator.store
        if handle(context, lambda: store.job(request.job_id)) is None:
            abort(context, NotFound(f"no job {request.job_id!r}"))
        if request.follow and not self._followers.acquire(blocking=False):
            abort(context, UploadRejected(Rejection.TOO_MANY_STREAMS,
                                          f"{MAX_FOLLOWERS} event streams are open already; try again later"))
        try:
            after, ends = request.after, time.monotonic() + FOLLOW_STREAM_S
            finished = False
            while True:
                since = after
                rows = handle(context, lambda: store.events(request.job_id, after=since))  # noqa: B023
                for r in rows:
                    after = r.seq
                    yield pb.JobEvent(seq=r.seq, job_id=r.job_id, time_unix=r.time, kind=r.kind, round=r.round,
                                      worker_id=r.worker_id, message=r.message)
                if rows:
                    continue  # a long history comes in pages: read on before deciding to wait
                if not request.follow or finished or not context.is_active() or time.monotonic() >= ends:
                    return
                # its last events were written with its final status: one more read after seeing it
                row = handle(context, lambda: store.job(request.job_id))
                finished = row is None or row.status in FINISHED
                if not finished:
                    time.sleep(EVENT_POLL_S)
        finally:
            if request.follow:
                self._followers.release()

    def SiteRecord(self, request: pb.SiteRecordRequest, context: grpc.ServicerContext) -> pb.SiteRecordReply:
        """A site's own record: the ε recorded for it and its jobs (site_record.py); no one else's."""
        def run() -> pb.SiteRecordReply:
            worker_id = who_may_read(self._caller(context), request.worker_id)
            return site_record_reply(self.coordinator.store, worker_id,
                                     heartbeat_timeout_s=self.coordinator.heartbeat_timeout_s)

        return handle(context, run)

    def ListSites(self, request: pb.ListSitesRequest, context: grpc.ServicerContext) -> pb.ListSitesReply:
        """Every site that ever registered (site_views.py)."""
        timeout = self.coordinator.heartbeat_timeout_s
        return handle(context, lambda: list_sites_reply(self.coordinator.store, heartbeat_timeout_s=timeout,
                                                        revoked=self.coordinator.revoked_sites()))

    def SiteDetail(self, request: pb.SiteDetailRequest, context: grpc.ServicerContext) -> pb.SiteDetailReply:
        """One site: its row, jobs and history; NOT_FOUND for an id never registered."""
        timeout = self.coordinator.heartbeat_timeout_s
        return handle(context, lambda: site_detail_reply(self.coordinator.store, request.worker_id,
                                                         heartbeat_timeout_s=timeout,
                                                         revoked=self.coordinator.revoked_sites()))

    def SiteLogs(self, request: pb.SiteLogsRequest, context: grpc.ServicerContext) -> pb.SiteLogsReply:
        """The warnings and errors a site forwarded after `after` (a follower asks again with its last seq)."""
        return handle(context, lambda: site_logs_reply(self.coordinator.store, request))

    def DownloadModel(self, request: pb.DownloadModelRequest, context: grpc.ServicerContext) -> Iterator[pb.ModelChunk]:
        """A closed round's global model (default: the last one) from the coordinator's checkpoint."""
        def locate() -> tuple[RoundRecord, dict[str, np.ndarray], str]:
            self._own_job(context, request.job_id, "download the models of")
            store = self.coordinator.store
            if request.round:
                row = store.round(request.job_id, request.round)
            else:
                row = store.last_checkpoint(request.job_id)
                if row is None:
                    raise NotFound(f"job {request.job_id!r} has no closed round yet: no model to download")
            if row is None or row.status != RoundStatus.CLOSED or not row.checkpoint:
                closed = [r.round for r in store.rounds(request.job_id) if r.status == RoundStatus.CLOSED]
                raise NotFound(f"round {row.round if row is not None else request.round} of job {request.job_id!r} "
                               f"has no model ({'status ' + row.status if row is not None else 'no such round'}); "
                               f"rounds with a model: {closed or 'none yet'}")
            tensors, spec_json = load_checkpoint(row.checkpoint)
            return row, tensors, spec_json

        row, tensors, spec_json = handle(context, locate)
        header = pb.ModelHeader(job_id=request.job_id, version=row.model_version or 0, model_spec_json=spec_json,
                                tensors=codec.tensor_specs(tensors), round=row.round)
        yield from codec.stream_messages(pb.ModelChunk, header, tensors)


def status_reply(coordinator: Coordinator, job_id: str = "") -> pb.StatusReply:
    """What `fedbroker status` shows, read from the store in one pass."""
    store = coordinator.store
    if job_id:
        one = store.job(job_id)
        if one is None:
            raise NotFound(f"no job {job_id!r}")
        jobs = [one]
    else:
        jobs = store.jobs()
    reply = pb.StatusReply()
    now = time.time()
    for j in jobs:
        reply.jobs.add(job_id=j.job_id, status=j.status, rounds_done=j.rounds_done, rounds_total=j.rounds_total,
                       error=j.error, submitter=j.submitter, name=j.name, category=j.category,
                       created_unix=j.created, updated_unix=j.updated, spec_json=j.spec_json, mode=j.mode,
                       waiting=coordinator.waiting(j.job_id) if j.status not in FINISHED else "")
        for r in store.rounds(j.job_id):
            reply.rounds.add(job_id=r.job_id, round=r.round, status=r.status, participants=r.participants,
                             uploaded=r.uploaded, aggregated=r.aggregated, accuracy=r.accuracy or 0.0,
                             loss=r.loss or 0.0, seconds=r.seconds or 0.0, mean_train_loss=r.mean_train_loss or 0.0,
                             model_version=r.model_version or 0,
                             mean_staleness=float(r.stats.get("mean_staleness", 0.0)))
        fill_status(store, j.job_id, reply)  # the sites' scores: federated_* of its rounds, and its evaluations
        for p in store.participants(j.job_id):
            reply.participants.add(job_id=p.job_id, round=p.round, worker_id=p.worker_id, status=p.status,
                                   reason=p.reason, epsilon=p.epsilon or 0.0, train_loss=p.train_loss or 0.0,
                                   num_samples=p.num_samples or 0)
    for w in store.workers():
        reply.workers.add(worker_id=w.worker_id, device=w.device, epsilon_spent=w.epsilon_spent,
                          epsilon_budget=w.dp.epsilon_budget if w.dp.enabled else 0.0,
                          last_seen_seconds_ago=now - w.last_seen,
                          active=now - w.last_seen <= coordinator.heartbeat_timeout_s)
    return reply


def serve(coordinator: Coordinator, *, address: str = "127.0.0.1:0", tokens: TokenLookup | None = None,
          tls: ServerTLS | None = None, gate: grpc.ServerInterceptor | None = None) -> tuple[AioServer, int]:
    """`tokens`: authenticate every call (None = authentication off); `tls`: serve TLS instead of plaintext;
    `gate`: a synchronous interceptor after authentication (a standby's answer), run as the call starts.

    An asyncio gRPC server in a thread of its own (`fedbroker.rpc.aio_server`); every call reads or writes
    the coordinator's store (a database), so every call runs in its bounded executor (BLOCKING_THREADS),
    never on the event loop, which only moves bytes and holds connections."""
    interceptors, auth = front_interceptors(tls, tokens, service=SERVICE_NAME, permissions=PERMISSIONS,
                                            on_reject=_count_refusal)
    interceptors += [gate] if gate is not None else []
    table = collect(pb_grpc.add_CoordinatorServicer_to_server, CoordinatorServicer(coordinator, auth))
    server = AioServer(table, address=address, tls=tls, service=SERVICE_NAME, interceptors=interceptors,
                       threads=BLOCKING_THREADS)
    return server, server.port


class CoordinatorClient(SecuredClient):
    """The coordinator's gRPC API as the CLI uses it; every call carries this client's token (if any)."""

    def __init__(self, target: str, *, timeout_s: float = 30.0, security: ClientSecurity | None = None) -> None:
        super().__init__(target, security)
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self.timeout_s = timeout_s

    def submit(self, job_text: str) -> str:
        """The new job's id; a refused job raises grpc.RpcError naming every problem."""
        return self.submit_job(job_text).job_id

    def submit_job(self, job_text: str, *, initial_weights: bytes = b"") -> pb.SubmitJobReply:
        """The new job's id and the coordinator's warnings about it; a refused job raises grpc.RpcError.
        `initial_weights`: the bytes of the start file the job pins (model.initial_weights)."""
        request = pb.SubmitJobRequest(job_yaml=job_text, initial_weights=initial_weights)
        reply: pb.SubmitJobReply = self._stub.SubmitJob(request,
                                                        timeout=self.timeout_s, metadata=self._md)
        return reply

    def status(self, job_id: str = "") -> pb.StatusReply:
        """One job ("": every job) with its rounds and participants, and every worker."""
        reply: pb.StatusReply = self._stub.Status(pb.StatusRequest(job_id=job_id), timeout=self.timeout_s,
                                                  metadata=self._md)
        return reply

    def cancel(self, job_id: str) -> str:
        """The job's status once the coordinator has acted (`cancelled`, or `cancelling` while it gets there)."""
        reply: pb.CancelJobReply = self._stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=self.timeout_s + 30,
                                                        metadata=self._md)
        return reply.status

    def events(self, job_id: str, *, after: int = 0, follow: bool = False) -> Iterator[pb.JobEvent]:
        """The job's events; a following stream lives FOLLOW_STREAM_S at most (the caller asks again)."""
        timeout = FOLLOW_STREAM_S + self.timeout_s if follow else self.timeout_s
        yield from self._stub.JobEvents(pb.JobEventsRequest(job_id=job_id, after=after, follow=follow),
                                        timeout=timeout, metadata=self._md)

    def download(self, job_id: str, round_number: int = 0, *,
                 max_bytes: int = 1 << 30) -> tuple[pb.ModelHeader, dict[str, Any]]:
        """(header: version, round, model spec; tensors in the model's order), digest-checked."""
        stream = self._stub.DownloadModel(pb.DownloadModelRequest(job_id=job_id, round=round_number),
                                          timeout=max(self.timeout_s, 600.0), metadata=self._md)
        header, tensors, _ = codec.receive(stream, max_bytes=max_bytes)
        return header, tensors

    def site_record(self, worker_id: str = "") -> pb.SiteRecordReply:
        """This site's record at the coordinator ("": the caller's own, named by its token)."""
        reply: pb.SiteRecordReply = self._stub.SiteRecord(pb.SiteRecordRequest(worker_id=worker_id),
                                                          timeout=self.timeout_s, metadata=self._md)
        return reply

    def list_sites(self) -> pb.ListSitesReply:
        """Every site that ever registered at the coordinator."""
        reply: pb.ListSitesReply = self._stub.ListSites(pb.ListSitesRequest(), timeout=self.timeout_s,
                                                        metadata=self._md)
        return reply

    def site_detail(self, worker_id: str) -> pb.SiteDetailReply:
        """One site's row, jobs and history."""
        reply: pb.SiteDetailReply = self._stub.SiteDetail(pb.SiteDetailRequest(worker_id=worker_id),
                                                          timeout=self.timeout_s, metadata=self._md)
        return reply

    def site_logs(self, worker_id: str, *, after: int = 0, limit: int = 0) -> pb.SiteLogsReply:
        """The site's forwarded warnings and errors with a seq above `after` (the newest `limit`; 0: the server's)."""
        reply: pb.SiteLogsReply = self._stub.SiteLogs(pb.SiteLogsRequest(worker_id=worker_id, after=after, limit=limit),
                                                      timeout=self.timeout_s, metadata=self._md)
        return reply


