"""A consortium's life, from its kits only: provisioned (two sites, one scientist), started for real, grown by a
site, renewed, and one site revoked, with no server process restarted.

The broker is a RabbitMQ node of the test's own run from the server kit as a host operator runs it (the kit's
rabbitmq.conf and advanced.config: AMQPS with mutual TLS, the CRL check; never the machine's broker); the
aggregation service and the coordinator are `fedbroker` processes from the server kit's start scripts, the
workers from their site kits' `start.sh`, the scientist is the CLI with its kit's fedbroker.yaml. The steps are
deploy/OPERATING.md's "Month three", in its order:

1. jobs run with the two sites; 2. `provision add` a third site and the `broker sync` command it prints: the
third worker registers (`sites list`) and trains; 3. `provision renew` (every certificate, the tokens kept):
the running services serve the renewed certificate, the workers restarted with their renewed kits register
again; 4. `provision revoke` one site and its printed `broker sync --crl`: its gRPC calls are refused
(`certificate revoked`), its broker connection is closed, its login and its TLS handshake refused, while a job
with the other two sites completes.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pika
import pika.exceptions
import pytest
import yaml

from fedbroker.app.cli import main
from fedbroker.app.launch import client_security
from fedbroker.config import load_config
from fedbroker.coordinator.service import CoordinatorClient
from fedbroker.job.status import FINISHED
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.rpc.plumbing import RemoteError
from tests.rabbitmq_node import KitBroker, amqps, free_ports, missing, server_scripts
from tests.source_roots import PYTHONPATH

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

WAIT_S = 600.0   # a hang guard, never a timing the test relies on (2 loaded cores, DP training)


def worker_settings(index: int) -> dict[str, Any]:
    """A site's worker settings (project.yaml's sites[i].worker): a third of digits, DP on and cheap."""
    return {"dataset": "digits", "partition": {"num_clients": 3, "client_index": index}, "device": "cpu",
            "torch_threads": 1, "heartbeat_s": 1, "metrics_port": 0,
            "dp": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "epsilon_budget": 50}}


def job(name: str, *, rounds: int, workers: int) -> dict[str, Any]:
    """A small job: one linear layer on digits; every selected site must upload unless `workers` say fewer may."""
    return {"name": name, "category": "digits", "seed": 3,
            "model": {"input_shape": [1, 8, 8], "layers": [{"type": "Flatten"},
                                                            {"type": "Linear", "in_features": 64, "out_features": 10}]},
            "training": {"rounds": rounds, "local_epochs": 1, "batch_size": 64, "lr": 0.2},
            "schedule": {"min_workers": workers, "quorum": workers, "min_clients": workers,
                         "wait_for_workers_s": WAIT_S, "round_timeout_s": 1200}}


def security(kit: Path) -> ClientSecurity:
    """A site's credentials as its kit holds them."""
    return ClientSecurity(token=(kit / "secrets/token").read_text().strip(), ca=(kit / "ca.crt").read_bytes(),
                          cert_chain=(kit / "tls/client.crt").read_bytes(),
                          private_key=(kit / "tls/client.key").read_bytes())


