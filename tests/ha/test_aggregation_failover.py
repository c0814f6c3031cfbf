"""Chaos: kill -9 of the aggregation replica that owns a job, mid-round, after it acknowledged updates and
before the close. Real processes: two `fedbroker aggregator` replicas on one spool folder (the shared volume)
and one lease database (a SQLite file both reach), a coordinator that lists both (`aggregator.targets`), two
DP workers on the machine's RabbitMQ under a fresh namespace. The second worker holds its round-1 task until the
owner is dead, so its upload meets the failover; the first uploaded to the owner before it died.

The job finishes on the surviving replica with 0 updates lost and 0 counted twice (every round aggregates both
workers once each), and each worker's ε is spent once: its ledger holds one round's training steps per round
and the ε the coordinator recorded is the ledger's. A clean stop of the survivor then releases the job's lease. The failover time (kill → the survivor holds the job's lease) is
printed and written to failover.json in the test's folder; the test asserts on none of its timings.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedbroker.aggregators.ownership import advertised, lease_engine
from fedbroker.aggregators.spool import job_folder
from fedbroker.ha.lease import Lease
from fedbroker.worker.ledger import PrivacyLedger
from tests.faults.harness import job, wait_for
from tests.ha.replicas import killed_at_the_end, start_replicas
from tests.integration.processes import Deployment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

WORKERS = ["w1", "w2"]
HELD = "w2"
ROUNDS = 2
LOCAL_EPOCHS = 1
LEASE_TTL_S = 3.0


@pytest.fixture
def deployment(rabbitmq_url: str, tmp_path: Path) -> Iterator[Deployment]:
    with killed_at_the_end(rabbitmq_url, tmp_path, name="aggfailover", workers=WORKERS) as d:
        yield d


def start(d: Deployment) -> dict[str, str]:
    """Both replicas, the coordinator and the workers; the replicas' names by advertised address."""
    return start_replicas(d, WORKERS, held=[HELD], lease_ttl_s=LEASE_TTL_S)


def accepted_in_spool(d: Deployment, job_id: str, round_number: int) -> int:
    folder = job_folder(d.tmp / "spool", job_id) / f"round-{round_number}"
    return len(list(folder.glob("[0-9]*.npz"))) if folder.is_dir() else 0


def test_the_job_survives_a_kill_9_of_its_owning_replica_mid_round(deployment: Deployment) -> None:
    d = deployment
    names = start(d)
    wait_for(lambda: d.registered(len(WORKERS)), 120, "the workers to register")
    path = d.tmp / "job.json"
    path.write_text(json.dumps(job(training={"rounds": ROUNDS, "local_epochs": LOCAL_EPOCHS},
                                   schedule={"min_workers": len(WORKERS)})))
    job_id = json.loads(d.cli("submit", str(path), "--json"))["job_id"]

    # mid-round by construction: the two free workers' round-1 updates acknowledged, the third holding its task
    wait_for(lambda: accepted_in_spool(d, job_id, 1) == 1 and (d.tmp / f"holding-{HELD}").exists(), 120,
             "one acknowledged round-1 update, the other worker holding its task")
    lease = Lease(lease_engine(f"sqlite:///{d.tmp / 'leases.sqlite'}"), f"job:{job_id}", "the test")
    held_by = lease.holder_now()
    assert held_by is not None
    owner = names[advertised(held_by[0])]
    survivor = next(name for name in names.values() if name != owner)
    d.alive()
    killed_at = time.monotonic()
    os.kill(d.processes[owner].pid, signal.SIGKILL)
    d.processes[owner].wait(30)
    (d.tmp / "release").touch()

    now: Any = wait_for(lambda: (h := lease.holder_now()) is not None and names.get(advertised(h[0])) == survivor and h,
                        60, "the surviving replica to take the job over", interval=0.02)
    failover_s = time.monotonic() - killed_at
    record = {"case": "aggregation owner kill -9 mid-round", "failover_s": round(failover_s, 3),
              "lease_ttl_s": LEASE_TTL_S, "term": now[1]}
    (d.tmp / "failover.json").write_text(json.dumps(record))
    print(f"\naggregation failover: kill -9 of {owner} → {survivor} holds the job after {failover_s:.2f} s "
          f"(lease ttl {LEASE_TTL_S:g} s, term {now[1]})")

    wait_for(lambda: d.job_ended(job_id), 150, "the job to end")
    d.alive(survivor, "coordinator", *WORKERS)
    doc: dict[str, Any] = json.loads(d.cli("jobs", "show", job_id, "--json"))
    assert doc["status"] == "completed", doc.get("error")
    for number in range(1, ROUNDS + 1):  # 0 updates lost, 0 counted twice
        rows = [p for p in doc["participants"] if p["round"] == number and p["status"] == "aggregated"]
        assert sorted(p["worker_id"] for p in rows) == WORKERS, doc["participants"]
    for worker in WORKERS:  # ε spent once per round, and recorded as spent
        ledger = PrivacyLedger(str(d.tmp / f"{worker}-ledger.json"), worker_id=worker)
        history = ledger.history(job_id)  # (noise, sampling rate, steps), steps summed over equal rates
        steps_per_round = round(LOCAL_EPOCHS / history[0][1])
        assert sum(steps for _, _, steps in history) == ROUNDS * steps_per_round, (worker, history)
        recorded = max(p["epsilon"] for p in doc["participants"] if p["worker_id"] == worker)
        assert recorded == pytest.approx(ledger.epsilon(job_id), rel=1e-9), worker

    d.processes[survivor].terminate()  # a clean stop hands the job on at once: its lease is released
    d.processes[survivor].wait(30)
    released = lease.holder_now()
    assert released is not None and released[2] == 0.0
