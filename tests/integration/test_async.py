"""Asynchronous mode (FedBuff) end to end: the real aggregation service over gRPC, the coordinator and
workers, over the in-process bus and over RabbitMQ."""

from __future__ import annotations

import copy

import pytest
from prometheus_client import REGISTRY

from fedbroker.app.status import render
from fedbroker.config import DPPolicy
from fedbroker.coordinator.service import status_reply
from fedbroker.job.spec import parse_job
from tests.integration.conftest import Federation

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOB = {
    "name": "async-it",
    "category": "digits",
    "seed": 1,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 32}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 32, "out_features": 10}]},
    "training": {"rounds": 6, "local_epochs": 1, "batch_size": 32, "lr": 0.5},  # the demo's lr: learns within 6 versions
    "schedule": {"mode": "async", "buffer_size": 2, "max_staleness": 4, "staleness": "polynomial",
                 "min_workers": 3, "wait_for_workers_s": 30, "round_timeout_s": 1200},  # far beyond the test's timeout
    "evaluation": {"dataset": "digits"},
}
GENEROUS = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=1000.0)


@pytest.fixture(params=["memory", "rabbitmq"])
def federation(request, tmp_path):
    url = ""
    if request.param == "rabbitmq":
        url = request.getfixturevalue("rabbitmq_url")
    fed = Federation(url, tmp_path)
    yield fed
    fed.close()


def run(federation: Federation, job: dict) -> str:
    job_id = federation.coordinator.submit(parse_job(job))
    status = federation.coordinator.wait(job_id, timeout=280)
    assert status == "completed", federation.store.job(job_id).error
    return job_id


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def test_async_job_publishes_its_versions_with_dp_and_learns(federation):
    for i in range(3):
        federation.add_worker(f"w{i}", index=i, count=3, dp=GENEROUS)
    versions_before = sample("fedbroker_aggregator_versions_published_total")
    staleness_before = sample("fedbroker_aggregator_update_staleness_versions_count")
    job_id = run(federation, JOB)
    # the metrics move: versions (service and per job), the staleness of every accepted update, the alert's clock
    assert sample("fedbroker_aggregator_versions_published_total") - versions_before >= 6
    assert sample("fedbroker_aggregator_update_staleness_versions_count") - staleness_before >= 12
    assert sample("fedbroker_coordinator_versions_total", {"job_id": job_id}) == 6
    assert sample("fedbroker_coordinator_last_version_timestamp_seconds", {"job_id": job_id}) > 0
    assert sample("fedbroker_coordinator_async_job_running", {"job_id": job_id}) == 0  # it ended
    rows = federation.store.rounds(job_id)
    assert len(rows) == 6 and all(r.status == "closed" and r.checkpoint for r in rows)
    versions = [r.model_version for r in rows]
    assert versions == sorted(versions) and len(set(versions)) == 6  # one row per version, in order
    assert all(r.uploaded >= 1 for r in rows)
    # 4× chance: the versions' order and staleness follow the machine's load (0.44 at lr 0.2 once, under load)
    assert rows[-1].accuracy > 0.4, [r.accuracy for r in rows]
    # every worker trained under its own DP policy, and its ε grew with each task it ran
    for worker_id, agent in federation.workers.items():
        assert agent.ledger.epsilon(job_id) > 0, worker_id
    status = federation.book.buffer_status(job_id)[1]
    assert status.refused_stale == 0 and status.closed and not status.issued  # the ended job's tasks ended
    table = render(status_reply(federation.coordinator, job_id))
    assert "VERSIONS (asynchronous jobs)" in table and "async" in table
    assert f"{rows[-1].model_version}" in table.split("VERSIONS")[1]


def test_a_worker_over_budget_stops_receiving_tasks(federation):
    federation.add_worker("rich0", index=0, count=3, dp=GENEROUS)
    federation.add_worker("rich1", index=1, count=3, dp=GENEROUS)
    stingy = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=0.01)
    poor = federation.add_worker("poor", index=2, count=3, dp=stingy)
    job = copy.deepcopy(JOB)
    job["training"]["rounds"] = 3
    job_id = run(federation, job)
    assert poor.ledger.epsilon(job_id) == 0.0  # never trained: it cannot afford one task
    folded = {p.worker_id for p in federation.store.participants(job_id)}
    assert "poor" not in folded and folded <= {"rich0", "rich1"}


def test_alignment_in_async_mode_is_refused_at_submission_naming_the_field():
    from fedbroker.errors import ConfigError
    from fedbroker.job.submission import accept_job

    job = copy.deepcopy(JOB)
    job["aggregation"] = {"alignment": "feddna", "selection": "ga", "selection_params": {"m": 2}}
    with pytest.raises(ConfigError) as info:
        accept_job(job)
    assert "aggregation.alignment" in str(info.value) and "aggregation.selection" in str(info.value)
    job = copy.deepcopy(JOB)
    job["schedule"]["staleness_params"] = {"a": -1}
    with pytest.raises(ConfigError) as info:
        accept_job(job)
    assert info.value.field == "schedule.staleness_params.a"



def test_cancelling_an_async_job_closes_its_buffer_and_makes_no_further_version(federation):
    import time

    for i in range(3):
        federation.add_worker(f"w{i}", index=i, count=3, dp=GENEROUS)
    job = copy.deepcopy(JOB)
    job["training"]["rounds"] = 500  # far more versions than it will get to make
    job_id = federation.coordinator.submit(parse_job(job))
    deadline = time.monotonic() + 240
    while not federation.store.rounds(job_id):  # wait on a condition: at least one version recorded
        assert time.monotonic() < deadline, "no version within 240 s"
        time.sleep(0.05)
    assert federation.coordinator.cancel(job_id, by="alice", wait_s=120) == "cancelled"
    status = federation.book.buffer_status(job_id)
    assert status[1].closed and not status[1].issued  # outstanding tasks ended at the service
    version, recorded = status[0], len(federation.store.rounds(job_id))
    time.sleep(1.0)  # workers still training find their uploads refused: nothing moves after the cancel
    assert federation.book.buffer_status(job_id)[0] == version
    assert len(federation.store.rounds(job_id)) == recorded < 500
    assert federation.store.job(job_id).status == "cancelled"
