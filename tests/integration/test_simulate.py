"""`fedbroker simulate`: a user's own job file on this machine; what cannot work is refused before anything
starts, naming the field or flag, and a job on the user's own Parquet file runs to a results table."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]

JOB = {
    "name": "try-it", "category": "iris", "seed": 0,
    "model": {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 16}, {"type": "ReLU"},
                                             {"type": "Linear", "in_features": 16, "out_features": 3}]},
    "training": {"rounds": 2, "local_epochs": 2, "batch_size": 16, "lr": 0.1},
    "schedule": {"min_workers": 2, "round_timeout_s": 1200, "wait_for_workers_s": 60},  # far beyond the test's timeout
    "evaluation": {"dataset": "iris"},
}


def simulate(tmp_path: Path, job: dict, *args: str, env: dict[str, str] | None = None
             ) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return subprocess.run([sys.executable, "-m", "fedbroker", "simulate", str(path), "--out", str(tmp_path / "runs"),
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=280,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize(("change", "args", "message"), [
    ({"model": {**JOB["model"], "input_shape": [5],
                "layers": [{"type": "Linear", "in_features": 5, "out_features": 3}]}, "evaluation": {}},
     ["--dataset", "iris"], "model.input_shape: is [5] but the samples of the simulated workers (category 'iris') "
                            "have shape [4]"),
    ({"model": {**JOB["model"], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]}, "evaluation": {}},
     ["--dataset", "iris"], "model.layers[0].out_features: the model outputs 2 class scores"),
    ({}, ["--workers", "1"], "--workers: is 1 but the job's schedule.min_workers is 2"),
    ({"schedule": {**JOB["schedule"], "min_clients": 3}}, ["--workers", "2"],
     "--workers: is 2 but the job's schedule.min_clients is 3"),
    ({}, ["--workers", "0"], "--workers: must lie in [1, 64], got 0"),
    ({"evaluation": {}}, [], "--dataset: the job names no evaluation set"),
    ({"training": {**JOB["training"], "rounds": 0}}, [], "training.rounds"),
])
def test_a_job_that_cannot_run_is_refused_before_anything_starts(tmp_path, change, args, message):
    proc = simulate(tmp_path, {**JOB, **change}, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_simulate_runs_a_job_on_the_users_own_parquet_file(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(240, 4))
    label = np.where(x[:, 0] - x[:, 2] > 0.3, "yes", np.where(x[:, 1] > 0.5, "maybe", "no"))
    pq.write_table(pa.table({**{f"f{i}": x[:, i] for i in range(4)}, "answer": label.tolist()}),
                   tmp_path / "mine.parquet")
    (tmp_path / "worker.yaml").write_text(yaml.safe_dump({"worker": {
        "dataset": "parquet", "dp": {"enabled": False},
        "data": {"path": str(tmp_path / "mine.parquet"), "classes": ["no", "maybe", "yes"]},
    }}))
    job = {**JOB, "category": "survey", "evaluation": {}}
    # the data section's label column from the environment, as a real worker would read it (README)
    proc = simulate(tmp_path, job, "--worker-config", str(tmp_path / "worker.yaml"), "--workers", "2",
                    env={"FEDBROKER__WORKER__DATA__LABEL_COLUMN": "answer"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no privacy ledger" not in proc.stderr  # a fresh simulation's new ledgers are no cause for a warning
    (run_dir,) = list((tmp_path / "runs").iterdir())
    results = json.loads((run_dir / "results.json").read_text())
    assert results["summary"]["status"] == "completed" and [r["clients"] for r in results["rounds"]] == [2, 2]
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in results["rounds"])
    assert results["rounds"][-1]["accuracy"] > 0.6, results["rounds"]  # separable labels; chance is about 0.4
    assert (run_dir / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "round  clients  train loss  test acc" in proc.stdout


def test_simulate_over_rabbitmq_runs_every_component_as_a_process(tmp_path, rabbitmq_url):
    proc = simulate(tmp_path, JOB, "--workers", "2", "--no-dp", "--broker", rabbitmq_url)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list((tmp_path / "runs").iterdir())
    results = json.loads((run_dir / "results.json").read_text())
    assert results["summary"]["broker"] == "rabbitmq" and results["summary"]["status"] == "completed"
    assert [r["clients"] for r in results["rounds"]] == [2, 2]
    assert {p.name for p in (run_dir / "logs").iterdir()} == {"aggregator.log", "coordinator.log", "worker-0.log",
                                                             "worker-1.log"}


def test_simulate_of_an_async_job_shows_versions_and_states_the_dp_policy_first(tmp_path):
    """The first line states the DP policy in full; an async job's progress (plain lines: stderr is a pipe here)
    and its table are versions with their staleness, as the demo shows them."""
    job = {**JOB, "training": {**JOB["training"], "rounds": 3},
           "schedule": {**JOB["schedule"], "mode": "async", "buffer_size": 1, "max_staleness": 5}}
    proc = simulate(tmp_path, job, "--workers", "2", "--noise-multiplier", "1.3", "--epsilon-budget", "50")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = proc.stdout.splitlines()[0]
    assert first.startswith("fedbroker simulate: job 'try-it' (3 versions (async)), 2 workers"), first
    assert "DP on (σ=1.3, clip=1, δ=1e-05, ε budget 50 per worker)" in first, first
    assert "\r" not in proc.stderr
    progress = [line for line in proc.stderr.splitlines() if line.startswith("version ")]
    assert len(progress) == 3 and all("mean staleness" in line for line in progress), proc.stderr
    assert re.search(r"^ *version +clients +staleness +train loss +test acc", proc.stdout, re.M), proc.stdout
    (run_dir,) = list((tmp_path / "runs").iterdir())
    results = json.loads((run_dir / "results.json").read_text())
    assert results["unit"] == "version" and len(results["rounds"]) == 3
