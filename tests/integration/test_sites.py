"""The operator's view of the sites, end to end: a real coordinator process and two real worker processes on a
RabbitMQ node of the session's own (each site with its own broker user, bound to its worker id as `fedbroker
provision` binds them), `fedbroker sites list | show | logs` over gRPC.

Each site's startup warning (it trains tasks from any broker user) reaches `sites logs`; a log record published
with site a's credentials but naming site b is filed under a, never b. The users are added to the private node
(never the machine's broker) and deleted at the end, with the namespace's queues and exchanges.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.app.cli import main
from fedbroker.app.demo import free_port
from fedbroker.bus import delete_topology, envelope, open_bus
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker.ledger import PrivacyLedger
from tests.faults.harness import job
from tests.integration.processes import stop_all
from tests.rabbitmq_node import PrivateRabbitMQ
from tests.source_roots import PYTHONPATH

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

SITES = {"site-a": "a", "site-b": "b"}  # broker user → worker id
PASSWORD = "sites-test-password"


def until(condition: Callable[[], Any], *, what: str, within_s: float = 150.0,
          processes: tuple[subprocess.Popen[bytes], ...] = (), logs: Path | None = None) -> Any:
    """Wait on a condition, never on a clock reading; a process that died fails at once with its log."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        if any(p.poll() is not None for p in processes):
            raise AssertionError(f"a process died while waiting for {what}:\n{_tail(logs)}")
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}:\n{_tail(logs)}")


def _tail(logs: Path | None) -> str:
    if logs is None:
        return ""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log")))


def url_of(node: PrivateRabbitMQ, user: str) -> str:
    return f"amqp://{user}:{PASSWORD}@127.0.0.1:{node.amqp_port}/%2F"


