"""The coordinator over gRPC: job submission and status, a thin shell over Coordinator and StateStore.

With a token table (fedbroker.auth) a submitter's token may SubmitJob and Status, a viewer's only Status.
"""

from __future__ import annotations

import json
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedbroker.aggregators.registries import accept_job_text
from fedbroker.auth import ROLE_SUBMITTER, ROLE_VIEWER, ClientSecurity, ServerAuth, ServerTLS, TokenTable, add_port
from fedbroker.coordinator import metrics
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.errors import FedbrokerError
from fedbroker.metrics import GrpcMetricsInterceptor
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc import CHANNEL_OPTIONS, handle
from fedbroker.spec import JobSpec

SERVICE_NAME = "fedbroker.v1.Coordinator"
PERMISSIONS: dict[str, frozenset[str]] = {
    "SubmitJob": frozenset({ROLE_SUBMITTER}),
    "Status": frozenset({ROLE_SUBMITTER, ROLE_VIEWER}),
}


def _count_refusal(method: str, reason: str) -> None:
    if method == "SubmitJob":
        metrics.JOBS_REJECTED.labels(reason).inc()


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self.coordinator = coordinator

    def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.ServicerContext) -> pb.SubmitJobReply:
        def parse() -> JobSpec:
            try:
                return accept_job_text(request.job_yaml)
            except FedbrokerError as exc:
                metrics.JOBS_REJECTED.labels(exc.reason).inc()
                raise

        job = handle(context, parse)
        # A job the store could not record gets no id: StateUnavailable → UNAVAILABLE, naming the store's error.
        return handle(context, lambda: pb.SubmitJobReply(job_id=self.coordinator.submit(job)))

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        # A store that cannot be read answers UNAVAILABLE with its error (StateUnavailable), not UNKNOWN.
        return handle(context, lambda: status_reply(self.coordinator, request.job_id))


def status_reply(coordinator: Coordinator, job_id: str = "") -> pb.StatusReply:
    store = coordinator.store
    jobs = [j for j in store.jobs() if not job_id or j["job_id"] == job_id]
    reply = pb.StatusReply()
    now = time.time()
    for j in jobs:
        reply.jobs.add(job_id=j["job_id"], status=j["status"], rounds_done=j["rounds_done"],
                       rounds_total=j["rounds_total"], error=j["error"], mode=_mode(j["spec_json"]))
        for r in store.rounds(j["job_id"]):
            reply.rounds.add(job_id=r["job_id"], round=r["round"], status=r["status"], participants=r["participants"],
                             uploaded=r["uploaded"], aggregated=r["aggregated"], accuracy=r["accuracy"] or 0.0,
                             loss=r["loss"] or 0.0, seconds=r["seconds"] or 0.0,
                             mean_train_loss=r["mean_train_loss"] or 0.0, model_version=r["model_version"] or 0,
                             mean_staleness=float(json.loads(r["stats_json"] or "{}").get("mean_staleness", 0.0)))
        for p in store.participants(j["job_id"]):
            reply.participants.add(job_id=p["job_id"], round=p["round"], worker_id=p["worker_id"], status=p["status"],
                                   reason=p["reason"], epsilon=p["epsilon"] or 0.0, train_loss=p["train_loss"] or 0.0,
                                   num_samples=p["num_samples"] or 0)
    for w in store.workers():
        reply.workers.add(worker_id=w.worker_id, device=w.device, epsilon_spent=w.epsilon_spent,
                          epsilon_budget=w.dp.get("epsilon_budget", 0.0) if w.dp_enabled else 0.0,
                          last_seen_seconds_ago=now - w.last_seen,
                          active=now - w.last_seen <= coordinator.heartbeat_timeout_s)
    return reply


def _mode(spec_json: str) -> str:
    """schedule.mode of a stored job (a job stored before the field existed is synchronous)."""
    try:
        return str(json.loads(spec_json).get("schedule", {}).get("mode", "sync"))
    except (ValueError, AttributeError):
        return "sync"


def serve(coordinator: Coordinator, *, address: str = "127.0.0.1:0", tokens: TokenTable | None = None,
          tls: ServerTLS | None = None) -> tuple[grpc.Server, int]:
    """`tokens`: authenticate every call (None = authentication off); `tls`: serve TLS instead of plaintext."""
    interceptors: list[grpc.ServerInterceptor] = [GrpcMetricsInterceptor()]
    if tokens is not None:
        interceptors.append(ServerAuth(tokens, PERMISSIONS, service=SERVICE_NAME, on_reject=_count_refusal))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=CHANNEL_OPTIONS,
                         interceptors=interceptors)
    pb_grpc.add_CoordinatorServicer_to_server(CoordinatorServicer(coordinator), server)
    health_servicer = health.HealthServicer()  # Kubernetes' native gRPC probes ask this
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = add_port(server, address, tls)
    if port == 0:
        raise OSError(f"could not bind the coordinator service to {address}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port


class CoordinatorClient:
    def __init__(self, target: str, *, timeout_s: float = 30.0, security: ClientSecurity | None = None) -> None:
        security = security or ClientSecurity()
        self._channel = security.channel(target, CHANNEL_OPTIONS)
        self._md = security.metadata()
        self._stub = pb_grpc.CoordinatorStub(self._channel)
        self.timeout_s = timeout_s

    def submit(self, job_text: str) -> str:
        reply: pb.SubmitJobReply = self._stub.SubmitJob(pb.SubmitJobRequest(job_yaml=job_text),
                                                        timeout=self.timeout_s, metadata=self._md)
        return reply.job_id

    def status(self, job_id: str = "") -> pb.StatusReply:
        reply: pb.StatusReply = self._stub.Status(pb.StatusRequest(job_id=job_id), timeout=self.timeout_s,
                                                  metadata=self._md)
        return reply

    def close(self) -> None:
        self._channel.close()
