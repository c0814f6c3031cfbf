"""Federated evaluation over the real RabbitMQ, each site a `fedbroker worker` process on its own CSV file (no
evaluation set at the coordinator): every round gets the sites' count-weighted score, a site whose owner denies
evaluation (through its environment, as Kubernetes sets it) refuses and is left out, one site's score is what its
own held-out rows give the downloaded model, forged reports change nothing, and the CLI shows it all
(`jobs show --json`, `jobs logs`, `jobs download --best`, the warning `submit` prints)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from prometheus_client import REGISTRY

from fedbroker.app.cli import main
from fedbroker.bus import delete_topology, envelope, open_bus
from fedbroker.config import DataSection, WorkerConfig
from fedbroker.coordinator.service import serve
from fedbroker.datasets import load_worker_data, train_test_split
from fedbroker.evaluation import evaluate
from fedbroker.job.spec import parse_job, parse_model
from fedbroker.model import build_model, load_numpy_state
from fedbroker.proto import fedbroker_pb2 as pb
from tests.source_roots import PYTHONPATH

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

SITES = ("site-a", "site-b", "site-c")   # site-c's owner denies evaluation
JOB: dict[str, Any] = {
    "name": "own-eval",
    "category": "clinic",
    "seed": 3,
    "model": {"input_shape": [5], "layers": [{"type": "Linear", "in_features": 5, "out_features": 16}, {"type": "ReLU"},
                                             {"type": "Linear", "in_features": 16, "out_features": 2}]},
    "training": {"rounds": 3, "local_epochs": 2, "batch_size": 16, "lr": 0.1},
    "schedule": {"min_workers": 3, "wait_for_workers_s": 120, "round_timeout_s": 1200},  # beyond the test's timeout
    "evaluation": {"every": 1},
}


def write_table(path: Path, n: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)) * [1, 10, 100, 1, 1] + [0, 50, 500, 0, 0]
    label = np.where(x[:, 0] + x[:, 1] / 10 + rng.normal(scale=0.5, size=n) > 5, "sick", "well")
    lines = ["patient,f0,f1,f2,f3,f4,status"] + [
        f"p{i},{','.join(f'{v:.4f}' for v in row)},{c}" for i, (row, c) in enumerate(zip(x, label))]
    path.write_text("\n".join(lines) + "\n")


def data_settings(csv_path: Path) -> dict[str, Any]:
    return {"worker.dataset": "csv", "worker.data.path": str(csv_path), "worker.data.label_column": "status",
            "worker.data.feature_columns": "f0,f1,f2,f3,f4", "worker.data.classes": "well,sick",
            "worker.data.standardize": "true"}


@pytest.fixture
def sites(federation: Any) -> Iterator[dict[str, Path]]:
    """Three worker processes, each on its own CSV file; site-c's environment says `worker.evaluation: deny`."""
    processes, files = [], {}
    for i, site in enumerate(SITES):
        files[site] = federation.tmp / f"{site}.csv"
        write_table(files[site], 100 + 20 * i, seed=11 + i)
        settings = {
            "broker.url": federation.url, "broker.namespace": federation.namespace, "worker.id": site,
            "worker.categories": "clinic", **data_settings(files[site]),
            "worker.ledger_path": str(federation.tmp / f"{site}-ledger.json"), "worker.device": "cpu",
            "worker.heartbeat_s": 0.5, "worker.dp.enabled": "false", "worker.torch_threads": 1,
            "worker.evaluation": "deny" if site == "site-c" else "allow",
        }
        env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
        env["PYTHONPATH"] = PYTHONPATH
        env.update({"FEDBROKER__" + k.upper().replace(".", "__"): str(v) for k, v in settings.items()})
        log = (federation.tmp / f"{site}.log").open("ab")
        processes.append((subprocess.Popen([sys.executable, "-m", "fedbroker", "worker"], env=env, stdout=log,
                                           stderr=subprocess.STDOUT), log))
    try:
        deadline = time.monotonic() + 180
        while len(federation.store.workers("clinic")) < len(SITES):
            for (process, _), site in zip(processes, SITES):
                assert process.poll() is None, (federation.tmp / f"{site}.log").read_text()
            assert time.monotonic() < deadline, "the worker processes did not register"
            time.sleep(0.1)
        yield files
    finally:
        for process, _ in processes:
            process.terminate()
        for process, log in processes:
            process.wait(30)
            log.close()
        delete_topology(federation.url, federation.namespace, list(SITES))


def held_out(csv_path: Path) -> Any:
    """A site's held-out rows, read here as its worker reads them (its own file, its 20 % split)."""
    data = load_worker_data(WorkerConfig(dataset="csv", data=DataSection(
        path=str(csv_path), label_column="status", feature_columns=("f0", "f1", "f2", "f3", "f4"),
        classes=("well", "sick"), standardize=True)))
    return train_test_split(data, test_fraction=0.2, seed=0)[1]


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def refused(reason: str) -> float:
    return REGISTRY.get_sample_value("fedbroker_coordinator_evaluation_reports_refused_total", {"reason": reason}) or 0.0