def spawn(verb: str, settings: dict[str, Any], log: Path, *, config: Path | None = None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    env["PYTHONPATH"] = PYTHONPATH
    env.update({"FEDBROKER__" + k.upper().replace(".", "__"): str(v) for k, v in settings.items()})
    return subprocess.Popen([sys.executable, "-m", "fedbroker", verb, *(["--config", str(config)] if config else [])],
                            env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def bind(config: Path, users: dict[str, str]) -> None:
    """The coordinator's followed config file binds these broker users to their sites (`provision` writes it)."""
    config.write_text(json.dumps({"coordinator": {"worker_broker_users": {u: [w] for u, w in users.items()}}}))


class Deployment:
    """The aggregation service here; the coordinator and the two sites as processes of their own."""

    def __init__(self, node: PrivateRabbitMQ, tmp: Path) -> None:
        self.node, self.tmp = node, tmp
        self.namespace = f"fbsites-{uuid.uuid4().hex[:8]}"
        self.logs = tmp / "logs"
        self.logs.mkdir()
        for user in SITES:
            node.ctl("add_user", user, PASSWORD)
            node.ctl("set_permissions", "-p", "/", user, ".*", ".*", ".*")
        self.server, port = serve(RoundBook())
        self.listen = f"127.0.0.1:{free_port()}"
        self.config = tmp / "coordinator.yaml"  # followed while it runs: revoking a site edits it
        bind(self.config, SITES)
        self.processes = [spawn("coordinator", {
            "broker.url": node.url, "broker.namespace": self.namespace, "aggregator.target": f"127.0.0.1:{port}",
            "coordinator.listen": self.listen, "coordinator.state_dir": str(tmp / "state"),
        }, self.logs / "coordinator.log", config=self.config)]

    def start_site(self, user: str, index: int, *, dp: bool) -> None:
        worker_id = SITES[user]
        ledger = self.tmp / f"{worker_id}-ledger.json"
        if dp:  # ε this site spent before: its registration claims it
            PrivacyLedger(str(ledger), worker_id=worker_id).record("earlier-job", history=[[1.0, 0.01, 10.0]],
                                                                   epsilon=0.75)
        self.processes.append(spawn("worker", {
            "broker.url": url_of(self.node, user), "broker.namespace": self.namespace, "worker.id": worker_id,
            "worker.partition.num_clients": 2, "worker.partition.client_index": index, "worker.device": "cpu",
            "worker.ledger_path": str(ledger), "worker.heartbeat_s": 1, "worker.torch_threads": 1,
            "worker.dp.enabled": str(dp).lower(), "worker.dp.epsilon_budget": 10,
        }, self.logs / f"{worker_id}.log"))

    def cli(self, capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
        code = main([*argv, "--coordinator", self.listen])
        out, _ = capsys.readouterr()
        return code, out

    def close(self) -> None:
        stop_all(list(reversed(self.processes)))
        self.server.stop(grace=0)
        delete_topology(self.node.url, self.namespace, list(SITES.values()))
        for user in SITES:  # the session's later tests share the node
            self.node.ctl("delete_user", user)


@pytest.fixture
def deployment(private_rabbitmq: PrivateRabbitMQ, tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(private_rabbitmq, tmp_path)
    try:
        yield d
    finally:
        d.close()


def test_the_operator_sees_every_site_its_warnings_and_a_forged_log_filed_under_its_real_sender(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    d = deployment
    d.start_site("site-a", 0, dp=True)
    d.start_site("site-b", 1, dp=False)

    def listed() -> dict[str, Any] | None:
        code, out = d.cli(capsys, "sites", "list", "--json")
        sites = {s["worker_id"]: s for s in json.loads(out)} if code == 0 else {}
        ready = set(sites) == {"a", "b"} and all(s["software_version"] and s["active"] for s in sites.values())
        return sites if ready else None

    sites = until(listed, what="both sites listed, active, with their version", processes=tuple(d.processes),
                  logs=d.logs)
    a, b = sites["a"], sites["b"]
    assert a["last_heartbeat_unix"] > 0 and b["last_heartbeat_unix"] > 0
    # the 0.75 on a's ledger is its own claim: advisory, never recorded (the coordinator priced nothing yet)
    assert a["epsilon_recorded"] == 0.0 and b["epsilon_recorded"] == 0.0
    assert a["dp_enabled"] and a["dp_policy"]["epsilon_budget"] == 10.0 and not b["dp_enabled"]
    assert a["input_shape"] == [1, 8, 8] and a["num_classes"] == 10 and a["num_samples"] > 0
    assert (a["broker_user"], b["broker_user"]) == ("site-a", "site-b")

    def logs_of(site: str) -> list[dict[str, Any]]:
        code, out = d.cli(capsys, "sites", "logs", site, "--json")
        assert code == 0, out
        return [json.loads(line) for line in out.splitlines()]

    for site in ("a", "b"):  # each site's own startup warning, filed under it
        until(lambda s=site: any("trains tasks from any broker user" in r["message"] and r["level"] == "WARNING"  # type: ignore[misc]
                                 for r in logs_of(s)), what=f"site {site}'s warning", logs=d.logs)

    forger = open_bus(url_of(d.node, "site-a"), namespace=d.namespace)
    try:  # site a's credentials, a record that names site b
        forger.publish_control(envelope.encode(site_log=pb.SiteLog(
            worker_id="b", time_unix=time.time(), level="ERROR", logger="fedbroker.worker", message="b is on fire")))
    finally:
        forger.close()
    forged = until(lambda: [r for r in logs_of("a") if r["message"] == "b is on fire"], what="the forged record",
                   logs=d.logs)
    assert (forged[0]["sender"], forged[0]["claimed"]) == ("site-a", "b")
    assert not [r for r in logs_of("b") if "on fire" in r["message"]]

    code, out = d.cli(capsys, "sites", "show", "a")
    assert code == 0 and "misnamed_log" in out and "registered" in out and "site-a" in out, out
    code, out = d.cli(capsys, "sites", "show", "nobody")
    assert code == 1


def test_a_revoked_site_leaves_selection_at_once_and_is_listed_revoked(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 30 item 12: site b's binding is removed from the coordinator's followed config (what revoking it does)
    while its worker keeps beating; `sites list` must show it revoked, and the next job must select site a
    alone (before, b was still active and selected: the job waited on it)."""
    d = deployment
    d.start_site("site-a", 0, dp=False)
    d.start_site("site-b", 1, dp=False)

    def sites() -> dict[str, Any]:
        code, out = d.cli(capsys, "sites", "list", "--json")
        return {s["worker_id"]: s for s in json.loads(out)} if code == 0 else {}

    until(lambda: set(sites()) == {"a", "b"} and all(s["active"] for s in sites().values()),
          what="both sites active", processes=tuple(d.processes), logs=d.logs)
    bind(d.config, {"site-a": "a"})
    listed = until(lambda: (s := sites()) and s["b"]["state"] == "revoked" and s,
                   what="site b listed revoked", processes=tuple(d.processes), logs=d.logs)
    assert not listed["b"]["active"] and listed["a"]["active"] and listed["a"]["state"] != "revoked"
    spec = d.tmp / "job.json"
    spec.write_text(json.dumps(job(training={"rounds": 1}, schedule={"min_workers": 1, "min_clients": 1})))
    code, out = d.cli(capsys, "submit", str(spec), "--json")
    assert code == 0, out
    job_id = json.loads(out)["job_id"]
    def shown() -> dict[str, Any]:
        code, out = d.cli(capsys, "jobs", "show", job_id, "--json")
        assert code == 0, out
        return dict(json.loads(out))

    until(lambda: shown()["status"] in ("completed", "failed"), what="the job to end", processes=tuple(d.processes),
          logs=d.logs)
    shown_job = shown()
    assert shown_job["status"] == "completed", shown_job
    assert {p["worker_id"] for p in shown_job["participants"]} == {"a"}, shown_job
