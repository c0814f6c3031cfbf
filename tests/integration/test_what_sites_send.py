"""The README's table of what a site sends is true: real workers (default settings) run a FedAvg, a DWFed and a
federated-standardisation job against a real coordinator and aggregation service on the in-process bus; every
envelope a worker publishes and every gRPC call it makes is captured, and compared with the table both ways.
With the defaults no exact label count reaches the coordinator, and the FedAvg job receives no histogram."""

from __future__ import annotations

import re
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.bus import Delivery, InProcessBus
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.job.spec import parse_job
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.worker.agent import WorkerAgent
from fedbroker.worker.sharing import HISTOGRAM_RELEASE

pytestmark = pytest.mark.timeout(600)

README = Path(__file__).resolve().parents[2] / "README.md"
SECTION = "## What a data owner shares, and why"
MODEL = {"input_shape": [1, 8, 8], "layers": [
    {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 32}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 32, "out_features": 10}]}
WORKERS = ("site-a", "site-b")
LATE = "site-c"  # joins later, with data the jobs' model cannot take (iris, registered under digits)


def table_rows() -> list[set[str]]:
    """The message names (`Kind`, or `Kind.field` for one part of a message) in the first cell of each row of the
    README's table of what a site sends."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", 1)]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return [set(re.findall(r"`([A-Z]\w*(?:\.\w+)?)`", cell)) for cell in rows]


def names(env: pb.Envelope) -> set[str]:
    """How the table names what an envelope carries: its message; a share reply by the releases it holds."""
    kind = env.WhichOneof("message")
    message = getattr(env, kind)
    if kind != "share_reply":
        return {message.DESCRIPTOR.name}
    reply = env.share_reply
    held = {f"ShareReply.{f}" for f in ("label_histogram", "feature_sum") if len(getattr(reply, f))}
    return held or {"ShareReply.refused" if reply.refused else "ShareReply"}


class Recording(InProcessBus):
    """A site's bus that keeps every envelope it publishes (any channel) and every task it receives."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.published: list[pb.Envelope] = []
        self.received: list[pb.Envelope] = []
        self._lock = threading.Lock()

    def _keep(self, into: list[pb.Envelope], body: bytes) -> None:
        env = pb.Envelope()
        env.ParseFromString(body)
        with self._lock:
            into.append(env)

    def publish_control(self, body: bytes) -> None:
        self._keep(self.published, body)
        super().publish_control(body)

    def publish_event(self, body: bytes) -> None:
        self._keep(self.published, body)
        super().publish_event(body)

    def publish_task(self, worker_id: str, body: bytes) -> None:
        self._keep(self.published, body)
        super().publish_task(worker_id, body)

    def consume_tasks(self, worker_id: str, handler: Callable[[Delivery], None]) -> None:
        def keeping(delivery: Delivery) -> None:
            self._keep(self.received, delivery.body)
            handler(delivery)

        super().consume_tasks(worker_id, keeping)


