"""Alignment jobs end to end through RabbitMQ and the aggregation service."""

from __future__ import annotations

import copy

import pytest

from fedbroker.coordinator.checkpoints import load_checkpoint
from fedbroker.coordinator.evaluation import evaluate_global
from fedbroker.datasets import load_dataset, train_test_split
from fedbroker.evaluation import evaluate
from fedbroker.job.spec import TrainingConfig, parse_job
from fedbroker.model import build_model
from fedbroker.worker.training import train_local

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOB = {
    "name": "align",
    "category": "digits",
    "seed": 3,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 32}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 32, "out_features": 10}]},
    "training": {"rounds": 3, "local_epochs": 2, "batch_size": 32, "lr": 0.2},
    "schedule": {"min_workers": 3, "wait_for_workers_s": 30, "round_timeout_s": 1200},  # far beyond the test's timeout
    "evaluation": {"dataset": "digits"},
}


@pytest.mark.parametrize("alignment", ["feddna", "nafi"])
def test_aligned_global_model_beats_every_worker_training_alone(federation, alignment):
    for i in range(3):
        federation.add_worker(f"w{i}", index=i, count=3, scheme="dirichlet", alpha=0.5)
    job_dict = copy.deepcopy(JOB)
    job_dict["aggregation"] = {"alignment": alignment}
    job = parse_job(job_dict)
    job_id = federation.coordinator.submit(job)
    assert federation.coordinator.wait(job_id, timeout=280) == "completed", federation.store.job(job_id).error

    rounds = federation.store.rounds(job_id)
    assert [r.aggregated for r in rounds] == [3, 3, 3]
    stats = rounds[0].stats
    assert any(key.startswith("alignment_") for key in stats), stats
    tensors, spec_json = load_checkpoint(rounds[-1].checkpoint)
    federated, _ = evaluate_global(job, spec_json, tensors)

    test = train_test_split(load_dataset("digits"), test_fraction=0.2, seed=0)[1]
    alone = []
    for agent in federation.workers.values():  # the same model and total epochs, on one worker's data only
        model = build_model(job.model, seed=job.seed)
        train_local(model, agent.x, agent.y, dp=None, seed=0,
                    config=TrainingConfig(local_epochs=3 * 2, batch_size=32, lr=0.2))
        alone.append(evaluate(model, test.x, test.y)[0])
    assert federated >= max(alone), (federated, alone)
