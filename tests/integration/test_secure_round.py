"""A secure job (aggregation.secure) in a real deployment: the aggregation service, the coordinator and five
workers, each its own `fedbroker` process, on a private RabbitMQ node, each on its own broker user as kits deploy.

One worker exits right after masking its update (before uploading it: it dropped, and its pairwise masks
are rebuilt from its peers' shares), another right after its masked upload (before unmasking: it is in the
sum, and its self-mask is rebuilt without it). The round still closes, with the four survivors' weighted
mean: each worker, started through the test's own entry point (tests/integration/secure_worker.py: `fedbroker
worker` with a recorder injected), writes the clear weighted update it masked to a folder, and the new global model in the service's spool equals the global model
before the round plus their sum over their weight share, to the quantisation bound. Nothing the service
wrote (its spool, its log) holds any of those updates, masked or clear: no update file at all, and none of
their bytes or printed values.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.spool import job_folder
from fedbroker.job.spec import parameter_shapes, parse_model
from fedbroker.secagg import sum_error_bound
from fedbroker.secagg.secure_round import round_params
from tests.integration.processes import Deployment
from tests.integration.secure_worker import CRASH_STATUS
from tests.rabbitmq_node import PrivateRabbitMQ

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

WORKERS = ["site-1", "site-2", "site-3", "site-4", "site-5"]
SERVICES = ("aggregator", "coordinator")
# The threshold test's first round fails at its deadline by design (three of five sites never upload), so the test
# waits it out: short, but far above what the round needs before it. Every step up to the uploads is fixed as soon
# as every site has acted (the roster at the latest at 25 % of the round, the inboxes at 50 %), and the two
# survivors' masked uploads follow their one small training within seconds of the task.
FAILING_ROUND_S = 60
EXITS = {"site-3": "masked", "site-4": "uploaded"}  # site-3 drops before its upload, site-4 before unmasking
MODEL = {"input_shape": [1, 8, 8], "layers": [{"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 24},
                                              {"type": "ReLU"}, {"type": "Linear", "in_features": 24, "out_features": 10}]}
JOB = {
    "name": "secure-digits", "category": "digits", "seed": 5, "model": MODEL,
    "training": {"rounds": 1, "local_epochs": 1, "batch_size": 32, "lr": 0.1},
    "aggregation": {"secure": True, "weighting": "fedavg"},
    "evaluation": {"every": 0},  # no site scoring: the two crashed sites would keep the job waiting for theirs
    # quorum 4: the round closes once four masked uploads are in (site-3 never uploads)
    "schedule": {"min_workers": 5, "min_clients": 3, "quorum": 4, "wait_for_workers_s": 240, "round_timeout_s": 300},
}


@pytest.fixture
def deployment(private_rabbitmq: PrivateRabbitMQ, tmp_path: Path) -> Iterator[Deployment]:
    """Provisioned (a guest run would add nothing: guest may do all a site's user may): each process logs in as its
    own broker user on the session's private node, the coordinator binds each site's control messages to its
    user, and each worker trains only the coordinator's tasks."""
    with Deployment(private_rabbitmq.url, tmp_path, name="secure", worker_ids=WORKERS, users=private_rabbitmq) as d:
        yield d


def wait_for(predicate: Any, timeout: float, what: str, d: Deployment) -> Any:
    """`d.wait_for`, watching only the services: the test's own workers crash on purpose."""
    return d.wait_for(predicate, timeout, what, watching=SERVICES)


def start_services(d: Deployment, spool: Path) -> None:
    d.spawn("aggregator", "aggregator", {"aggregator.listen": d.aggregator, "aggregator.spool_dir": spool})
    d.spawn("coordinator", "coordinator", {"coordinator.listen": d.coordinator,
                                           "coordinator.state_dir": d.tmp / "state"})


def worker_settings(d: Deployment, index: int, worker: str) -> dict[str, Any]:
    return {"worker.id": worker, "worker.categories": "digits", "worker.dataset": "digits",
            "worker.partition.num_clients": len(WORKERS), "worker.partition.client_index": index,
            "worker.ledger_path": str(d.tmp / f"{worker}-ledger.json"), "worker.device": "cpu",
            "worker.heartbeat_s": 0.5, "worker.torch_threads": 1, "worker.dp.noise_multiplier": 0.8,
            "worker.dp.max_grad_norm": 1.0, "worker.dp.epsilon_budget": 50}


def watched(*, record: Path | None = None, exit_at: str | None = None) -> list[str]:
    """The entry point of a worker whose secure steps the test watches (tests/integration/secure_worker.py)."""
    return ["-m", "tests.integration.secure_worker", *(["--record", str(record)] if record else []),
            *(["--exit-at", exit_at] if exit_at else [])]


def test_a_secure_round_closes_with_the_survivors_weighted_mean_and_the_service_never_holds_an_update(
        deployment: Deployment) -> None:
    d = deployment
    records = d.tmp / "clear-updates"
    records.mkdir()
    spool = d.tmp / "spool"
    start_services(d, spool)
    for i, worker in enumerate(WORKERS):
        d.spawn(worker, "worker", worker_settings(d, i, worker), entry=watched(record=records, exit_at=EXITS.get(worker)))
    wait_for(lambda: d.listed(len(WORKERS)), 240, "the five workers to register", d)
    job_file = d.tmp / "job.json"
    job_file.write_text(json.dumps(JOB))
    job_id = json.loads(d.cli("submit", str(job_file), "--json"))["job_id"]
    doc = wait_for(lambda: d.ended_job(job_id), 480, "the secure job to end", d)
    assert doc["status"] == "completed", f"{doc.get('error')}\n{d.logs()}"
    for worker, step in EXITS.items():  # the two crashes happened where the test put them
        assert d.processes[worker].wait(30) == CRASH_STATUS, d.logs()
        assert f"exits after step {step!r}" in (d.tmp / f"{worker}.log").read_text()
    (rnd,) = doc["rounds"]
    survivors = ["site-1", "site-2", "site-4", "site-5"]
    assert rnd["aggregated"] == len(survivors)
    status = {p["worker_id"]: p for p in doc["participants"]}
    assert {w for w, p in status.items() if p["status"] == "aggregated"} == set(survivors)
    assert all(status[w]["epsilon"] > 0 for w in survivors)  # DP training and its ε as without secure
    params = round_params(len(WORKERS))
    assert doc["secure"]["threshold"] == params.threshold and doc["secure"]["bits"] == params.bits
    assert "threshold 3 of 5" in d.cli("jobs", "show", job_id)

    # The new global model (version 2 in the service's spool) against the survivors' clear weighted updates.
    folder = job_folder(spool, job_id)
    before, after = (dict(np.load(folder / f"global-{v}.npz", allow_pickle=False)) for v in (1, 2))
    clear = {w: np.load(records / f"{job_id}-1-{w}.npz") for w in WORKERS}
    share = sum(float(clear[w]["scale"]) for w in survivors)
    mean = sum(clear[w]["vector"] for w in survivors) / share
    bound = sum_error_bound(params, len(survivors))[0] / share
    start = 0
    for name, shape in parameter_shapes(parse_model(MODEL)).items():
        count = int(np.prod(shape))
        want = before[name].astype(np.float64) + mean[start:start + count].reshape(shape)
        np.testing.assert_allclose(after[name], want, atol=bound + 1e-5)
        start += count
    assert start == mean.size
    assert not np.allclose(after[next(iter(after))], before[next(iter(before))])  # the round moved the model

    # Nothing the service wrote holds an update: no update file, and none of any worker's values.
    written = [p for p in spool.rglob("*") if p.is_file()]
    assert not [p for p in written if "round-" in p.as_posix() or "buffer-" in p.as_posix()], written
    blobs = [p.read_bytes() for p in written] + [(d.tmp / "aggregator.log").read_bytes()]
    text = (d.tmp / "aggregator.log").read_text()
    for worker in WORKERS:
        vector = clear[worker]["vector"]
        scale = float(clear[worker]["scale"])
        for candidate in (vector, vector / scale):  # the weighted update and the plain one
            for dtype in (np.float32, np.float64):
                needle = candidate[:8].astype(dtype).tobytes()
                assert not any(needle in blob for blob in blobs), (worker, dtype)
            assert f"{candidate[np.argmax(np.abs(candidate))]:.6g}" not in text  # its largest value, printed


def test_a_secure_round_that_loses_its_threshold_answers_its_waiting_sites_at_once_and_the_next_job_completes(
        deployment: Deployment) -> None:
    """Three of five sites crash after masking (threshold 3): the round fails at its deadline with two masked
    uploads. The coordinator abandons it at the service, so the two sites waiting to unmask are told why at once
    (before, they waited past the deadline plus the unmask wait, holding their task, and the next job's round
    failed without them). The crashed sites come back, and a second secure job completes with all five."""
    d = deployment
    start_services(d, d.tmp / "spool")
    crashed = ["site-3", "site-4", "site-5"]
    for i, worker in enumerate(WORKERS):
        d.spawn(worker, "worker", worker_settings(d, i, worker),
                entry=watched(exit_at="masked") if worker in crashed else ("-m", "fedbroker"))
    wait_for(lambda: d.listed(len(WORKERS)), 240, "the five workers to register", d)

    def submit(name: str, timeout_s: int) -> str:
        job = {**JOB, "name": name, "schedule": {**JOB["schedule"], "quorum": 5, "round_timeout_s": timeout_s}}
        path = d.tmp / f"{name}.json"
        path.write_text(json.dumps(job))
        return str(json.loads(d.cli("submit", str(path), "--json"))["job_id"])

    first = submit("secure-fails", FAILING_ROUND_S)
    doc = wait_for(lambda: d.ended_job(first), 480, "the first secure job to end", d)
    assert doc["status"] == "failed" and "2 upload(s)" in doc["error"], doc.get("error")
    for worker in crashed:
        assert d.processes[worker].wait(30) == CRASH_STATUS, d.logs()

    def answer(worker: str) -> str | None:  # the line where the waiting site gave up the first job's round
        lines = [line for line in (d.tmp / f"{worker}.log").read_text().splitlines()
                 if f"failed round 1 of {first}" in line]
        return lines[0] if lines else None

    waiting = ["site-1", "site-2"]
    wait_for(lambda: all(answer(w) for w in waiting), 120, "the waiting sites to be answered", d)
    for worker in waiting:  # the service's answer, naming why; not their own wait for survivors running out
        line = answer(worker)
        # Which answer a site reads depends on when it asks, never on a wait running out: polling while the round
        # is abandoned, the round's own words; asking after, that the round is past its deadline (both at once).
        assert line is not None, line
        asked_during = f"secure round 1 of job '{first}'" in line and (
            "was abandoned" in line or "deadline passed with 2 masked upload(s)" in line)
        asked_after = f"round 1 of job '{first}' is not open (the round's deadline passed)" in line
        assert asked_during or asked_after, line
        assert "in time" not in line, line

    for i, worker in enumerate(WORKERS):  # the crashed sites come back, as an operator restarts them
        if worker in crashed:
            d.spawn(worker, "worker", worker_settings(d, i, worker))
    second = submit("secure-after", 300)
    doc = wait_for(lambda: d.ended_job(second), 480, "the second secure job to end", d)
    assert doc["status"] == "completed", f"{doc.get('error')}\n{d.logs()}"
    (rnd,) = doc["rounds"]
    assert rnd["aggregated"] == len(WORKERS)
    for worker in waiting:  # in each waiting site's own log: answered on the first job, then took part in the second
        text = (d.tmp / f"{worker}.log").read_text()
        answered = text.index(f"failed round 1 of {first}")
        assert answered < text.index(second), worker
