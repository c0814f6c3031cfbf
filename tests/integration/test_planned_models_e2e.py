"""Frozen nodes and LoRA adapters end to end, DP on, over the real RabbitMQ and the real gRPC aggregation
service: a job that freezes a layer keeps it bit for bit and sends only the rest; a second job starts from the
first one's final model (`from_job`), trains rank-2 adapters and the head, and its download is the plain merged
model whose outputs are the served ones."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fedbroker.config import DPPolicy
from fedbroker.coordinator.checkpoints import load_checkpoint
from fedbroker.coordinator.start_weights import resolve_start
from fedbroker.job.spec import parse_job
from fedbroker.model import build_model, initial_weights, load_numpy_state
from fedbroker.weights.adapters import planned_model
from fedbroker.weights.plan import merge_adapters

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

POLICY = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)
JOB = {
    "name": "plan", "category": "digits", "seed": 4,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 32}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 32, "out_features": 10}]},
    "training": {"rounds": 2, "local_epochs": 1, "batch_size": 32, "lr": 0.2},
    "schedule": {"min_workers": 2, "wait_for_workers_s": 30, "round_timeout_s": 1200},
    "evaluation": {"dataset": "digits"},
}


def run(federation, raw: dict) -> tuple[str, dict[str, np.ndarray]]:
    job = parse_job(raw)
    start = resolve_start(job, b"", store=federation.store, caller=None)
    job_id = federation.coordinator.submit_job(job, start=start).job_id
    status = federation.coordinator.wait(job_id, timeout=280)
    assert status == "completed", federation.store.job(job_id).error
    last = federation.store.last_checkpoint(job_id)
    tensors, _ = load_checkpoint(last.checkpoint)
    return job_id, tensors


def test_a_frozen_layer_and_then_adapters_train_under_dp_through_real_processes(federation):
    for i in range(2):
        federation.add_worker(f"w{i}", index=i, count=2, dp=POLICY)
    frozen = copy.deepcopy(JOB)
    frozen["model"]["freeze"] = ["1"]
    first_id, first = run(federation, frozen)
    start = initial_weights(parse_job(JOB).model, seed=4)
    np.testing.assert_array_equal(first["1.weight"], start["1.weight"])   # never noised, never averaged
    np.testing.assert_array_equal(first["1.bias"], start["1.bias"])
    assert not np.array_equal(first["3.weight"], start["3.weight"])
    rounds = federation.store.rounds(first_id)
    assert len(rounds) == 2 and all(r.aggregated == 2 for r in rounds)

    lora = copy.deepcopy(JOB)
    lora["model"]["from_job"] = first_id
    lora["model"]["adapters"] = {"rank": 2, "alpha": 4, "targets": ["1"], "train": ["3"]}
    second_id, second = run(federation, lora)
    np.testing.assert_array_equal(second["1.weight"], first["1.weight"])   # the base the first job ended with
    assert second["1.lora_b.weight"].any()                                   # B left zero: it trained
    assert all(p.status == "aggregated" for p in federation.store.participants(second_id))
    assert all(r.accuracy is not None for r in federation.store.rounds(second_id))  # scored as the merged model

    job = parse_job(lora)
    served = planned_model(job.model, job.plan)
    load_numpy_state(served, second)
    plain = build_model(job.model)
    assert job.plan.adapters is not None
    load_numpy_state(plain, merge_adapters(second, job.plan.adapters))
    x = torch.randn(16, 1, 8, 8)
    torch.testing.assert_close(plain(x), served(x), rtol=1e-5, atol=1e-5)