def test_sites_score_each_round_on_their_own_rows_and_the_cli_shows_it(federation: Any, sites: dict[str, Path],
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    server, port = serve(federation.coordinator)
    target = f"127.0.0.1:{port}"
    try:
        job_id = federation.coordinator.submit(parse_job(JOB))
        assert federation.coordinator.wait(job_id, timeout=300) == "completed", federation.store.job(job_id).error
        code, out, _ = cli(capsys, "jobs", "show", job_id, "--json", "--coordinator", target)
        shown = json.loads(out)
        assert code == 0 and len(shown["rounds"]) == 3
        for r in shown["rounds"]:
            rows = {e["worker_id"]: e for e in shown["evaluations"] if e["round"] == r["round"]}
            assert rows["site-c"]["status"] == "refused" and "worker.evaluation: deny" in rows["site-c"]["reason"]
            scored = [rows["site-a"], rows["site-b"]]
            assert {e["status"] for e in scored} == {"evaluated"} and r["evaluated_sites"] == 2
            n = sum(e["num_samples"] for e in scored)
            assert r["federated_samples"] == n == len(held_out(sites["site-a"]).y) + len(held_out(sites["site-b"]).y)
            assert r["federated_accuracy"] == pytest.approx(sum(e["accuracy"] * e["num_samples"] for e in scored) / n)
            assert r["federated_loss"] == pytest.approx(sum(e["loss"] * e["num_samples"] for e in scored) / n)
            assert r["accuracy"] == 0.0  # no central evaluation set: the sites' scores are the job's only ones

        # the best round's model, downloaded, scores site-a's own held-out rows exactly as site-a reported
        best = max(shown["rounds"], key=lambda r: (r["federated_accuracy"], -r["round"]))
        out_dir = federation.tmp / "best"
        code, out, err = cli(capsys, "jobs", "download", job_id, "--best", "--out", str(out_dir), "--json",
                             "--coordinator", target)
        got = json.loads(out)
        assert code == 0 and got["round"] == best["round"] and got["best_by"] == "federated", (out, err)
        assert f"round {best['round']} is the best by federated accuracy" in err
        from safetensors.numpy import load_file

        model = build_model(parse_model(json.loads((out_dir / "model_spec.json").read_text())))
        load_numpy_state(model, load_file(str(out_dir / "model.safetensors")))
        own = held_out(sites["site-a"])
        reported = next(e for e in shown["evaluations"] if e["round"] == best["round"] and e["worker_id"] == "site-a")
        assert (reported["accuracy"], reported["loss"]) == pytest.approx(evaluate(model, own.x, own.y), rel=1e-6)

        code, out, _ = cli(capsys, "jobs", "logs", job_id, "--coordinator", target)
        assert code == 0 and out.count(" evaluated ") == 6 and out.count("federated_score") == 3, out
        assert out.count("evaluation_refused") == 3 and "2 of 3 site(s)" in out
        code, out, _ = cli(capsys, "jobs", "show", job_id, "--coordinator", target)
        assert "EVALUATIONS" in out and "site acc" in out

        # forged reports (guest may speak for every site here: the store is what stops them) change nothing
        version = shown["rounds"][0]["model_version"]
        before = {reason: refused(reason) for reason in ("not_asked", "wrong_version", "late")}
        sender = open_bus(federation.url, namespace=federation.namespace)
        try:
            for fake in (pb.EvaluationReport(job_id=job_id, round=9, model_version=version, worker_id="site-a"),
                         pb.EvaluationReport(job_id=job_id, round=1, model_version=version, worker_id="site-d"),
                         pb.EvaluationReport(job_id=job_id, round=1, model_version=version + 5, worker_id="site-c")):
                fake.accuracy, fake.loss, fake.num_samples = 1.0, 0.0, 20
                sender.publish_control(envelope.encode(evaluation_report=fake))
        finally:
            sender.close()
        deadline = time.monotonic() + 60
        while not (refused("not_asked") == before["not_asked"] + 2
                   and refused("wrong_version") == before["wrong_version"] + 1):
            assert time.monotonic() < deadline, "the forged reports were not refused"
            time.sleep(0.1)
        code, out, _ = cli(capsys, "jobs", "show", job_id, "--json", "--coordinator", target)
        assert json.loads(out)["evaluations"] == shown["evaluations"]
        assert json.loads(out)["rounds"] == shown["rounds"]

        # a job on own data that asks for no evaluation is accepted, with the warning on stderr and in its events
        silent = federation.tmp / "silent.yaml"
        silent.write_text(yaml.safe_dump({**JOB, "training": {**JOB["training"], "rounds": 1},
                                          "evaluation": {"every": 0}}))
        code, out, err = cli(capsys, "submit", str(silent), "--coordinator", target)
        assert code == 0 and "warning: evaluation.every is 0" in err
        silent_id = out.strip()
        assert federation.coordinator.wait(silent_id, timeout=180) == "completed"
        assert [e.kind for e in federation.store.events(silent_id)][:2] == ["submitted", "warning"]
        assert not federation.store.evaluations(silent_id)
    finally:
        server.stop(grace=0)