class Consortium:
    """The provisioned folder, the broker run from its server kit, and every process started from a kit."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.kits = root / "kits"
        self.logs = root / "logs"
        self.logs.mkdir()
        # the broker's host-only ports too: this machine's own broker may hold 15672/15692/25672
        self.ports = dict(zip(("coordinator_port", "aggregator_port", "broker_port", "broker_management_port",
                               "broker_metrics_port", "broker_dist_port"), free_ports(6), strict=True))
        self.name = f"life{uuid.uuid4().hex[:6]}"
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.unwatched: set[str] = set()   # processes that may exit now (a revoked site's worker)
        self.broker: KitBroker | None = None

    @property
    def server(self) -> Path:
        return self.kits / "server"

    def kit(self, site: str) -> Path:
        return self.kits / "sites" / site

    def environment(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
        return {**env, "PYTHONPATH": PYTHONPATH, "FEDBROKER": f"{sys.executable} -m fedbroker", **extra}

    def start(self, name: str, script: Path) -> None:
        """A kit's start script, as its participant runs it (it changes into its kit first)."""
        log = (self.logs / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen([str(script)], env=self.environment(), stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self, name: str) -> None:
        process = self.processes.pop(name)
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)   # the start script's session: it and its worker
            except ProcessLookupError:   # exited meanwhile
                pass
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(30)

    def fedbroker(self, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        """A fedbroker command in a process of its own; its output, or a failure naming what it said."""
        done = subprocess.run([sys.executable, "-m", "fedbroker", *args], cwd=cwd or self.root,
                              env=env or self.environment(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"fedbroker {shlex.join(args)}: {done.stdout}\n{done.stderr}"
        return done.stdout

    def scientist(self, *args: str) -> Any:
        """The scientist's CLI in its kit's folder, with its kit's config; its JSON."""
        out = self.fedbroker(*args, "--json", "--config", "fedbroker.yaml", cwd=self.kits / "scientists/sci")
        return json.loads(out) if out.lstrip().startswith(("{", "[")) else [json.loads(x) for x in out.splitlines()]

    def sync(self, printed: str) -> str:
        """Run the `fedbroker broker sync` line `provision` printed for the broker's host, exactly as printed, in
        the broker's host's environment (the kit's node is named in the line; its cookie and epmd port are in the
        environment)."""
        (line,) = [x.strip() for x in printed.splitlines() if x.strip().startswith("fedbroker broker sync")
                   and "--rabbitmqctl" not in x]
        assert self.broker is not None and f"--node {self.broker.name}" in line, line
        return self.fedbroker(*shlex.split(line)[1:], env=self.environment(**self.broker.env))

    def alive(self) -> None:
        for name, process in self.processes.items():
            assert name in self.unwatched or process.poll() is None, f"{name} exited with {process.returncode}\n{self.tail()}"

    def tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.logs.glob("*")))

    def until(self, condition: Callable[[], Any], what: str) -> Any:
        """Wait on a condition (the processes alive meanwhile), never on a clock reading."""
        end = time.monotonic() + WAIT_S
        while time.monotonic() < end:
            self.alive()
            value = condition()
            if value:
                return value
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}\n{self.tail()}")

    def sites(self) -> dict[str, dict[str, Any]]:
        return {s["worker_id"]: s for s in self.scientist("sites", "list")}

    def run_job(self, name: str, *, rounds: int, workers: int) -> dict[str, Any]:
        """Submit as the scientist and wait for the job to end; its `jobs show` document, completed."""
        path = self.kits / "scientists/sci" / f"{name}.json"
        path.write_text(json.dumps(job(name, rounds=rounds, workers=workers)))
        job_id = self.scientist("submit", path.name)["job_id"]
        config = load_config(str(self.kits / "scientists/sci/fedbroker.yaml"), environ={})
        client = CoordinatorClient(config.coordinator.target, security=client_security(config), timeout_s=30)

        def ended() -> dict[str, Any] | None:
            # the scientist's own Status through this process's client first: a CLI process per poll kept about
            # one of the two cores importing the package while the sites trained; the CLI once the job has ended
            if not any(job.status in FINISHED for job in client.status(job_id).jobs):
                return None
            doc: dict[str, Any] = self.scientist("jobs", "show", job_id)
            return doc if doc["status"] in FINISHED else None

        try:
            doc = self.until(ended, f"job {name} to end")
        finally:
            client.close()
        assert doc["status"] == "completed", f"{doc.get('error')}\n{self.tail()}"
        assert len(doc["rounds"]) == rounds
        return doc

    def close(self) -> None:
        for process in self.processes.values():   # all asked to stop at once, then each waited for
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for name in list(self.processes):
            self.stop(name)
        if self.broker is not None:
            self.broker.stop()


def trained(doc: dict[str, Any]) -> set[str]:
    """The sites whose update went into every round of the job."""
    rounds = {r["round"] for r in doc["rounds"]}
    by_round = [{p["worker_id"] for p in doc["participants"] if p["round"] == r and p["status"] == "aggregated"}
                for r in rounds]
    return set.intersection(*by_round)


def served_certificate(port: int, kit: Path) -> bytes:
    """The certificate a gRPC port presents now, to a new handshake with `kit`'s credentials (DER)."""
    context = ssl.create_default_context(cafile=str(kit / "ca.crt"))
    context.load_cert_chain(str(kit / "tls/client.crt"), str(kit / "tls/client.key"))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("localhost", port), timeout=30) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def pem_to_der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


@pytest.fixture
def consortium(tmp_path: Path) -> Iterator[Consortium]:
    c = Consortium(tmp_path)
    try:
        yield c
    finally:
        c.close()


