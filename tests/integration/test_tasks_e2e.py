"""Tasks through real processes: a coordinator, an aggregation service and two worker processes over RabbitMQ,
DP on, train a regression job and a multilabel job on the sites' own CSV files, and every round's federated
score is the task's (MAE from summed absolute errors; macro F1 and AUROC from summed counts and histograms)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integration.processes import Deployment
from tests.integration.test_consortium_study import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SITES = ("east", "west")
FEATURES = ("f0", "f1", "f2", "f3")


def write_csv(path: Path, seed: int, n: int = 160) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4))
    risk = x @ [0.8, -0.5, 0.3, 0.0] + rng.normal(0, 0.1, n)
    findings = np.stack([x[:, 0] > 0, x[:, 1] + x[:, 2] > 0, x[:, 3] > 0.5], axis=1).astype(int)
    lines = ["id," + ",".join(FEATURES) + ",risk,effusion,nodule,edema"]
    for i in range(n):
        lines.append(f"p{i}," + ",".join(f"{v:.4f}" for v in x[i]) + f",{risk[i]:.4f},"
                     + ",".join(str(v) for v in findings[i]))
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def deployment(rabbitmq_url: str, tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(rabbitmq_url, tmp_path, name="tasks", worker_ids=[f"{s}-{k}" for k in ("reg", "ml") for s in SITES])
    try:
        yield d
    finally:
        d.close()


def site(d: Deployment, name: str, kind: str) -> dict[str, Any]:
    labels = {"worker.data.labels": "target", "worker.data.label_column": "risk"} if kind == "reg" else {
        "worker.data.labels": "multilabel", "worker.data.label_columns": "effusion,nodule,edema"}
    return {
        "worker.id": f"{name}-{kind}", "worker.categories": f"tasks-{kind}", "worker.dataset": "csv",
        "worker.data.path": str(d.tmp / f"{name}.csv"), "worker.data.feature_columns": ",".join(FEATURES), **labels,
        "worker.ledger_path": str(d.tmp / f"{name}-{kind}-ledger.json"), "worker.device": "cpu",
        "worker.heartbeat_s": 0.5, "worker.torch_threads": 1, "worker.dp.noise_multiplier": 0.8,
        "worker.dp.max_grad_norm": 1.0, "worker.dp.epsilon_budget": 50,
    }


def job(kind: str) -> dict[str, Any]:
    outputs = 1 if kind == "reg" else 3
    return {
        "name": f"tasks-{kind}", "category": f"tasks-{kind}", "seed": 5,
        "model": {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 16},
                                                 {"type": "ReLU"},
                                                 {"type": "Linear", "in_features": 16, "out_features": outputs}]},
        "task": {"type": "regression", "loss": "huber", "huber_delta": 1.0} if kind == "reg" else
                {"type": "multilabel", "labels": 3},
        "training": {"rounds": 2, "local_epochs": 2, "batch_size": 16, "lr": 0.1},
        "evaluation": {"every": 1, "sites": "category"},
        "schedule": {"min_workers": 2, "wait_for_workers_s": 120, "round_timeout_s": 1200},
    }


def test_regression_and_multilabel_jobs_train_under_dp_and_are_scored_by_their_task(deployment: Deployment) -> None:
    d = deployment
    for i, name in enumerate(SITES):
        write_csv(d.tmp / f"{name}.csv", seed=20 + i)
    d.spawn("aggregator", "aggregator", {"aggregator.listen": d.aggregator, "aggregator.spool_dir": d.tmp / "spool"})
    d.spawn("coordinator", "coordinator", {"coordinator.listen": d.coordinator,
                                           "coordinator.state_dir": d.tmp / "state"})
    for name in SITES:
        for kind in ("reg", "ml"):
            d.spawn(f"{name}-{kind}", "worker", site(d, name, kind))

    def registered() -> bool:
        try:
            return d.registered(2 * len(SITES)) and len(json.loads(d.cli("status", "--json"))["workers"]) == 2 * len(SITES)
        except AssertionError:  # the coordinator is still starting
            return False

    wait_for(registered, 240, "the four sites to register", d)
    ids = {}
    for kind in ("reg", "ml"):
        path = d.tmp / f"{kind}.json"
        path.write_text(json.dumps(job(kind)))
        ids[kind] = json.loads(d.cli("submit", str(path), "--json"))["job_id"]

    def finished(job_id: str) -> dict[str, Any] | None:
        if not d.job_ended(job_id):  # the coordinator's own Status first: no CLI process per poll
            return None
        doc: dict[str, Any] = json.loads(d.cli("jobs", "show", job_id, "--json"))
        done = doc["status"] in ("completed", "failed", "cancelled")
        evaluated = len(doc["rounds"]) == 2 and all(r["evaluated_sites"] == len(SITES) for r in doc["rounds"])
        return doc if done and (evaluated or doc["status"] != "completed") else None

    for kind, job_id in ids.items():
        doc = wait_for(lambda job_id=job_id: finished(job_id), 480, f"the {kind} job to end, every round scored", d)
        assert doc["status"] == "completed", doc.get("error")
        for r in doc["rounds"]:
            scores = r["federated_scores"]
            if kind == "reg":
                assert r["federated_metric"] == "mae" and r["federated_accuracy"] == pytest.approx(scores["mae"])
                assert 0 < scores["mae"] < 5 and scores["rmse"] >= scores["mae"]
            else:
                assert r["federated_metric"] == "macro_f1" and 0.0 <= scores["auroc"] <= 1.0
                for label in range(3) if r is doc["rounds"][-1] else ():   # per label: the latest scored round
                    assert 0.0 <= scores[f"auroc/{label}"] <= 1.0
                    assert 0.0 <= scores[f"auroc_bound/{label}"] < 0.05
        participants = doc["participants"]
        assert participants and all(p["epsilon"] > 0 for p in participants if p["status"] == "aggregated")
    table = d.cli("status")
    assert "mae" in table
