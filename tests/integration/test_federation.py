"""One federation end to end over the real RabbitMQ and real gRPC on loopback."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest
from opacus.accountants import RDPAccountant
from prometheus_client import REGISTRY

from fedbroker.config import DPPolicy
from fedbroker.errors import ConfigError
from fedbroker.job.spec import TrainingConfig, parse_job
from fedbroker.privacy import dp_sample_rate, planned_steps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOB = {
    "name": "it",
    "category": "digits",
    "seed": 1,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 64}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 64, "out_features": 10}]},
    "training": {"rounds": 10, "local_epochs": 2, "batch_size": 32, "lr": 0.2},
    "schedule": {"min_workers": 3, "wait_for_workers_s": 30, "round_timeout_s": 1200},  # far beyond the test's timeout
    "evaluation": {"dataset": "digits"},
}


def run(federation, job_dict):
    job_id = federation.coordinator.submit(parse_job(job_dict))
    status = federation.coordinator.wait(job_id, timeout=280)
    row = federation.store.job(job_id)
    assert status == "completed", row.error
    return job_id


def test_federation_over_rabbitmq_reaches_90_percent_on_iid_digits(federation):
    for i in range(3):
        federation.add_worker(f"w{i}", index=i, count=3)
    job_id = run(federation, JOB)
    rounds = federation.store.rounds(job_id)
    accuracy = [r.accuracy for r in rounds]
    assert len(rounds) == 10 and all(r.aggregated == 3 for r in rounds)
    assert max(accuracy) >= 0.90, accuracy
    assert np.mean(accuracy[-3:]) > np.mean(accuracy[:3]) + 0.05, accuracy  # it learns over rounds
    assert all(p.status == "aggregated" for p in federation.store.participants(job_id))


def test_dp_epsilon_per_worker_equals_the_opacus_accountant(federation):
    policy = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)
    for i in range(3):
        federation.add_worker(f"w{i}", index=i, count=3, dp=policy)
    job = copy.deepcopy(JOB)
    job["training"]["rounds"] = 2
    job_id = run(federation, job)
    config = TrainingConfig(local_epochs=2, batch_size=32, lr=0.2)
    for worker_id, agent in federation.workers.items():
        n = len(agent.y)
        accountant = RDPAccountant()
        accountant.history = [(1.1, dp_sample_rate(n, config), 2 * planned_steps(n, config))]
        expected = accountant.get_epsilon(1e-5)
        recorded = [p.epsilon for p in federation.store.participants(job_id) if p.worker_id == worker_id]
        assert np.isfinite(recorded[-1]) and recorded[-1] > recorded[0] > 0
        assert recorded[-1] == pytest.approx(expected, rel=1e-9)
        assert agent.ledger.epsilon(job_id) == pytest.approx(expected, rel=1e-9)


def test_a_worker_that_cannot_afford_the_round_is_not_selected_and_spends_nothing(federation):
    generous = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)
    stingy = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=0.05)
    federation.add_worker("rich0", index=0, count=3, dp=generous)
    federation.add_worker("rich1", index=1, count=3, dp=generous)
    federation.add_worker("poor", index=2, count=3, dp=stingy)
    job = copy.deepcopy(JOB)
    job["training"]["rounds"] = 1
    job_id = run(federation, job)
    rows = {p.worker_id: p for p in federation.store.participants(job_id, 1)}
    assert set(rows) == {"rich0", "rich1"}  # the round opened with the workers that can afford it
    assert rows["rich0"].status == rows["rich1"].status == "aggregated"
    assert federation.workers["poor"].ledger.epsilon(job_id) == 0.0


def test_no_round_opens_and_no_worker_trains_when_fewer_than_min_clients_can_afford_it(federation):
    """Two of three workers cannot afford round 1 and min_clients is 2: the round is never opened, so the one
    worker that could afford it does not train either (no ε spent anywhere), and the job says why."""
    generous = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)
    stingy = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=0.05)
    federation.add_worker("rich", index=0, count=3, dp=generous)
    federation.add_worker("poor0", index=1, count=3, dp=stingy)
    federation.add_worker("poor1", index=2, count=3, dp=stingy)
    job = copy.deepcopy(JOB)
    job["training"]["rounds"] = 1
    job["schedule"].update(min_clients=2, wait_for_workers_s=3)
    # all three registered first: the 3 s the job waits are then for affordable workers, which never come,
    # not for a registration a loaded machine delivers late
    deadline = time.monotonic() + 120
    while len(federation.store.workers("digits")) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    job_id = federation.coordinator.submit(parse_job(job))
    assert federation.coordinator.wait(job_id, timeout=120) == "failed"
    error = federation.store.job(job_id).error
    # spent ε never comes back: the job fails at once, naming the sites out of budget (not after its wait)
    assert "round 1 cannot start: 1 site(s) of category 'digits' can ever afford it, 2 needed" in error, error
    assert "poor0: budget ε 0.05, 0.000 spent" in error and "poor1: budget ε 0.05, 0.000 spent" in error, error
    assert federation.store.participants(job_id) == [] and federation.store.rounds(job_id) == []
    for agent in federation.workers.values():
        assert agent.ledger.total_epsilon() == 0.0 and agent.ledger.jobs() == {}


def test_a_model_that_does_not_fit_a_workers_data_is_reported_as_failed_not_retried(federation):
    """A model whose input is flat while the worker's digits are (1, 8, 8) cannot train on that data: the
    worker reports the task failed, naming the shapes, and acks it (no retries into the dead-letter queue).
    The job is submitted before the worker registers, so the submission's own check cannot see its data."""
    job = copy.deepcopy(JOB)
    job["model"] = {"input_shape": [64], "layers": [{"type": "Linear", "in_features": 64, "out_features": 10}]}
    job["training"]["rounds"] = 1
    job["schedule"]["min_workers"] = 1
    job.pop("evaluation")
    job_id = federation.coordinator.submit(parse_job(job))
    agent = federation.add_worker("w0", index=0, count=1)
    assert federation.coordinator.wait(job_id, timeout=120) == "failed"
    (row,) = federation.store.participants(job_id, 1)
    assert row.status == "failed", row
    assert "model.input_shape [64] does not fit this worker's data, whose samples have shape [1, 8, 8]" in row.reason
    assert agent.ledger.jobs() == {}
    assert federation.bus.dead_letter_count() == 0
    assert REGISTRY.get_sample_value("fedbroker_worker_tasks_failed_total",
                                     {"worker_id": "w0", "reason": "data_mismatch"}) == 1


