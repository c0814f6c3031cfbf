"""A site's own ceilings (worker.limits): a task whose model is over any is refused with the figures, before
the model is built or any ε is spent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedbroker.bus import open_bus
from fedbroker.config import DPPolicy, LimitsSection, WorkerConfig, load_config
from fedbroker.errors import ConfigError, ModelOverLimits
from fedbroker.job.model_spec import model_bounds
from fedbroker.job.spec import TrainingConfig, parse_model
from fedbroker.model import initial_weights
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker import global_model
from fedbroker.worker.agent import WorkerAgent

GRAPH = {"input_shape": [1, 8, 8], "nodes": {
    "conv": {"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": 3, "padding": 1},
    "skip": {"type": "concat", "inputs": ["conv", "input"]},
    "flat": {"type": "Flatten"},
    "head": {"type": "Linear", "in_features": 320, "out_features": 10}}}


def test_the_figures_and_the_ceilings_they_pass_are_named():
    spec = parse_model(GRAPH)
    bounds = model_bounds(spec)
    assert bounds.parameters == 4 * 9 + 4 + 320 * 10 + 10
    problem = global_model.limits_problem(spec, LimitsSection(max_parameters=1000, max_flops=10**9))
    assert problem == f"the model is over this site's worker.limits: parameters {bounds.parameters:,} > max_parameters 1,000"
    assert global_model.limits_problem(spec, LimitsSection()) == ""  # 0: no ceiling
    both = global_model.limits_problem(spec, LimitsSection(max_activation_bytes=100, max_flops=100))
    assert "activation bytes per sample" in both and "FLOPs per sample" in both


def test_a_task_over_the_limits_is_refused_before_anything_is_built_or_spent(tmp_path: Path, monkeypatch):
    config = WorkerConfig(id="owner", ledger_path=str(tmp_path / "ledger.json"), device="cpu",
                          limits=LimitsSection(max_parameters=1000),
                          dp=DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=10.0))
    worker = WorkerAgent(config, open_bus(None, namespace=f"limits-{tmp_path.name}"))
    spec = parse_model(GRAPH)
    built: list[object] = []
    monkeypatch.setattr(global_model, "build_model", lambda *a, **k: built.append(a))
    task = pb.RoundTask(job_id="graph-job", round=1, category="digits", model_version=0)
    with pytest.raises(ModelOverLimits, match="parameters 3,250 > max_parameters 1,000") as refused:
        worker._train(task, TrainingConfig(), (0, spec.to_json(), initial_weights(spec, seed=0)))
    assert refused.value.reason == "model_over_limits"
    assert built == [] and worker.ledger.total_epsilon() == 0.0


def test_limits_in_the_worker_file_are_checked(tmp_path: Path):
    path = tmp_path / "worker.yaml"
    path.write_text("worker:\n  limits: {max_parameters: 5000000, max_flops: -1}\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="worker.limits.max_flops"):
        load_config(str(path))
    path.write_text("worker:\n  limits: {max_parameters: 5000000, max_activation_bytes: 1048576}\n", encoding="utf-8")
    assert load_config(str(path)).worker.limits == LimitsSection(max_parameters=5_000_000, max_activation_bytes=1 << 20)


def test_a_hostile_graph_sent_by_the_server_is_refused_by_the_workers_own_checks():
    """A lying coordinator or service can skip its own validation; each worker parses the spec again, with the
    same bounds (a block bomb is counted before it is expanded), before it builds anything."""
    blocks = {"l0": {"nodes": {f"n{i}": {"type": "ReLU"} for i in range(10)}}}
    blocks.update({f"l{k}": {"nodes": {f"i{i}": {"block": f"l{k - 1}"} for i in range(10)}} for k in range(1, 12)})
    bomb = {"input_shape": [4], "blocks": blocks, "nodes": {"body": {"block": "l11"}}}
    with pytest.raises(ValueError, match="the global model 3 cannot be built: model.nodes: expands to more than"):
        global_model.build_global((3, json.dumps(bomb), {}))


def test_weights_of_another_graph_are_refused_naming_the_tensor():
    spec = parse_model(GRAPH)
    weights = initial_weights(spec, seed=0)
    weights["conv.weight"] = weights["conv.weight"][:2]
    with pytest.raises(ValueError, match="tensor 'conv.weight' has shape"):
        global_model.build_global((1, spec.to_json(), weights))
    del weights["head.bias"]
    with pytest.raises(ValueError, match=r"missing \['head.bias'\]"):
        global_model.build_global((1, spec.to_json(), weights))
