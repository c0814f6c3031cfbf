"""A residual model graph (blocks, add, concat) through the whole system: the aggregation service, the coordinator
and two sites each its own process over RabbitMQ, DP on at every site, FedAvg for two rounds; the job's view shows
the graph and its bounds, and the download (weights named `<node>.<tensor>`) loads with its README's snippet."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.numpy import load_file

from fedbroker.job.spec import parameter_shapes, parse_model
from fedbroker.model import GraphModel
from tests.integration.processes import Deployment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SITES = ("left", "right")
RESIDUAL_JOB: dict[str, Any] = {
    "name": "residual-graph", "category": "digits", "seed": 3,
    "model": {
        "input_shape": [1, 8, 8],
        "blocks": {"res": {
            "params": ["c"],
            "nodes": {
                "conv1": {"type": "Conv2d", "in_channels": "$c", "out_channels": "$c", "kernel_size": 3, "padding": 1,
                          "bias": False},
                "norm": {"type": "GroupNorm", "num_groups": 2, "num_channels": "$c"},
                "relu": {"type": "ReLU"},
                "conv2": {"type": "Conv2d", "in_channels": "$c", "out_channels": "$c", "kernel_size": 3, "padding": 1},
                "sum": {"type": "add", "inputs": ["conv2", "x"]},
            }}},
        "nodes": {
            "stem": {"type": "Conv2d", "in_channels": 1, "out_channels": 8, "kernel_size": 3, "padding": 1},
            "b1": {"block": "res", "c": 8},
            "b2": {"block": "res", "c": 8},
            "skip": {"type": "concat", "inputs": ["b2", "stem"]},
            "pool": {"type": "MaxPool2d", "kernel_size": 2},
            "flat": {"type": "Flatten"},
            "head": {"type": "Linear", "in_features": 256, "out_features": 10},
        },
        "output": "head",
    },
    "training": {"rounds": 2, "local_epochs": 1, "batch_size": 32, "lr": 0.1},
    "aggregation": {"alignment": "none", "weighting": "fedavg", "selection": "all"},
    "schedule": {"min_workers": 2, "wait_for_workers_s": 120, "round_timeout_s": 1200},
    "evaluation": {"dataset": "digits"},
}


@pytest.fixture
def deployment(rabbitmq_url: str, tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(rabbitmq_url, tmp_path, name="graph", worker_ids=list(SITES))
    try:
        yield d
    finally:
        d.close()


def wait_for(predicate: Any, timeout: float, what: str, d: Deployment) -> Any:
    """`d.wait_for` while every process runs."""
    return d.wait_for(predicate, timeout, what)


def test_a_residual_graph_trains_under_dp_with_fedavg_through_real_processes(deployment: Deployment) -> None:
    d = deployment
    d.spawn("aggregator", "aggregator", {"aggregator.listen": d.aggregator, "aggregator.spool_dir": d.tmp / "spool"})
    d.spawn("coordinator", "coordinator", {"coordinator.listen": d.coordinator, "coordinator.state_dir": d.tmp / "state"})
    for i, site in enumerate(SITES):
        d.spawn(site, "worker", {
            "worker.id": site, "worker.categories": "digits", "worker.dataset": "digits",
            "worker.partition.num_clients": len(SITES), "worker.partition.client_index": i,
            "worker.ledger_path": str(d.tmp / f"{site}-ledger.json"), "worker.device": "cpu",
            "worker.heartbeat_s": 0.5, "worker.torch_threads": 1, "worker.dp.noise_multiplier": 1.0,
            "worker.dp.max_grad_norm": 1.0, "worker.dp.epsilon_budget": 50,
            "worker.limits.max_parameters": 100_000, "worker.limits.max_flops": 10**8})

    wait_for(lambda: d.listed(len(SITES)), 180, "both sites to register", d)
    job_file = d.tmp / "job.json"
    job_file.write_text(json.dumps(RESIDUAL_JOB))
    submitted = json.loads(d.cli("submit", str(job_file), "--json"))
    job_id = submitted["job_id"]
    spec = parse_model(RESIDUAL_JOB["model"])
    assert submitted["model_bounds"]["parameters"] == sum(
        int(torch.Size(s).numel()) for s in parameter_shapes(spec).values())

    doc = wait_for(lambda: d.ended_job(job_id), 480, "the job to end", d)
    assert doc["status"] == "completed", doc.get("error")
    assert len(doc["rounds"]) == 2 and all(r["aggregated"] == len(SITES) for r in doc["rounds"])
    sent = [p for p in doc["participants"] if p["status"] == "aggregated"]
    assert len(sent) == 4 and all(p["epsilon"] > 0 for p in sent)  # DP at every site, every round

    shown = d.cli("jobs", "show", job_id)
    assert re.search(r"model +input \[1, 8, 8\]: graph of 7 nodes \(blocks: res\), output head \(15 nodes expanded\)",
                     shown), shown
    assert re.search(r"bounds +\d[\d,]* parameters; per sample .* of activations and .*FLOPs", shown), shown

    out = d.tmp / "model"
    d.cli("jobs", "download", job_id, "--out", str(out))
    weights = load_file(str(out / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == parameter_shapes(spec)
    assert "b2.conv1.weight" in weights
    readme = (out / "README.md").read_text()
    (snippet,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    scope: dict[str, Any] = {}
    cwd = os.getcwd()
    os.chdir(out)
    try:
        exec(snippet, scope)  # the user's own step, as the README gives it
    finally:
        os.chdir(cwd)
    model = scope["model"]
    assert isinstance(model, GraphModel)
    with torch.no_grad():
        assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 10)
