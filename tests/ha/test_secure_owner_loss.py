"""Chaos: kill -9 of the aggregation replica that owns a SECURE job, mid-round. Real processes, as in
test_aggregation_failover.py: two `fedbroker aggregator` replicas on one spool and one lease database, a
coordinator that lists both, three DP workers (secure aggregation needs three) on the machine's RabbitMQ.

Every worker holds its round-1 task after the round's keys and shares were exchanged, before it trains
(tests/ha/held_worker.py); the owner is killed then. The survivor takes the job over without the round's keys
or masked sum, so it refuses the masked uploads; the coordinator abandons round 1 with that reason and opens
round 2 from the same version, and the job completes there. Each worker trained twice and its ledger says so;
the ε the coordinator recorded is the ledger's (cumulative per job: nothing counted twice, nothing missing).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedbroker.aggregators.ownership import advertised, lease_engine
from fedbroker.ha.lease import Lease
from fedbroker.secagg.secure_round import ROUND_LOST
from fedbroker.worker.ledger import PrivacyLedger
from tests.faults.harness import job, wait_for
from tests.ha.replicas import killed_at_the_end, start_replicas
from tests.integration.processes import Deployment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORKERS = ["w1", "w2", "w3"]
LEASE_TTL_S = 3.0


@pytest.fixture
def deployment(rabbitmq_url: str, tmp_path: Path) -> Iterator[Deployment]:
    with killed_at_the_end(rabbitmq_url, tmp_path, name="secureloss", workers=WORKERS) as d:
        yield d


def start(d: Deployment) -> dict[str, str]:
    """Both replicas, the coordinator and the workers; the replicas' names by advertised address."""
    return start_replicas(d, WORKERS, held=WORKERS, lease_ttl_s=LEASE_TTL_S)


def test_a_secure_round_lost_with_its_owner_is_reopened_and_the_job_completes(deployment: Deployment) -> None:
    d = deployment
    names = start(d)
    wait_for(lambda: d.registered(len(WORKERS)), 120, "the workers to register")
    path = d.tmp / "job.json"
    path.write_text(json.dumps(job(training={"rounds": 1, "local_epochs": 1}, evaluation={"every": 0},
                                   aggregation={"secure": True, "weighting": "fedavg"},
                                   schedule={"min_workers": 3, "min_clients": 3})))
    job_id = json.loads(d.cli("submit", str(path), "--json"))["job_id"]
    wait_for(lambda: all((d.tmp / f"holding-{w}").exists() for w in WORKERS), 120,
             "every worker through round 1's key exchange, holding before it trains")
    held_by = Lease(lease_engine(f"sqlite:///{d.tmp / 'leases.sqlite'}"), f"job:{job_id}", "the test").holder_now()
    assert held_by is not None
    owner = names[advertised(held_by[0])]
    os.kill(d.processes[owner].pid, signal.SIGKILL)
    d.processes[owner].wait(30)
    (d.tmp / "release").touch()

    wait_for(lambda: d.job_ended(job_id), 150, "the job to end")
    doc: dict[str, Any] = json.loads(d.cli("jobs", "show", job_id, "--json"))
    assert doc["status"] == "completed", doc.get("error")
    rounds = {r["round"]: r for r in doc["rounds"]}
    assert (rounds[1]["status"], rounds[2]["status"]) == ("abandoned", "closed"), doc["rounds"]
    for worker in WORKERS:
        rows = {p["round"]: p for p in doc["participants"] if p["worker_id"] == worker}
        assert rows[1]["status"] == "failed" and ROUND_LOST in rows[1]["reason"], rows[1]
        assert rows[2]["status"] == "aggregated", rows[2]
        ledger = PrivacyLedger(str(d.tmp / f"{worker}-ledger.json"), worker_id=worker)
        history = ledger.history(job_id)  # two one-epoch trainings: round 1's (lost) and round 2's
        assert sum(steps for _, _, steps in history) == 2 * round(1 / history[0][1]), (worker, history)
        assert 0 < rows[1]["epsilon"] < rows[2]["epsilon"] == pytest.approx(ledger.epsilon(job_id), rel=1e-9)
