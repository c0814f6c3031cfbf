"""A standby coordinator's port and the CLI's list of coordinators, on real gRPC servers on loopback: a standby
answers every call of the coordinator's service UNAVAILABLE, reason `standby`, naming the leader (health passes);
the CLI's client (`--coordinator a,b`, coordinator.targets) passes over a standby or a dead address to whichever
leads, for unary calls and streams; a refusal is never asked twice. The asyncio gate answers the same."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedbroker.app.failover import FailoverClient, coordinator_client, targets_of
from fedbroker.app.jobs import client as cli_client
from fedbroker.bus import InProcessBus
from fedbroker.config import CoordinatorConfig, load_config
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.service import CoordinatorClient, serve
from fedbroker.coordinator.standby_gate import LEADER_KEY, AsyncStandbyGate, StandbyGate
from fedbroker.coordinator.store import StateStore
from fedbroker.errors import ConfigError
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity, TokenTable, generate_token, hash_token
from fedbroker.rpc.plumbing import reason_of
from tests.rabbitmq_node import free_ports


class Replica:
    """A coordinator serving behind a gate whose `leading` flag the test flips, as the election would."""

    def __init__(self, tmp: Path, name: str, *, leading: bool, leader: str = "",
                 tokens: TokenTable | None = None) -> None:
        self.is_leading = threading.Event()
        if leading:
            self.is_leading.set()
        self.leader = leader
        self.store = StateStore(str(tmp / f"{name}.sqlite"))
        self.coordinator = Coordinator(bus=InProcessBus(namespace=f"gate-{name}"), store=self.store,
                                       aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                                       checkpoint_dir=str(tmp / f"{name}-ck"))
        gate = StandbyGate(self.is_leading.is_set, lambda: self.leader)
        self.server, port = serve(self.coordinator, gate=gate, tokens=tokens)
        self.target = f"127.0.0.1:{port}"

    def close(self) -> None:
        self.server.stop(grace=0)
        self.store.close()


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    leader = Replica(tmp_path, "leader", leading=True)
    standby = Replica(tmp_path, "standby", leading=False, leader=leader.target)
    yield leader, standby
    standby.close()
    leader.close()


def test_a_standby_answers_unavailable_standby_naming_the_leader(replicas: tuple[Replica, Replica]) -> None:
    leader, standby = replicas
    with CoordinatorClient(standby.target, timeout_s=10) as c:
        with pytest.raises(grpc.RpcError) as refused:
            c.status()
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert reason_of(refused.value) == "standby"
        assert leader.target in (refused.value.details() or "")
        assert (LEADER_KEY, leader.target) in tuple(refused.value.trailing_metadata() or ())
        with pytest.raises(grpc.RpcError) as streamed:
            list(c.events("any-job"))
        assert reason_of(streamed.value) == "standby"
        with pytest.raises(grpc.RpcError) as submitted:
            c.submit("name: x")
        assert reason_of(submitted.value) == "standby"
        assert standby.store.jobs() == [], "a standby records nothing"
    with grpc.insecure_channel(standby.target) as channel:  # Kubernetes' probes still get an answer
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    standby.leader = ""
    with CoordinatorClient(standby.target, timeout_s=10) as c, pytest.raises(grpc.RpcError, match="no coordinator leads"):
        c.status()
    standby.is_leading.set()   # it took the lease: it serves from its next call on
    with CoordinatorClient(standby.target, timeout_s=10) as c:
        assert list(c.status().jobs) == []


def test_a_standby_names_the_leader_only_to_an_authenticated_caller(tmp_path: Path) -> None:
    token = generate_token()
    table = TokenTable.from_mapping({"alice": {"role": "submitter", "sha256": hash_token(token)}})
    standby = Replica(tmp_path, "gated", leading=False, leader="10.0.0.7:50052", tokens=table)
    try:
        with CoordinatorClient(standby.target, timeout_s=10) as anonymous, pytest.raises(grpc.RpcError) as refused:
            anonymous.status()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "10.0.0.7" not in (refused.value.details() or "")
        with CoordinatorClient(standby.target, timeout_s=10, security=ClientSecurity(token=token)) as alice, \
                pytest.raises(grpc.RpcError) as told:
            alice.status()
        assert reason_of(told.value) == "standby" and "10.0.0.7:50052" in (told.value.details() or "")
    finally:
        standby.close()


def test_the_cli_client_passes_over_a_standby_and_a_dead_address(replicas: tuple[Replica, Replica]) -> None:
    leader, standby = replicas
    (dead_port,) = free_ports(1)
    with FailoverClient([f"127.0.0.1:{dead_port}", standby.target, leader.target]) as c:
        assert list(c.status().jobs) == []
        with pytest.raises(grpc.RpcError) as unknown:   # a stream moves on before its first message: the leader
            list(c.events("no-such-job"))               # answers, not the standby
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as refused:   # a refusal is the caller's: never asked twice
            c.cancel("no-such-job")
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    leader.is_leading.clear()    # nobody leads (a takeover under way): the last refusal is the caller's
    with FailoverClient([standby.target, leader.target]) as c, pytest.raises(grpc.RpcError) as refused:
        c.status()
    assert reason_of(refused.value) == "standby"


def test_targets_come_from_the_flag_then_the_config(replicas: tuple[Replica, Replica], tmp_path: Path) -> None:
    leader, standby = replicas
    assert targets_of("a:1, b:2", ("c:3",), "d:4") == ["a:1", "b:2"]
    assert targets_of(None, ("c:3", "e:5"), "d:4") == ["c:3", "e:5"]
    assert targets_of(None, (), "d:4") == ["d:4"]
    with pytest.raises(ConfigError, match="--coordinator"):
        targets_of(" , ", (), "d:4")
    assert type(coordinator_client(["d:4"])) is CoordinatorClient
    config = tmp_path / "client.yaml"
    config.write_text(f"coordinator:\n  targets: [{standby.target}, {leader.target}]\n")
    assert load_config(str(config)).coordinator.targets == (standby.target, leader.target)

    class Args:
        coordinator = None

    Args.config = str(config)  # type: ignore[attr-defined]
    with cli_client(Args()) as c:  # type: ignore[arg-type]
        assert list(c.status().jobs) == []


def test_bad_standby_settings_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="coordinator.lease_ttl_s"):
        CoordinatorConfig(lease_ttl_s=0)
    with pytest.raises(ConfigError, match="coordinator.targets"):
        CoordinatorConfig(targets=("no-port",))


class _Status(pb_grpc.CoordinatorServicer):
    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusReply:  # type: ignore[override]
        return pb.StatusReply()


def test_the_asyncio_gate_answers_the_same() -> None:
    async def scenario() -> tuple[str, str, int]:
        leading = threading.Event()
        server = grpc.aio.server(interceptors=[AsyncStandbyGate(leading.is_set, lambda: "10.0.0.9:50052")])
        pb_grpc.add_CoordinatorServicer_to_server(_Status(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.CoordinatorStub(channel)
                try:
                    await stub.Status(pb.StatusRequest(), timeout=10)
                    raise AssertionError("a standby served a call")
                except grpc.aio.AioRpcError as refused:
                    reason = dict(refused.trailing_metadata() or ()).get("fedbroker-reason", "")
                    details = refused.details() or ""
                leading.set()
                reply = await stub.Status(pb.StatusRequest(), timeout=10)
                return str(reason), details, len(reply.jobs)
        finally:
            await server.stop(0)

    reason, details, jobs = asyncio.run(scenario())
    assert reason == "standby" and "10.0.0.9:50052" in details
    assert jobs == 0