class CoordinatorBus(InProcessBus):
    """The coordinator's bus, keeping every control message it receives."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.received: list[pb.Envelope] = []

    def consume_control(self, handler: Callable[[Delivery], None]) -> None:
        def keeping(delivery: Delivery) -> None:
            env = pb.Envelope()
            env.ParseFromString(delivery.body)
            self.received.append(env)
            handler(delivery)

        super().consume_control(keeping)


class Calls(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor,
            grpc.StreamStreamClientInterceptor):
    """Notes the method of every gRPC call made on a channel."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    def _note(self, details: grpc.ClientCallDetails) -> None:
        self.methods.append(details.method.rsplit("/", 1)[-1])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self._note(details)
        return continuation(details, request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        self._note(details)
        return continuation(details, request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        self._note(details)
        return continuation(details, requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        self._note(details)
        return continuation(details, requests)


@dataclass(frozen=True)
class RecordingSecurity(ClientSecurity):
    """A site's (token-less) client security whose channels note every call they make."""

    calls: Calls = field(default_factory=Calls)

    def channel(self, target: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        return grpc.intercept_channel(super().channel(target, options), self.calls)


@dataclass
class Run:
    coordinator: Coordinator
    store: StateStore
    coordinator_bus: CoordinatorBus
    agents: dict[str, WorkerAgent]
    buses: dict[str, Recording]
    security: dict[str, RecordingSecurity]
    jobs: dict[str, str]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("sites")
    namespace = f"sends-{uuid.uuid4().hex[:6]}"
    server, port = serve(RoundBook())
    target = f"127.0.0.1:{port}"
    bus = CoordinatorBus(namespace=namespace, user="coordinator")
    store = StateStore(str(tmp / "c.sqlite"))
    coordinator = Coordinator(bus=bus, store=store, aggregator=AggregatorClient(target), aggregator_target=target,
                              checkpoint_dir=str(tmp / "ck"), poll_interval_s=0.05, safety_poll_s=0.5)
    coordinator.start()
    bus.start()
    agents: dict[str, WorkerAgent] = {}
    buses: dict[str, Recording] = {}
    security: dict[str, RecordingSecurity] = {}

    def start(worker_id: str, index: int, **config: Any) -> None:
        buses[worker_id] = Recording(namespace=namespace, user=worker_id)
        security[worker_id] = RecordingSecurity()
        agents[worker_id] = WorkerAgent(WorkerConfig(  # every privacy setting at its default, but a budget for 4 jobs
            id=worker_id, partition=PartitionSection(scheme="iid", num_clients=len(WORKERS), client_index=index),
            ledger_path=str(tmp / f"{worker_id}.ledger.json"), device="cpu", heartbeat_s=1.0,
            dp=DPPolicy(epsilon_budget=50.0), **config),
            buses[worker_id], security=security[worker_id], aggregator_target=target)  # beats as launch's do
        agents[worker_id].start()
        buses[worker_id].start()

    try:
        for index, worker_id in enumerate(WORKERS):
            start(worker_id, index)
        jobs = {}
        for name, extra in (("fedavg", {}), ("dwfed", {"aggregation": {"weighting": "dwfed"}}),
                            ("federated", {"data": {"standardize": "federated", "bounds": [0, 1]}})):
            job = parse_job({"name": name, "category": "digits", "model": MODEL, "training": {"rounds": 1},
                             "schedule": {"min_workers": 2, "wait_for_workers_s": 120, "round_timeout_s": 300},
                             **extra})
            jobs[name] = coordinator.submit(job)
            assert coordinator.wait(jobs[name], 300) == "completed", store.job(jobs[name])
        # a FedAvg job that waits for a third site, which joins with data its model cannot take: that site is
        # selected (it registered after the job's checks) and reports the task it cannot train as failed
        jobs["late"] = coordinator.submit(parse_job({
            "name": "late", "category": "digits", "model": MODEL, "training": {"rounds": 1},
            "schedule": {"min_workers": 3, "wait_for_workers_s": 120, "round_timeout_s": 300}}))
        start(LATE, 0, dataset="iris")
        assert coordinator.wait(jobs["late"], 300) == "completed", store.job(jobs["late"])
        yield Run(coordinator, store, bus, agents, buses, security, jobs)
    finally:
        coordinator.stop()
        for worker_id, agent in agents.items():
            agent.stop()
            buses[worker_id].close()
        bus.close()
        server.stop(grace=0)
        store.close()


def test_every_kind_a_site_sends_is_in_the_readmes_table_and_every_row_was_sent(run: Run) -> None:
    rows = table_rows()
    assert len(rows) >= 5 and all(rows), rows
    sent: set[str] = set()
    for worker_id in (*WORKERS, LATE):
        for env in run.buses[worker_id].published:
            sent |= names(env)
        sent |= set(run.security[worker_id].calls.methods)
    listed = set().union(*rows)
    assert sent <= listed, f"sent but not in the README's table: {sorted(sent - listed)}"
    assert all(row & sent for row in rows), f"in the table but never sent: {[sorted(r) for r in rows if not r & sent]}"


def test_with_the_defaults_no_exact_label_count_reaches_the_coordinator(run: Run) -> None:
    received = run.coordinator_bus.received
    registrations = [env.registration for env in received if env.HasField("registration")]
    assert len(registrations) >= len(WORKERS) and not any(r.label_histogram for r in registrations)
    histograms = {env.share_reply.worker_id: env.share_reply for env in received
                  if env.HasField("share_reply") and env.share_reply.label_histogram}
    assert set(histograms) == set(WORKERS)
    for worker_id, reply in histograms.items():
        assert reply.job_id == run.jobs["dwfed"] and reply.histogram_noised and reply.histogram_epsilon == 1.0
        kept = run.agents[worker_id].ledger.release(HISTOGRAM_RELEASE)  # the noised draw its ledger charged
        assert kept is not None and list(reply.label_histogram) == kept.value
    assert all(w.histogram == () for w in run.store.workers())
    stored = [s for s in run.store.shares() if s.histogram]
    assert {s.worker_id for s in stored} == set(WORKERS)
    assert all(s.histogram_noised and s.histogram_epsilon == 1.0 for s in stored)
    assert {s.job_id for s in stored} == {run.jobs["dwfed"]}


def test_a_fedavg_job_receives_no_histogram_and_asks_nothing(run: Run) -> None:
    fedavg = run.jobs["fedavg"]
    assert run.store.share_phase(fedavg) is None and not run.store.shares(fedavg)
    assert not any(env.share_reply.job_id == fedavg for env in run.coordinator_bus.received
                   if env.HasField("share_reply"))
    asked = {env.share_request.job_id for bus in run.buses.values() for env in bus.received
             if env.HasField("share_request")}
    assert asked == {run.jobs["dwfed"], run.jobs["federated"]}
    (failed,) = [p for p in run.store.participants(run.jobs["late"]) if p.worker_id == LATE]
    assert failed.status == "failed"  # the README's TaskOutcome row: it reported the task it could not train


def test_the_federated_job_trained_with_the_agreed_standardisation_in_front(run: Run) -> None:
    federated = run.jobs["federated"]
    (statistics,) = [e for e in run.store.events(federated) if e.kind == "statistics_agreed"]
    assert statistics.message.startswith("mean and std of 64 feature(s) from 2 site(s)")
    assert run.store.job(federated).model_spec_json.startswith('{"input_shape": [1, 8, 8], "layers": [{"mean"')
    replies = [env.share_reply for env in run.coordinator_bus.received
               if env.HasField("share_reply") and env.share_reply.job_id == federated]
    assert {r.worker_id for r in replies} == set(WORKERS)
    assert all(r.statistics_noised and r.statistics_epsilon == 1.0 and not r.label_histogram for r in replies)