def test_a_model_that_does_not_fit_the_registered_workers_data_is_refused_at_submission(federation):
    """Once a worker of the category has registered its data's shape and classes, a job whose model cannot take
    them is refused when it is submitted, naming the model's field and the worker; a fitting job is accepted."""
    federation.add_worker("w0", index=0, count=1)
    deadline = time.monotonic() + 60
    while not federation.store.workers("digits") and time.monotonic() < deadline:
        time.sleep(0.05)
    (record,) = federation.store.workers("digits")
    assert record.input_shape == (1, 8, 8) and record.num_classes == 10 and record.num_samples > 0
    flat = copy.deepcopy(JOB)
    flat["model"] = {"input_shape": [64], "layers": [{"type": "Linear", "in_features": 64, "out_features": 10}]}
    flat.pop("evaluation")
    with pytest.raises(ConfigError, match=r"model.input_shape: is \[64\] but the samples of worker w0 "
                                          r"\(category 'digits'\) have shape \[1, 8, 8\]"):
        federation.coordinator.submit(parse_job(flat))
    narrow = copy.deepcopy(JOB)
    narrow["model"]["layers"][-1]["out_features"] = 5
    narrow.pop("evaluation")
    with pytest.raises(ConfigError, match=r"model.layers\[3\].out_features: the model outputs 5 class scores but "
                                          r"the data of worker w0 \(category 'digits'\) has 10 classes"):
        federation.coordinator.submit(parse_job(narrow))
    assert federation.store.jobs() == []  # nothing of a refused job is kept
