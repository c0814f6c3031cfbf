"""A consortium's own study, as three hospitals and a data scientist run it: every component its own process
over RabbitMQ, each site's own CSV file in its own units, the job standardising its inputs federatedly.

What it pins: every round has a federated accuracy (the sites' held-out scores weighted by their counts) in
`jobs show --json`; the downloaded model, loaded with the download README's own snippet and applied to one
site's raw CSV rows (its held-out split), reproduces exactly the accuracy that site reported; and no label
histogram reaches the coordinator for this FedAvg job.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fedbroker.config import DataSection, WorkerConfig
from fedbroker.datasets import load_worker_data, train_test_split
from tests.integration.processes import Deployment

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

FEATURES = ("age", "systolic", "cholesterol", "bmi", "glucose")
BOUNDS = [[0, 120], [60, 240], [80, 400], [10, 70], [40, 400]]
# Each site's patients in its own ranges: an older site, a site with higher blood pressure, ...
SITES = {"st-mary": (45, 130, 200), "north-lab": (60, 145, 220), "city-clinic": (52, 125, 190)}


def write_site_csv(path: Path, centre: tuple[float, float, float], seed: int, n: int = 220) -> None:
    rng = np.random.default_rng(seed)
    age = rng.normal(centre[0], 12, n)
    systolic = rng.normal(centre[1], 15, n)
    cholesterol = rng.normal(centre[2], 35, n)
    bmi = rng.normal(27, 4, n)
    glucose = rng.normal(105, 25, n)
    risk = 0.04 * (age - 50) + 0.03 * (systolic - 130) + 0.01 * (cholesterol - 200) + 0.05 * (glucose - 100)
    sick = risk + rng.normal(0, 0.8, n) > 0
    lines = ["patient," + ",".join(FEATURES) + ",diagnosis"]
    for i in range(n):
        row = (age[i], systolic[i], cholesterol[i], bmi[i], glucose[i])
        lines.append(f"p{i}," + ",".join(f"{v:.2f}" for v in row) + f",{'disease' if sick[i] else 'healthy'}")
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture
def deployment(rabbitmq_url: str, tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(rabbitmq_url, tmp_path, name="study", worker_ids=list(SITES))
    try:
        yield d
    finally:
        d.close()


def site_settings(d: Deployment, site: str) -> dict[str, Any]:
    return {
        "worker.id": site, "worker.categories": "cardiology", "worker.dataset": "csv",
        "worker.data.path": str(d.tmp / f"{site}.csv"), "worker.data.label_column": "diagnosis",
        "worker.data.feature_columns": ",".join(FEATURES), "worker.data.classes": "healthy,disease",
        "worker.data.standardize": "federated", "worker.ledger_path": str(d.tmp / f"{site}-ledger.json"),
        "worker.device": "cpu", "worker.heartbeat_s": 0.5, "worker.torch_threads": 1,
        "worker.dp.noise_multiplier": 0.8, "worker.dp.max_grad_norm": 1.0, "worker.dp.epsilon_budget": 50,
    }


JOB = {
    "name": "cardiology-study", "category": "cardiology", "seed": 11,
    "model": {"input_shape": [5], "layers": [{"type": "Linear", "in_features": 5, "out_features": 16},
                                             {"type": "ReLU"}, {"type": "Linear", "in_features": 16, "out_features": 2}]},
    "training": {"rounds": 3, "local_epochs": 2, "batch_size": 16, "lr": 0.2},
    "data": {"standardize": "federated", "bounds": BOUNDS},
    "evaluation": {"every": 1, "sites": "category"},
    "schedule": {"min_workers": 3, "wait_for_workers_s": 120, "round_timeout_s": 1200},
}


def wait_for(predicate: Any, timeout: float, what: str, d: Deployment) -> Any:
    """`d.wait_for` while every process runs."""
    return d.wait_for(predicate, timeout, what)


def test_three_sites_study_with_federated_evaluation_and_a_model_that_applies_to_raw_rows(deployment: Deployment):
    d = deployment
    for i, (site, centre) in enumerate(SITES.items()):
        write_site_csv(d.tmp / f"{site}.csv", centre, seed=40 + i)
    d.spawn("aggregator", "aggregator", {"aggregator.listen": d.aggregator, "aggregator.spool_dir": d.tmp / "spool"})
    d.spawn("coordinator", "coordinator", {"coordinator.listen": d.coordinator,
                                           "coordinator.state_dir": d.tmp / "state"})
    for site in SITES:
        d.spawn(site, "worker", site_settings(d, site))

    wait_for(lambda: d.listed(len(SITES)), 180, "the three sites to register", d)
    job_file = d.tmp / "job.json"
    job_file.write_text(json.dumps(JOB))
    job_id = json.loads(d.cli("submit", str(job_file), "--json"))["job_id"]

    def finished() -> dict[str, Any] | None:
        if not d.job_ended(job_id):  # the coordinator's own Status first: no CLI process per poll
            return None
        doc: dict[str, Any] = json.loads(d.cli("jobs", "show", job_id, "--json"))
        rounds = doc["rounds"]
        done = doc["status"] in ("completed", "failed", "cancelled")
        evaluated = len(rounds) == JOB["training"]["rounds"] and all(
            r["evaluated_sites"] == len(SITES) for r in rounds)
        return doc if done and (evaluated or doc["status"] != "completed") else None

    doc = wait_for(finished, 480, "the job to end with every round evaluated", d)
    assert doc["status"] == "completed", doc.get("error")

    # Every round: a federated accuracy, the count-weighted mean of the sites' reports.
    evaluations = doc["evaluations"]
    for r in doc["rounds"]:
        rows = [e for e in evaluations if e["round"] == r["round"] and e["status"] == "evaluated"]
        assert {e["worker_id"] for e in rows} == set(SITES)
        total = sum(e["num_samples"] for e in rows)
        assert r["federated_samples"] == total
        assert r["federated_accuracy"] == pytest.approx(sum(e["accuracy"] * e["num_samples"] for e in rows) / total)
        assert 0.0 <= r["federated_accuracy"] <= 1.0

    # The model a site can use: the download, loaded with its README's snippet, on raw CSV rows.
    last = max(r["round"] for r in doc["rounds"])
    out = d.tmp / "model"
    d.cli("jobs", "download", job_id, "--out", str(out))
    readme = (out / "README.md").read_text()
    assert "standardi" in readme.lower()  # it says what input the model expects
    (snippet,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    scope: dict[str, Any] = {}
    cwd = os.getcwd()
    os.chdir(out)
    try:
        exec(snippet, scope)  # the user's own step, as the README gives it
    finally:
        os.chdir(cwd)
    model = scope["model"]
    assert next(iter(json.loads((out / "model_spec.json").read_text())["layers"]))["type"] == "standardize"

    site = "st-mary"
    raw = load_worker_data(WorkerConfig(id=site, dataset="csv", data=DataSection(
        path=str(d.tmp / f"{site}.csv"), label_column="diagnosis", feature_columns=FEATURES,
        classes=("healthy", "disease"))))  # the rows as the file holds them: no standardisation here
    _, held_out = train_test_split(raw, test_fraction=0.2, seed=0)
    with torch.no_grad():
        predicted = model(torch.as_tensor(held_out.x, dtype=torch.float32)).argmax(dim=1).numpy()
    accuracy = float((predicted == held_out.y).mean())
    (reported,) = [e for e in evaluations if e["round"] == last and e["worker_id"] == site]
    assert reported["num_samples"] == len(held_out.y)
    assert accuracy == pytest.approx(reported["accuracy"], abs=1e-12)

    # A FedAvg job needs no label counts: none reached the coordinator. What its sites shared before round 1 is
    # their noised feature statistics, and only those.
    with sqlite3.connect(d.tmp / "state" / "coordinator.sqlite") as db:
        for table, in db.execute("select name from sqlite_master where type='table'").fetchall():
            for column in [c[1] for c in db.execute(f"pragma table_info({table})") if "histogram" in c[1]]:
                for (value,) in db.execute(f"select {column} from {table}"):
                    held = json.loads(value) if isinstance(value, str) and value.startswith("[") else []
                    assert held == [], (table, column, value)
        assert db.execute("select histogram, statistics from share_phases").fetchall() == [(0, 1)]
        shares = db.execute("select worker_id, status, statistics_noised, statistics_epsilon from shares").fetchall()
    assert sorted(shares) == sorted((site, "shared", 1, 1.0) for site in SITES)
