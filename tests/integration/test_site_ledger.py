"""`fedbroker ledger --json` on a site after a real job with DP: what its ledger recorded and what the coordinator
recorded for it (the SiteRecord call, asked with the site's own token, authentication on), side by side and
consistent. The federation is tests/integration/conftest.py's: real RabbitMQ, real gRPC on loopback."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import yaml

from fedbroker.app.cli import main
from fedbroker.bus import open_bus
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig
from fedbroker.coordinator.service import serve
from fedbroker.job.spec import parse_job
from fedbroker.worker.agent import WorkerAgent
from tests.integration.test_federation import JOB
from tests.security.conftest import token_table

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

POLICY = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=50.0)
HISTOGRAM_EPSILON = 0.5


def add_worker(federation, worker_id: str, index: int) -> WorkerAgent:
    """A DP worker; its noised label histogram is released (and charged to its ledger) when a job asks for it."""
    bus = open_bus(federation.url, namespace=federation.namespace)
    agent = WorkerAgent(WorkerConfig(
        id=worker_id, partition=PartitionSection(scheme="iid", num_clients=2, client_index=index), dp=POLICY,
        ledger_path=str(federation.tmp / f"{worker_id}-ledger.json"), device="cpu", heartbeat_s=1.0,
        histogram_epsilon=HISTOGRAM_EPSILON), bus)
    agent.start()
    bus.start()
    federation.workers[worker_id] = agent
    return agent


def wait_until(predicate, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout  # a hang guard, not a measure: the condition ends the wait
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_the_sites_ledger_command_equals_its_ledger_and_the_coordinators_record(federation, tmp_path, capsys,
                                                                                monkeypatch):
    agents = [add_worker(federation, f"site{i}", i) for i in range(2)]
    job = copy.deepcopy(JOB)
    job["training"]["rounds"] = 2
    job["schedule"]["min_workers"] = 2
    job["aggregation"] = {**job.get("aggregation", {}), "weighting": "dwfed"}  # asks the sites for their histograms
    job_id = federation.coordinator.submit(parse_job(job))
    assert federation.coordinator.wait(job_id, timeout=280) == "completed", federation.store.job(job_id).error
    store = federation.store
    for agent in agents:  # the record is the training the coordinator priced: the job's ε on each ledger
        wait_until(lambda a=agent: store.recorded_epsilon(a.config.id) == a.ledger.epsilon(job_id),
                   f"the coordinator never recorded {agent.config.id}'s ε")

    table, tokens = token_table({"site0": "worker", "site1": "worker"})
    server, port = serve(federation.coordinator, tokens=table)
    site = agents[0]
    ledger_path = site.config.ledger_path
    config = tmp_path / "worker.yaml"
    config.write_text(yaml.safe_dump({
        "worker": {"id": "site0", "ledger_path": ledger_path, "dp": {"noise_multiplier": 1.1, "epsilon_budget": 50.0}},
        "coordinator": {"target": f"127.0.0.1:{port}"}, "client": {"token": tokens["site0"]}}))
    before = {p: Path(p).read_bytes() for p in (ledger_path, ledger_path + ".mark")}
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["ledger", "--config", str(config), "--json"])  # the config names the coordinator: asked
        view = json.loads(capsys.readouterr().out)
    finally:
        server.stop(grace=0)
    assert code == 0
    assert {p: Path(p).read_bytes() for p in before} == before  # read, never written

    ledger = site.ledger
    trained = ledger.epsilon(job_id)
    assert trained > 0
    # the ledger's side: per job, per release, the total
    assert view["jobs"] == [{"job_id": job_id, "epsilon": trained}]
    assert [(r["name"], r["epsilon"]) for r in view["releases"]] == [("label_histogram", HISTOGRAM_EPSILON)]
    assert view["epsilon_total"] == ledger.total_epsilon()
    assert view["epsilon_total"] == pytest.approx(view["epsilon_training"] + view["epsilon_releases"], rel=1e-12)
    assert view["epsilon_training"] == trained and view["epsilon_releases"] == HISTOGRAM_EPSILON
    assert view["dp"]["epsilon_left"] == pytest.approx(50.0 - ledger.total_epsilon(), rel=1e-12)
    assert [(s["job_id"], s["what"], s["epsilon"]) for s in view["shared"]] == [
        (s.job_id, s.what, s.epsilon) for s in ledger.shared()]

    # the coordinator's side, as its store holds it
    remote = view["coordinator"]
    assert remote["error"] == "" and remote["epsilon_recorded"] == store.recorded_epsilon("site0")
    assert remote["epsilon_recorded"] == view["epsilon_training"]  # releases are the ledger's alone
    recorded = [p.epsilon for p in store.participants(job_id) if p.worker_id == "site0"]
    assert remote["jobs"] == [{"job_id": job_id, "status": "completed", "epsilon": max(recorded), "rounds": 2,
                               "shared": list(store.site_jobs("site0")[0].shared)}]
    assert remote["jobs"][0]["shared"] == ["evaluation", "histogram"]  # what the coordinator received from it
    assert remote["jobs"][0]["epsilon"] == trained  # the ε the worker uploaded is the ε its ledger holds
    assert remote["worker"]["worker_id"] == "site0" and remote["worker"]["epsilon_budget"] == 50.0
    assert view["agreement"]["status"] == "agree"
    assert view["agreement"]["jobs"] == [{"job_id": job_id, "ledger_epsilon": trained,
                                          "coordinator_epsilon": trained, "status": "agree"}]
    # the other site's ε is not in this site's view
    assert agents[1].ledger.epsilon(job_id) > 0 and "site1" not in json.dumps(view)