def test_a_consortium_grows_renews_and_revokes_a_site_while_its_services_run(consortium: Consortium,
                                                                             capsys: pytest.CaptureFixture[str]):
    c = consortium
    scripts = server_scripts()   # RabbitMQ is needed: a failure on CI, a skip on a machine without it
    if shutil.which("epmd") is None:
        missing("epmd (Erlang's port mapper, part of erlang-base) is not on PATH: the kit's broker needs it")
    # 0. provision, as the operator does
    project = c.root / "project.yaml"
    project.write_text(yaml.safe_dump({
        "name": c.name,
        "server": {"host": "localhost", "listen": "127.0.0.1", "namespace": f"fedbroker-{c.name}", **c.ports,
                   "aggregator_metrics_port": 0, "coordinator_metrics_port": 0},
        "sites": [{"name": "site-a", "worker": worker_settings(0)}, {"name": "site-b", "worker": worker_settings(1)}],
        "scientists": [{"name": "sci"}]}))
    assert main(["provision", str(project), "--out", str(c.kits)]) == 0
    capsys.readouterr()

    # 1. the server side and two sites, from their kits (the broker by its start-broker.sh); a job as the scientist
    c.broker = KitBroker(c.server, scripts, c.kit("site-a"))
    c.broker.start()
    c.start("aggregator", c.server / "start-aggregator.sh")
    c.start("coordinator", c.server / "start-coordinator.sh")
    for site in ("site-a", "site-b"):
        c.start(site, c.kit(site) / "start.sh")
    c.until(lambda: _quiet(c.sites) and set(c.sites()) == {"site-a", "site-b"}, "both sites to register")
    first = c.run_job("first", rounds=2, workers=2)
    assert trained(first) == {"site-a", "site-b"}

    add_a_site(c)
    renew_everything(c, capsys)
    revoke_a_site(c, capsys, first["job_id"])
    # ... and the other two sites, restarted with their renewed kits, train on without it
    third = c.run_job("third", rounds=1, workers=2)
    assert trained(third) == {"site-a", "site-c"}


def add_a_site(c: Consortium) -> None:
    """Step 2: `provision add --apply-broker`; the new site registers and trains, the kits handed out unchanged."""
    # 2. a third site: its kit, its broker user synced by `provision add --apply-broker`, its worker registers
    extra = c.root / "site-c-worker.yaml"
    extra.write_text(yaml.safe_dump(worker_settings(2)))
    untouched = {site: _files(c.kit(site)) for site in ("site-a", "site-b")}
    assert c.broker is not None   # on the broker's host: `--apply-broker` runs the sync line it prints
    printed = c.fedbroker("provision", "add", "--out", str(c.kits), "--site", "site-c", "--worker", str(extra),
                          "--apply-broker", env=c.environment(**c.broker.env))
    assert "fedbroker broker sync " in printed and f"add {c.name}-site-c" in printed, printed
    assert {site: _files(c.kit(site)) for site in ("site-a", "site-b")} == untouched   # the kits handed out
    c.start("site-c", c.kit("site-c") / "start.sh")

    def three_listed() -> dict[str, dict[str, Any]] | None:
        sites = c.sites()
        return sites if set(sites) == {"site-a", "site-b", "site-c"} and all(
            s["active"] and s["last_heartbeat_unix"] > 0 and "epsilon_recorded" in s for s in sites.values()) else None

    listed = c.until(three_listed, "the third site to register (sites list)")
    assert listed["site-c"]["broker_user"] == f"{c.name}-site-c" and listed["site-c"]["dp_enabled"]
    assert listed["site-a"]["epsilon_recorded"] > 0 and listed["site-b"]["epsilon_recorded"] > 0   # the first job's
    second = c.run_job("second", rounds=1, workers=3)
    assert trained(second) == {"site-a", "site-b", "site-c"}
    c.until(lambda: c.sites()["site-c"]["epsilon_recorded"] > 0, "site-c's ε to reach the coordinator")


