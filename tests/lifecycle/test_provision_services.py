"""The server kit after `provision add`, `revoke`, `rotate-token` and `renew`, as the real services load it: they
start from the kit's own scripts and serve the added site, both tokens of a rotation and a renewed certificate,
and refuse the revoked site's token. (Whether a running service follows these files without a restart is the
services' business: here they start after the changes.)"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from fedbroker.app.provision import lifecycle, parse_project, provision
from fedbroker.coordinator.service import CoordinatorClient
from fedbroker.job.spec import parse_model
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.rpc.plumbing import RemoteError
from tests.integration.processes import stop_all
from tests.source_roots import PYTHONPATH

SPEC = parse_model({"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]})
WEIGHTS = {"0.weight": np.ones((2, 4), np.float32), "0.bias": np.ones(2, np.float32)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def security(kits: Path, kit: str, token: str | None = None) -> ClientSecurity:
    """A participant's credentials from its own kit (`token`: another token of the same participant)."""
    folder = kits / kit
    stem = folder / ("tls/coordinator-client" if kit == "server" else "tls/client")
    if token is None:
        token = (folder / ("secrets/coordinator.token" if kit == "server" else "secrets/token")).read_text().strip()
    return ClientSecurity(token=token, ca=(folder / "ca.crt").read_bytes(), cert_chain=stem.with_suffix(".crt").read_bytes(),
                          private_key=stem.with_suffix(".key").read_bytes())


def start(script: Path, logs: Path, **settings: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    env.update(settings, FEDBROKER=f"{sys.executable} -m fedbroker", PYTHONPATH=PYTHONPATH)
    log = open(logs / f"{script.stem}.log", "wb")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen([str(script)], cwd=logs, env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_serving(targets: list[str], credentials: ClientSecurity, processes: list[subprocess.Popen[bytes]],
                 logs: Path) -> None:
    deadline = time.monotonic() + 180
    for target in targets:
        channel = credentials.channel(target, [])
        try:
            while True:
                try:
                    grpc.channel_ready_future(channel).result(timeout=1)
                    break
                except grpc.FutureTimeoutError:
                    if not all(p.poll() is None for p in processes) or time.monotonic() > deadline:
                        raise AssertionError("\n".join(p.read_text(errors="replace")[-3000:]
                                                       for p in sorted(logs.glob("*.log")))) from None
        finally:
            channel.close()


@dataclass(frozen=True)
class Changed:
    """A provisioned project after month three, its services started from the server kit."""

    kits: Path
    aggregator: str     # targets, by the name the server certificates carry
    coordinator: str
    old_token: str      # site-a's token before its rotation


@pytest.fixture(scope="module")
def changed(tmp_path_factory: pytest.TempPathFactory, rabbitmq_url: str) -> Iterator[Changed]:
    from fedbroker.bus import delete_topology

    root = tmp_path_factory.mktemp("month3")
    ports = {"coordinator_port": free_port(), "aggregator_port": free_port(), "broker_port": free_port()}
    namespace = f"fedbroker-month3{ports['coordinator_port']}"
    kits = root / "kits"
    provision(parse_project({
        "name": "month3", "server": {"host": "localhost", "listen": "127.0.0.1", "namespace": namespace, **ports,
                                     "aggregator_metrics_port": 0, "coordinator_metrics_port": 0},
        "sites": [{"name": "site-a"}, {"name": "site-b"}], "scientists": [{"name": "sci"}],
    }), kits)
    old_token = (kits / "sites/site-a/secrets/token").read_text().strip()
    lifecycle.add(kits, site={"name": "site-c"})
    lifecycle.revoke(kits, name="site-b", reason="key_compromise")
    lifecycle.rotate_token(kits, name="site-a")
    lifecycle.renew(kits, name="sci")
    logs = root / "logs"
    logs.mkdir()
    broker = {f"FEDBROKER__BROKER__{key}": "" for key in ("URL_FILE", "CA_FILE", "CERT_FILE", "KEY_FILE")}
    processes = [start(kits / "server/start-aggregator.sh", logs),
                 start(kits / "server/start-coordinator.sh", logs, **broker, FEDBROKER__BROKER__URL=rabbitmq_url)]
    found = Changed(kits, f"localhost:{ports['aggregator_port']}", f"localhost:{ports['coordinator_port']}", old_token)
    try:
        wait_serving([found.aggregator, found.coordinator], security(kits, "server"), processes, logs)
        yield found
    finally:
        stop_all(processes)
        delete_topology(rabbitmq_url, namespace, [])


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_changed_server_kit_serves_the_added_the_rotated_and_the_renewed_and_refuses_the_revoked(changed):
    kits = changed.kits
    with AggregatorClient(changed.aggregator, security=security(kits, "server"), timeout_s=10) as coordinator:
        coordinator.put_global("shared", 1, SPEC.to_json(), WEIGHTS)
    for who in (security(kits, "sites/site-c"), security(kits, "sites/site-a"),
                security(kits, "sites/site-a", token=changed.old_token)):  # added; rotating: both tokens
        with AggregatorClient(changed.aggregator, security=who, timeout_s=10) as client:
            assert client.download("shared")[0] == 1
    with (AggregatorClient(changed.aggregator, security=security(kits, "sites/site-b"), timeout_s=10) as revoked,
          pytest.raises(RemoteError) as refused):
        revoked.download("shared")
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    scientist = CoordinatorClient(changed.coordinator, security=security(kits, "scientists/sci"), timeout_s=10)
    try:
        assert not scientist.status().jobs   # the renewed certificate and the kept token: served
    finally:
        scientist.close()
