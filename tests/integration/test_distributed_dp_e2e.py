"""A distributed-DP job (privacy.distributed inside aggregation.secure) in a real deployment: the aggregation service,
the coordinator and four workers, each its own `fedbroker` process, on a private RabbitMQ node, each on its own
broker user as kits deploy.

Each site draws a Poisson sample of its records, sums their clipped gradients, scales, rounds and noises the sum with
its Skellam share and masks it; one site (site-4) is killed with SIGKILL right after masking, before its upload. The
round still closes with the three survivors (the job's quorum is 3), and:
- the round's record (`jobs show --json`, `ddp`) names the survivors, each one's declared noise variance, the ring's
  bits, γ and wrap bound, and the sum's total variance, at least the quorum's dose;
- each survivor's ledger holds both ε figures, and the test recomputes them with the accountant
  (`fedbroker.secagg.skellam`) from the recorded noise parameters: the distributed ε from the quorum's dose (which
  the survivors' actual total variance covers, so the figure is conservative), the local floor from its own share;
- the global model moved by the DP-SGD step.
"""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.spool import job_folder
from fedbroker.secagg import skellam
from tests.integration.processes import Deployment
from tests.rabbitmq_node import PrivateRabbitMQ

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WORKERS = ["site-1", "site-2", "site-3", "site-4"]
KILLED = "site-4"
MODES = {"site-1": "local"}  # site-1 adds the whole dose itself; the others their share of the quorum's
DELTA = 1e-5
MODEL = {"input_shape": [1, 8, 8], "layers": [{"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 10}]}
DISTRIBUTED = {"noise_multiplier": 1.0, "clip": 1.0, "sample_rate": 0.2, "quorum": 3}
JOB = {
    "name": "ddp-digits", "category": "digits", "seed": 5, "model": MODEL,
    "training": {"rounds": 1, "local_epochs": 1, "batch_size": 32, "lr": 0.5},
    "aggregation": {"secure": True},
    "privacy": {"distributed": DISTRIBUTED},
    "evaluation": {"every": 0},
    "schedule": {"min_workers": 4, "min_clients": 3, "quorum": 3, "wait_for_workers_s": 120, "round_timeout_s": 120},
}


@pytest.fixture
def deployment(private_rabbitmq: PrivateRabbitMQ, tmp_path: Path) -> Iterator[Deployment]:
    with Deployment(private_rabbitmq.url, tmp_path, name="ddp", worker_ids=WORKERS, users=private_rabbitmq) as d:
        yield d


def wait_for(predicate: Any, timeout: float, what: str, d: Deployment) -> Any:
    """`d.wait_for`, watching only the services: the test kills one of its workers."""
    return d.wait_for(predicate, timeout, what, watching=("aggregator", "coordinator"))


def worker_settings(d: Deployment, index: int, worker: str) -> dict[str, Any]:
    return {"worker.id": worker, "worker.categories": "digits", "worker.dataset": "digits",
            "worker.partition.num_clients": len(WORKERS), "worker.partition.client_index": index,
            "worker.ledger_path": str(d.tmp / f"{worker}-ledger.json"), "worker.device": "cpu",
            "worker.heartbeat_s": 0.5, "worker.torch_threads": 1, "worker.dp.noise_multiplier": 1.0,
            "worker.dp.max_grad_norm": 1.0, "worker.dp.delta": DELTA, "worker.dp.epsilon_budget": 50,
            "worker.dp.mode": MODES.get(worker, "distributed")}


def accountant_round(record: dict[str, Any], ledger_round: dict[str, Any]) -> skellam.DDPRound:
    """The round as the accountant sees it, from the service's record (and the site's own ledger entry)."""
    full = record["quorum_variance"]
    assert ledger_round["scale"] == record["scale"] and ledger_round["dim"] == record["dim"]
    assert ledger_round["bits"] == record["bits"] and ledger_round["quorum"] == record["quorum"]
    return skellam.DDPRound(scale=record["scale"], share_variance=full / record["quorum"], full_variance=full,
                            bits=record["bits"], wrap_probability=record["wrap_bound"], quorum=record["quorum"],
                            dim=record["dim"], clip=record["clip"], noise_multiplier=record["noise_multiplier"],
                            sample_rate=record["sample_rate"])


def test_a_distributed_dp_round_closes_with_its_survivors_after_a_site_is_killed_and_both_epsilons_recompute(
        deployment: Deployment) -> None:
    d = deployment
    spool = d.tmp / "spool"
    d.spawn("aggregator", "aggregator", {"aggregator.listen": d.aggregator, "aggregator.spool_dir": spool})
    d.spawn("coordinator", "coordinator", {"coordinator.listen": d.coordinator,
                                           "coordinator.state_dir": d.tmp / "state"})
    for i, worker in enumerate(WORKERS):
        entry = ["-m", "tests.integration.secure_worker", "--exit-at", "masked", "--kill"] if worker == KILLED \
            else ["-m", "fedbroker"]
        d.spawn(worker, "worker", worker_settings(d, i, worker), entry=entry)

    job_file = d.tmp / "job.json"
    job_file.write_text(json.dumps(JOB))

    # this process's own Status until the coordinator answers (no CLI process per poll while six processes start);
    # the job then waits for its four workers itself (schedule.min_workers)
    wait_for(lambda: d.coordinator_status() is not None, 120, "the coordinator to answer", d)
    job_id = str(json.loads(d.cli("submit", str(job_file), "--json"))["job_id"])
    # each `fedbroker` command is a process of its own: poll the spool (cheap) for the round's model, then ask once
    wait_for(lambda: (job_folder(spool, job_id) / "global-2.npz").exists(), 240, "the round to close", d)

    doc = wait_for(lambda: d.ended_job(job_id), 240, "the distributed-DP job to end", d)
    assert doc["status"] == "completed", f"{doc.get('error')}\n{d.logs()}"
    assert d.processes[KILLED].wait(30) == -signal.SIGKILL, d.logs()
    assert "exits after step 'masked'" in (d.tmp / f"{KILLED}.log").read_text()

    survivors = [w for w in WORKERS if w != KILLED]
    (rnd,) = doc["rounds"]
    assert rnd["aggregated"] == len(survivors)
    assert doc["secure"]["distributed"]["quorum"] == DISTRIBUTED["quorum"]
    (record,) = doc["ddp"]  # the round's record, as the coordinator kept it from the close
    assert record["round"] == 1 and sorted(record["variances"]) == survivors and record["quorum"] == 3
    assert record["lr"] == JOB["training"]["lr"] and record["bits"] >= 8 and 0 < record["wrap_bound"] <= 1e-9
    assert record["total_variance"] == pytest.approx(sum(record["variances"].values()))
    full = record["quorum_variance"]
    assert full == pytest.approx((record["scale"] * DISTRIBUTED["noise_multiplier"] * DISTRIBUTED["clip"]) ** 2)
    assert record["variances"]["site-1"] == pytest.approx(full)  # mode local: the whole dose
    assert record["variances"]["site-2"] == pytest.approx(full / 3)  # mode distributed: a third
    text = d.cli("jobs", "show", job_id)
    assert "distributed DP: 3 survivor(s), quorum 3" in text and "a quorum of 3 carries noise z·C" in text, text

    for worker in survivors:  # both figures on each survivor's ledger, recomputed from the recorded parameters
        ledger = json.loads((d.tmp / f"{worker}-ledger.json").read_text())["jobs"][job_id]
        (mine,) = ledger["distributed"]["rounds"]
        mu = mine["mu"]
        assert mu == pytest.approx(record["variances"][worker])  # what it declared is what it recorded adding
        ddp = accountant_round(record, mine)
        assumed = max(full, mu)  # the distributed figure assumes the quorum's dose (at least its own share)
        assert record["total_variance"] >= assumed  # the survivors' actual noise covers it: the figure is conservative
        distributed = skellam.distributed_epsilon(round=ddp, total_variance=assumed, rounds=1, delta=DELTA)
        floor = skellam.local_floor_epsilon(round=ddp, share_variance=mu, rounds=1, delta=DELTA)
        assert ledger["epsilon"] == pytest.approx(distributed, rel=1e-9) and 0 < distributed < math.inf
        assert ledger["distributed"]["floor_epsilon"] == pytest.approx(floor, rel=1e-9)
        assert floor >= distributed * (1 - 1e-9)  # its own share alone never protects more than the quorum's dose
    status = {p["worker_id"]: p for p in doc["participants"]}
    assert all(status[w]["epsilon"] == pytest.approx(json.loads(
        (d.tmp / f"{w}-ledger.json").read_text())["jobs"][job_id]["epsilon"]) for w in survivors)

    folder = job_folder(spool, job_id)  # the DP-SGD step moved the model
    before, after = (dict(np.load(folder / f"global-{v}.npz", allow_pickle=False)) for v in (1, 2))
    assert any(not np.allclose(after[k], before[k]) for k in before)
