"""An in-process federation for federated-evaluation tests: the aggregation service on loopback gRPC, the real
coordinator and real worker agents on the in-process bus (each bus with a broker user of its own, so the
coordinator can bind control messages to their senders as it does on RabbitMQ)."""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.bus import InProcessBus, MemoryBroker, envelope
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig
from fedbroker.coordinator.evaluation import evaluate_global
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.job.spec import parse_job
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.worker.agent import WorkerAgent

# Far beyond any test's run: rounds end on their uploads, evaluations on their reports, never on the clock.
NEVER_S = 1200.0

JOB: dict[str, Any] = {
    "name": "feval",
    "category": "digits",
    "seed": 5,
    "model": {"input_shape": [1, 8, 8], "layers": [{"type": "Flatten"},
                                                   {"type": "Linear", "in_features": 64, "out_features": 10}]},
    "training": {"rounds": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.2},
    "schedule": {"min_workers": 3, "wait_for_workers_s": NEVER_S, "round_timeout_s": NEVER_S},
    "evaluation": {"every": 1},
}


def job(**sections: dict[str, Any]) -> dict[str, Any]:
    """JOB with some fields of its sections replaced."""
    out = copy.deepcopy(JOB)
    for name, values in sections.items():
        out[name] = {**out.get(name, {}), **values} if isinstance(values, dict) else values
    return out


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 240.0) -> Any:
    """Wait on a condition with a generous hang guard (never assert a duration)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Federation:
    """Worker `wN` publishes as broker user `site-N`; the coordinator binds each to its worker id."""

    def __init__(self, tmp: Path, workers: int = 3) -> None:
        self.tmp = tmp
        self.namespace = f"feval-{uuid.uuid4().hex[:8]}"
        self.book = RoundBook()
        self.server, port = serve(self.book)
        self.target = f"127.0.0.1:{port}"
        self.bus = InProcessBus(namespace=self.namespace, user="coordinator")
        self.store = StateStore(str(tmp / "coordinator.sqlite"))
        self.coordinator = Coordinator(
            bus=self.bus, store=self.store, aggregator=AggregatorClient(self.target), aggregator_target=self.target,
            checkpoint_dir=str(tmp / "checkpoints"), evaluator=evaluate_global, poll_interval_s=0.05,
            worker_broker_users={f"site-{i}": [f"w{i}"] for i in range(workers)})
        self.coordinator.start()
        self.bus.start()
        self.agents: dict[str, WorkerAgent] = {}

    def add_worker(self, index: int, count: int, **settings: Any) -> WorkerAgent:
        partition = settings.pop("partition", PartitionSection(num_clients=count, client_index=index))
        config = WorkerConfig(id=f"w{index}", partition=partition,
                              dp=settings.pop("dp", DPPolicy(enabled=False)), device="cpu", heartbeat_s=0.5,
                              ledger_path=str(self.tmp / f"w{index}-ledger.json"), coordinator_broker_user="coordinator",
                              **settings)
        bus = InProcessBus(namespace=self.namespace, user=f"site-{index}")
        agent = WorkerAgent(config, bus)
        agent.start()
        bus.start()
        self.agents[config.id] = agent
        return agent

    def run(self, job_dict: dict[str, Any], timeout: float = 300.0) -> str:
        """Submit, and wait for the job to end; its id."""
        job_id = self.coordinator.submit(parse_job(job_dict))
        status = self.coordinator.wait(job_id, timeout)
        assert status == "completed", (status, self.store.job(job_id))
        return job_id

    def publish_as(self, user: str, **message: Any) -> None:
        """A control message from a bus of broker user `user` (a site, or a forger holding its credentials)."""
        bus = InProcessBus(namespace=self.namespace, user=user)
        try:
            bus.publish_control(envelope.encode(**message))
        finally:
            bus.close()

    def close(self) -> None:
        self.coordinator.stop()
        for agent in self.agents.values():
            agent.stop()
            agent.bus.close()
        self.bus.close()
        self.server.stop(grace=0)
        MemoryBroker.forget(self.namespace)


def report(job_id: str, round_number: int, version: int, worker_id: str, **values: Any) -> pb.EvaluationReport:
    return pb.EvaluationReport(job_id=job_id, round=round_number, model_version=version, worker_id=worker_id,
                               **values)


def weighted(rows: list[Any]) -> tuple[float, float, int]:
    """The count-weighted accuracy and loss of per-site rows, computed here, apart from the code under test."""
    n = np.array([r.num_samples for r in rows], dtype=np.float64)
    return (float(np.dot(n, [r.accuracy for r in rows]) / n.sum()), float(np.dot(n, [r.loss for r in rows]) / n.sum()),
            int(n.sum()))