def renew_everything(c: Consortium, capsys: pytest.CaptureFixture[str]) -> None:
    """Step 3: `provision renew`; the services serve the renewed certificates, the restarted workers register."""
    # 3. renew every certificate (tokens kept): the running services serve the renewed ones on new handshakes
    tokens = {site: (c.kit(site) / "secrets/token").read_bytes() for site in ("site-a", "site-b", "site-c")}
    old = pem_to_der(c.server / "tls/coordinator.crt")
    assert main(["provision", "renew", "--out", str(c.kits)]) == 0
    capsys.readouterr()
    assert {site: (c.kit(site) / "secrets/token").read_bytes() for site in tokens} == tokens
    renewed = pem_to_der(c.server / "tls/coordinator.crt")
    assert renewed != old
    c.until(lambda: served_certificate(c.ports["coordinator_port"], c.kit("site-a")) == renewed,
            "the coordinator to serve its renewed certificate")
    c.until(lambda: served_certificate(c.ports["aggregator_port"], c.kit("site-a")) == pem_to_der(
        c.server / "tls/aggregator.crt"), "the aggregation service to serve its renewed certificate")
    restarts = {site: info["restarts"] for site, info in c.sites().items()}   # the scientist's renewed kit
    for site in ("site-a", "site-b", "site-c"):   # each site restarts its worker with its renewed kit
        c.stop(site)
        c.start(site, c.kit(site) / "start.sh")
    c.until(lambda: all(s["restarts"] > restarts[w] and s["active"] for w, s in c.sites().items()),
            "the workers to register again with their renewed kits")


def revoke_a_site(c: Consortium, capsys: pytest.CaptureFixture[str], first_job: str) -> None:
    """Step 4: `provision revoke` site-b and the sync it prints: refused by gRPC and by the broker."""
    # 4. revoke site-b: the CRL, its token, its broker user; the printed sync applies it to the running broker
    coordinator = f"localhost:{c.ports['coordinator_port']}"
    assert site_record(coordinator, c.kit("site-b")).worker.worker_id == "site-b"   # its own record, until revoked
    assert c.broker is not None
    broker = c.broker
    connected = lambda: broker.ctl("list_connections", "user", "-q", "--no-table-headers").split()  # noqa: E731
    assert f"{c.name}-site-b" in connected()
    assert main(["provision", "revoke", "--out", str(c.kits), "--name", "site-b", "--reason", "key_compromise"]) == 0
    printed = capsys.readouterr().out
    c.unwatched.add("site-b")   # its worker is cut off from here on: it may give up and exit
    synced = c.sync(printed)
    assert f"delete and disconnect {c.name}-site-b" in synced and "installed" in synced
    c.until(lambda: f"{c.name}-site-b" not in connected(), "the broker to close site-b's connections")
    log = c.logs / "site-b.log"   # its worker tells its operator why it cannot reconnect
    c.until(lambda: "the broker refused this client's certificate: it is revoked" in log.read_text(errors="replace"),
            "site-b's worker to log that its certificate is revoked")

    with AggregatorClient(f"localhost:{c.ports['aggregator_port']}", security=security(c.kit("site-b")),
                          timeout_s=30) as client, pytest.raises(RemoteError) as refused:
        client.download(first_job)
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED and "certificate revoked" in str(refused.value)
    with pytest.raises(grpc.RpcError) as info:
        site_record(coordinator, c.kit("site-b"))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "certificate revoked" in info.value.details()
    with pytest.raises(pika.exceptions.AMQPConnectionError) as handshake:   # the broker's own CRL check
        amqps(c.kit("site-b")).close()
    assert "CERTIFICATE_REVOKED" in repr(handshake.value), repr(handshake.value)
    with pytest.raises((pika.exceptions.ProbableAuthenticationError, pika.exceptions.AuthenticationError)):
        amqps(c.kit("site-b"), cert_of=c.kit("site-a")).close()   # its password, another site's valid certificate
    amqps(c.kit("site-a")).close()   # the others log in as before
    # the operator's view: the running coordinator noted the revocation as it saw coordinator.yaml change
    c.until(lambda: "revoked" in [e["kind"] for e in c.scientist("sites", "show", "site-b")["events"]],
            "site-b's revoked event in `sites show`")
    assert site_record(coordinator, c.kit("site-a")).worker.worker_id == "site-a"


def site_record(target: str, kit: Path) -> Any:
    """SiteRecord with a site kit's token and certificate: its own record at the coordinator."""
    client = CoordinatorClient(target, security=security(kit), timeout_s=30)
    try:
        return client.site_record()
    finally:
        client.close()


def _quiet(call: Callable[[], Any]) -> bool:
    """Whether `call` answers (the coordinator may still be starting)."""
    try:
        call()
        return True
    except AssertionError:
        return False


def _files(folder: Path) -> dict[str, bytes]:
    """A kit's files as handed out (its worker's own state left aside)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and "state" not in p.relative_to(folder).parts}
