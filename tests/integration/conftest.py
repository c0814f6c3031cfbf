"""A real federation for integration tests: aggregation service on loopback gRPC, coordinator and
workers each with their own pika connection to the real RabbitMQ, all in this process."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.bus import delete_topology, open_bus
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig
from fedbroker.coordinator.evaluation import evaluate_global
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.worker.agent import WorkerAgent


@dataclass
class Federation:
    url: str
    tmp: Path
    namespace: str = field(default_factory=lambda: f"fedbroker-test-{uuid.uuid4().hex[:8]}")
    parts: list[Any] = field(default_factory=list)
    workers: dict[str, WorkerAgent] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.book = RoundBook()
        self.server, port = serve(self.book)
        self.target = f"127.0.0.1:{port}"
        self.bus = open_bus(self.url, namespace=self.namespace)
        self.store = StateStore(str(self.tmp / "coordinator.sqlite"))
        self.coordinator = Coordinator(
            bus=self.bus, store=self.store, aggregator=AggregatorClient(self.target), aggregator_target=self.target,
            checkpoint_dir=str(self.tmp / "checkpoints"), evaluator=evaluate_global, poll_interval_s=0.1,
        )
        self.coordinator.start()
        self.bus.start()

    def add_worker(self, worker_id: str, *, index: int, count: int, scheme: str = "iid",
                   dp: DPPolicy | None = None, alpha: float = 0.5) -> WorkerAgent:
        bus = open_bus(self.url, namespace=self.namespace)
        agent = WorkerAgent(WorkerConfig(
            id=worker_id, partition=PartitionSection(scheme=scheme, num_clients=count, client_index=index, alpha=alpha),
            dp=dp or DPPolicy(enabled=False), ledger_path=str(self.tmp / f"{worker_id}-ledger.json"), device="cpu", heartbeat_s=1.0,
        ), bus)
        agent.start()
        bus.start()
        self.workers[worker_id] = agent
        return agent

    def close(self) -> None:
        self.coordinator.stop()
        for agent in self.workers.values():
            agent.stop()
            agent.bus.close()
        self.bus.close()
        self.server.stop(grace=0)
        delete_topology(self.url, self.namespace, list(self.workers))


@pytest.fixture
def federation(rabbitmq_url, tmp_path):
    fed = Federation(rabbitmq_url, tmp_path)
    yield fed
    fed.close()
