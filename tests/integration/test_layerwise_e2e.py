"""The layer-wise mode end to end (`alignment: {name: nafi, mode: layerwise}`): the coordinator, the aggregation
service over gRPC and three DP workers over RabbitMQ run a 3-layer chain in its three rounds. Round r's checkpoint
holds layer r − 1 matched, every layer matched before is bit for bit the one its round published (the sites
trained around it), and the job's rounds are exactly the model's matched layers."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from fedbroker.config import DPPolicy
from fedbroker.coordinator.checkpoints import load_checkpoint
from fedbroker.errors import ConfigError
from fedbroker.job.alignment_plan import alignment_plan
from fedbroker.job.submission import accept_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOB = {
    "name": "layerwise",
    "category": "digits",
    "seed": 4,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 16}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 16, "out_features": 12}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 12, "out_features": 10}]},
    "training": {"rounds": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.2},
    "aggregation": {"alignment": {"name": "nafi", "mode": "layerwise"}},
    "schedule": {"min_workers": 3, "wait_for_workers_s": 30, "round_timeout_s": 1200},  # far beyond the test's timeout
    "evaluation": {"dataset": "digits"},
}
DP = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)


def test_each_layerwise_round_matches_one_layer_and_keeps_the_earlier_ones(federation):
    for i in range(3):
        federation.add_worker(f"w{i}", index=i, count=3, scheme="dirichlet", alpha=0.5, dp=DP)
    job = accept_job(copy.deepcopy(JOB))
    job_id = federation.coordinator.submit(job)
    assert federation.coordinator.wait(job_id, timeout=280) == "completed", federation.store.job(job_id).error

    rounds = federation.store.rounds(job_id)
    assert [r.aggregated for r in rounds] == [3, 3, 3]
    assert [r.stats["alignment_layerwise_layer"] for r in rounds] == [0.0, 1.0, 2.0]
    assert all(r.stats["alignment_frozen_changed"] == 0.0 for r in rounds)  # honest DP sites leave them bit for bit
    states = [load_checkpoint(r.checkpoint)[0] for r in rounds]
    plan = alignment_plan(job.model)
    for r in (2, 3):  # every layer matched in an earlier round is exactly as that round published it
        for earlier in range(r - 1):
            for name in plan.layers[earlier].tensors():
                np.testing.assert_array_equal(states[r - 1][name], states[earlier][name])
    assert not np.array_equal(states[2]["5.weight"], states[1]["5.weight"])  # the last round trained the output
    assert all(np.all(np.isfinite(t)) for state in states for t in state.values())


def test_a_layerwise_job_with_another_rounds_count_is_refused_before_any_site_sees_it():
    wrong = copy.deepcopy(JOB)
    wrong["training"]["rounds"] = 5
    with pytest.raises(ConfigError, match="training.rounds: is 5, but alignment 'nafi' in mode layerwise"):
        accept_job(wrong)
