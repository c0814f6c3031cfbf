"""A data owner's own CSV file, end to end: `fedbroker worker` in its own process reads it as configured through
the environment (as Kubernetes sets it), registers its shape, classes and sample count over the real RabbitMQ
(never the data), the coordinator refuses a job whose model does not fit, and a fitting job trains."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from fedbroker.bus import delete_topology
from fedbroker.errors import ConfigError
from fedbroker.job.spec import parse_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

JOB = {
    "name": "own-csv",
    "category": "clinic",
    "seed": 3,
    "model": {"input_shape": [5], "layers": [{"type": "Linear", "in_features": 5, "out_features": 16}, {"type": "ReLU"},
                                             {"type": "Linear", "in_features": 16, "out_features": 2}]},
    "training": {"rounds": 2, "local_epochs": 2, "batch_size": 16, "lr": 0.1},
    "schedule": {"min_workers": 1, "wait_for_workers_s": 60, "round_timeout_s": 1200},  # far beyond the test's timeout
}


def write_table(path, n: int = 120) -> None:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(n, 5)) * [1, 10, 100, 1, 1] + [0, 50, 500, 0, 0]
    label = np.where(x[:, 0] + x[:, 1] / 10 > 5, "sick", "well")
    lines = ["patient,f0,f1,f2,f3,f4,status"] + [
        f"p{i},{','.join(f'{v:.4f}' for v in row)},{c}" for i, (row, c) in enumerate(zip(x, label))]
    path.write_text("\n".join(lines) + "\n")


def test_a_worker_process_serves_its_own_csv_and_registers_only_its_shape(federation):
    csv_path = federation.tmp / "clinic.csv"
    write_table(csv_path)
    settings = {
        "broker.url": federation.url, "broker.namespace": federation.namespace, "worker.id": "clinic-a",
        "worker.categories": "clinic", "worker.dataset": "csv", "worker.data.path": str(csv_path),
        "worker.data.label_column": "status", "worker.data.feature_columns": "f0,f1,f2,f3,f4",
        "worker.data.classes": "well,sick", "worker.data.standardize": "true",
        "worker.ledger_path": str(federation.tmp / "clinic-ledger.json"), "worker.device": "cpu",
        "worker.heartbeat_s": 0.5, "worker.dp.enabled": "false", "worker.torch_threads": 1,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    env.update({"FEDBROKER__" + k.upper().replace(".", "__"): str(v) for k, v in settings.items()})
    log = (federation.tmp / "clinic.log").open("ab")
    process = subprocess.Popen([sys.executable, "-m", "fedbroker", "worker"], env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not federation.store.workers("clinic") and time.monotonic() < deadline:
            assert process.poll() is None, (federation.tmp / "clinic.log").read_text()
            time.sleep(0.1)
        (record,) = federation.store.workers("clinic")
        assert record.input_shape == (5,) and record.num_classes == 2
        assert record.num_samples == 96  # 120 rows less the 20 % test split the worker keeps for itself

        wrong = copy.deepcopy(JOB)
        wrong["model"]["input_shape"] = [6]
        wrong["model"]["layers"][0]["in_features"] = 6
        with pytest.raises(ConfigError, match=r"model.input_shape: is \[6\] but the samples of worker clinic-a"):
            federation.coordinator.submit(parse_job(wrong))

        job_id = federation.coordinator.submit(parse_job(JOB))
        assert federation.coordinator.wait(job_id, timeout=180) == "completed", federation.store.job(job_id).error
        rounds = federation.store.rounds(job_id)
        assert [r.aggregated for r in rounds] == [1, 1]
        losses = [p.train_loss for p in federation.store.participants(job_id)]
        assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses  # standardised features train
    finally:
        process.terminate()
        process.wait(30)
        log.close()
        delete_topology(federation.url, federation.namespace, ["clinic-a"])
