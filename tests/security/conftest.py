"""Fixtures of the security tests: a throwaway PKI, a TLS proxy in front of the shared RabbitMQ, token tables,
and a federation that runs with authentication, gRPC (m)TLS and AMQP over TLS."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.bus import delete_topology, open_bus
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity, ServerTLS, TokenTable, generate_token, hash_token
from fedbroker.worker.agent import WorkerAgent
from tests.security.pki import Authority, Pair
from tests.security.tlsproxy import TlsProxy


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: Pair
    coordinator: Pair
    rogue_ca: Path         # a CA nobody trusts
    rogue_server: Pair     # a server certificate it signed
    misnamed: Pair         # signed by the trusted CA, for another host
    authority: Authority   # the trusted CA, for more client certificates

    def client(self, identity: str) -> Pair:
        """A client certificate naming `identity` (CN), as provisioning writes one per participant."""
        return self.authority.issue(f"client-{identity}", identity, server=False)


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    folder = tmp_path_factory.mktemp("pki")
    ca = Authority(folder / "ca")
    rogue = Authority(folder / "rogue", name="rogue CA")
    return Pki(ca=ca.ca, server=ca.issue("server", "localhost", server=True),
               coordinator=ca.issue("coordinator", "coordinator", server=False),
               rogue_ca=rogue.ca, rogue_server=rogue.issue("server", "localhost", server=True),
               misnamed=ca.issue("misnamed", "elsewhere", server=True, hosts=("elsewhere.example",)), authority=ca)


@pytest.fixture(scope="session")
def tls_proxy(pki: Pki, rabbitmq_url: str) -> Any:
    proxy = TlsProxy(pki.server.cert, pki.server.key)
    yield proxy
    proxy.close()


def amqps_url(proxy: TlsProxy, host: str = "localhost") -> str:
    return f"amqps://guest:guest@{host}:{proxy.port}/%2F"


def token_table(identities: dict[str, str]) -> tuple[TokenTable, dict[str, str]]:
    """(table of sha256 entries, identity → token) for {identity: role}."""
    tokens = {name: generate_token() for name in identities}
    table = TokenTable.from_mapping({name: {"role": role, "sha256": hash_token(tokens[name])}
                                     for name, role in identities.items()})
    return table, tokens


def write_table(path: Path, identities: dict[str, str]) -> dict[str, str]:
    tokens = {name: generate_token() for name in identities}
    path.write_text(yaml.safe_dump({name: {"role": role, "sha256": hash_token(tokens[name])}
                                    for name, role in identities.items()}))
    return tokens


@dataclass
class SecureFederation:
    """Aggregation service on TLS (mutual) with a token table; coordinator and workers on AMQP over TLS."""

    url: str
    ca_file: Path
    pki: Pki
    tmp: Path
    worker_ids: list[str]
    namespace: str = field(default_factory=lambda: f"fedbroker-sec-{uuid.uuid4().hex[:8]}")
    workers: dict[str, WorkerAgent] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.table, self.tokens = token_table({"coordinator": "coordinator", **{w: "worker" for w in self.worker_ids}})
        tls = ServerTLS.from_files(str(self.pki.server.cert), str(self.pki.server.key), str(self.pki.ca),
                                   where="aggregator.tls")
        self.book = RoundBook()
        self.server, port = serve(self.book, tokens=self.table, tls=tls)
        self.target = f"localhost:{port}"
        self.bus = open_bus(self.url, namespace=self.namespace, ca_file=str(self.ca_file))
        self.store = StateStore(str(self.tmp / "coordinator.sqlite"))
        self.coordinator = Coordinator(
            bus=self.bus, store=self.store,
            aggregator=AggregatorClient(self.target, security=self.security("coordinator", self.pki.coordinator)),
            aggregator_target=self.target, checkpoint_dir=str(self.tmp / "checkpoints"), poll_interval_s=0.1,
        )
        self.coordinator.start()
        self.bus.start()
        for i, worker_id in enumerate(self.worker_ids):
            bus = open_bus(self.url, namespace=self.namespace, ca_file=str(self.ca_file))
            agent = WorkerAgent(WorkerConfig(
                id=worker_id, partition=PartitionSection(num_clients=len(self.worker_ids), client_index=i),
                dp=DPPolicy(enabled=False), ledger_path=str(self.tmp / f"{worker_id}-ledger.json"), device="cpu",
                heartbeat_s=1.0,
            ), bus, security=self.security(worker_id, self.pki.client(worker_id)))
            agent.start()
            bus.start()
            self.workers[worker_id] = agent

    def security(self, identity: str, pair: Pair) -> ClientSecurity:
        return ClientSecurity(token=self.tokens[identity], ca=self.pki.ca.read_bytes(),
                              cert_chain=pair.cert.read_bytes(), private_key=pair.key.read_bytes(),
                              expected_target=self.target)

    def close(self, rabbitmq_url: str) -> None:
        self.coordinator.stop()
        for agent in self.workers.values():
            agent.stop()
            agent.bus.close()
        self.bus.close()
        self.server.stop(grace=0)
        delete_topology(rabbitmq_url, self.namespace, list(self.workers))
