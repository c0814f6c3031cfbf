"""MLflow tracking of real jobs, read back with MLflow's own client: `submit --follow --track` against the
coordinator's gRPC server, RabbitMQ and a DP worker logs the job's settings as params and one point per round
equal to `jobs show --json`'s; `jobs track` run again logs nothing twice, and a tracker that stopped halfway
resumes; `simulate --track` (in-process bus) logs its job the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from mlflow.tracking import MlflowClient
from safetensors.numpy import load_file

from fedbroker.app.tracking import JobTracker, weights_digest
from fedbroker.config import DPPolicy
from tests.lifecycle.test_jobs import JOB, Served, cli, until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
DP = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)


@pytest.fixture
def served(rabbitmq_url, tmp_path):
    s = Served(rabbitmq_url, tmp_path)
    yield s
    s.close()


def flat(spec: dict, prefix: str = "") -> dict[str, str]:
    """The job's settings as the test expects them in MLflow: dotted leaves, strings bare, the rest JSON."""
    out: dict[str, str] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{name}."))
        else:
            out[name] = value if isinstance(value, str) else json.dumps(value)
    return out


def shown(served: Served, capsys, job_id: str) -> tuple[dict, list[dict]]:
    """`jobs show --json` and `jobs logs --json`, as a user would read them."""
    code, out, err = cli(capsys, "jobs", "show", job_id, "--json", "--config", served.config("alice"))
    assert code == 0, err
    code, logs, err = cli(capsys, "jobs", "logs", job_id, "--json", "--config", served.config("alice"))
    assert code == 0, err
    return json.loads(out), [json.loads(line) for line in logs.splitlines()]


def the_run(uri: str, experiment: str, job_id: str):
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert [r.data.tags["fedbroker.job_id"] for r in runs] == [job_id]  # one run per job
    return client, runs[0]


def histories(client: MlflowClient, run) -> dict[str, list[tuple[int, float]]]:
    return {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
            for key in run.data.metrics}


def expected_history(doc: dict, events: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Each round's values as `jobs show --json` holds them; the sites' score for the rounds it settled."""
    settled = {e["round"] for e in events if e["kind"] == "federated_score"}
    out: dict[str, list[tuple[int, float]]] = {}
    for r in doc["rounds"]:
        n = r["round"]
        spent = [p["epsilon"] for p in doc["participants"] if p["round"] == n and p["status"] == "aggregated"]
        values = {"accuracy": r["accuracy"], "loss": r["loss"], "train_loss": r["mean_train_loss"],
                  "participants": r["participants"], "uploaded": r["uploaded"], "aggregated": r["aggregated"],
                  "seconds": r["seconds"], "model_version": r["model_version"], "refused_or_failed": 0,
                  "epsilon_max": max(spent), "epsilon_mean": sum(spent) / len(spent)}
        if n in settled:
            values.update(federated_accuracy=r["federated_accuracy"], federated_loss=r["federated_loss"],
                          federated_samples=r["federated_samples"], evaluated_sites=r["evaluated_sites"])
        for key, value in values.items():
            out.setdefault(key, []).append((n, float(value)))
    return out


def job_file(served: Served, job: dict) -> str:
    path = served.tmp / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def test_a_tracked_job_reads_back_from_mlflow_as_jobs_show_reports_it_and_tracking_again_adds_nothing(
        served, capsys, tmp_path):
    served.worker("w0", dp=DP)
    until(lambda: served.fed.store.workers("digits"), what="w0 registered")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    code, out, err = cli(capsys, "submit", job_file(served, JOB), "--follow", "--json", "--config",
                         served.config("alice"), "--track", uri)
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]  # the events stream as without --track
    job_id = lines[0]["job_id"]
    assert lines[-1]["status"] == "completed" and [e["kind"] for e in lines[1:-1]].count("round_closed") == 2
    doc, events = shown(served, capsys, job_id)
    printed = [e["seq"] for e in lines[1:-1]]
    assert printed == [e["seq"] for e in events][:len(printed)]  # each event printed once, in order
    assert doc["status"] == "completed" and [r["round"] for r in doc["rounds"]] == [1, 2]
    assert any(e["kind"] == "federated_score" and e["round"] == 2 for e in events)  # the end waits for it

    client, run = the_run(uri, JOB["name"], job_id)
    assert f"fedbroker submit: tracking in MLflow run {run.info.run_id} at {uri}" in err
    assert run.info.status == "FINISHED" and run.info.run_name == job_id
    assert run.data.params == flat(doc["spec"])  # the job's settings, as accepted
    logged = histories(client, run)
    assert logged == expected_history(doc, events)
    assert "federated_accuracy" in logged and logged["epsilon_max"][-1][1] > logged["epsilon_max"][0][1] > 0
    tags = run.data.tags
    assert (tags["fedbroker.status"], tags["fedbroker.rounds_done"], tags["fedbroker.submitter"]) == (
        "completed", "2", "alice")

    # the model artifact holds the weights `jobs download` gives, and its tag their digest
    code, _, err = cli(capsys, "jobs", "download", job_id, "--out", str(tmp_path / "model"),
                       "--config", served.config("alice"))
    assert code == 0, err
    downloaded = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert tags["fedbroker.model.sha256"] == weights_digest(downloaded) and tags["fedbroker.model.round"] == "2"
    stored = load_file(client.download_artifacts(run.info.run_id, "model/model.safetensors", str(tmp_path)))
    assert stored.keys() == downloaded.keys() and all(np.array_equal(stored[k], downloaded[k]) for k in stored)

    code, out, err = cli(capsys, "jobs", "track", job_id, "--uri", uri, "--experiment", JOB["name"], "--json",
                         "--config", served.config("carol"))  # a viewer may track: it only reads the job
    assert code == 0, err
    assert json.loads(out) == {"job_id": job_id, "status": "completed", "run_id": run.info.run_id,
                               "tracking_uri": uri, "logged": 0, "last_step": 2}
    client, again = the_run(uri, JOB["name"], job_id)
    assert histories(client, again) == logged and again.info.status == "FINISHED"


def test_a_tracker_that_stopped_after_round_1_resumes_at_round_2(served, capsys, tmp_path):
    served.worker("w0", dp=DP)
    until(lambda: served.fed.store.workers("digits"), what="w0 registered")
    code, out, err = cli(capsys, "submit", job_file(served, JOB), "--wait", "--config", served.config("alice"))
    assert code == 0, err
    job_id = out.splitlines()[0]
    doc, events = shown(served, capsys, job_id)
    uri = f"sqlite:///{tmp_path / 'resume.db'}"
    c = served.client("alice")
    try:
        (row,) = c.status(job_id).jobs
    finally:
        c.close()
    # a tracker interrupted after round 1: its run holds round 1's points only
    halfway = {**doc, "rounds": doc["rounds"][:1], "status": "running"}
    JobTracker.open(uri, job=row, experiment="study").log(halfway, [e for e in events if e["round"] <= 1])

    code, out, err = cli(capsys, "jobs", "track", job_id, "--uri", uri, "--config", served.config("alice"))
    assert code == 0, err
    assert out.startswith(f"job {job_id} (completed, 2/2): ") and "rounds up to 2" in out
    client, run = the_run(uri, "study", job_id)  # found where it is, not in a new experiment named after the job
    assert client.get_experiment_by_name(JOB["name"]) is None
    assert histories(client, run) == expected_history(doc, events)  # each round once, in order
    assert run.info.status == "FINISHED" and run.data.tags["fedbroker.status"] == "completed"


def test_simulate_track_logs_the_simulated_job_with_the_simulations_settings(tmp_path):
    job = {"name": "try-it", "category": "iris", "seed": 0,
           "model": {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 3}]},
           "training": {"rounds": 2, "local_epochs": 1, "batch_size": 16, "lr": 0.1},
           "schedule": {"min_workers": 2, "round_timeout_s": 1200, "wait_for_workers_s": 60},
           "evaluation": {"dataset": "iris"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    db = tmp_path / "sim.db"
    proc = subprocess.run([sys.executable, "-m", "fedbroker", "simulate", str(tmp_path / "job.yaml"), "--workers",
                           "2", "--out", str(tmp_path / "runs"), "--track", str(db)], cwd=ROOT,
                          capture_output=True, text=True, timeout=280, env=dict(os.environ))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("try-it").experiment_id])
    assert f"tracked in MLflow run {run.info.run_id}" in proc.stdout
    params = run.data.params
    assert params["training.rounds"] == "2" and params["model.input_shape"] == "[4]"
    assert (params["simulate.workers"], params["simulate.partition"], params["simulate.dp"]) == ("2", "iid", "true")
    (results,) = (tmp_path / "runs").glob("simulate-*/results.json")
    rounds = json.loads(results.read_text())["rounds"]
    history = client.get_metric_history(run.info.run_id, "train_loss")
    assert [(m.step, round(m.value, 4)) for m in history] == [(r["round"], r["mean_train_loss"]) for r in rounds]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "epsilon_max")] == [1, 2]
    assert run.info.status == "FINISHED" and run.data.tags["fedbroker.model.sha256"]


def unreachable_port() -> int:
    """A port on this host that nothing listens on (bound, then closed)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("case", ["folder named x.db", "long sqlite path", "device file", "unreachable server"])
def test_submit_track_refuses_a_store_it_cannot_use_at_once_before_the_job_is_sent(tmp_path, case):
    """Each store MLflow itself would retry for a minute or more (or answer with a traceback) is refused by the
    real CLI before the job travels: a local path that cannot be a SQLite file exits 2 (`config`), a server that
    does not answer exits 1 (`tracking`), each one line naming it. The coordinator named does not exist, so a
    job that travelled would fail on it instead."""
    (tmp_path / "x.db").mkdir()
    deep = tmp_path.joinpath(*["d" * 100] * 6)  # each folder exists; the whole path is past SQLite's limit
    deep.mkdir(parents=True)
    uri, code, expected = {
        "folder named x.db": (str(tmp_path / "x.db"), 2, "is a folder, not a file"),
        "long sqlite path": (f"sqlite:///{deep}/mlflow.db", 2, "cannot be opened for writing: unable to open"),
        "device file": ("sqlite:////dev/full", 2, "is not a regular file"),
        "unreachable server": (f"http://127.0.0.1:{unreachable_port()}", 1, "does not answer"),
    }[case]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(JOB))
    proc = subprocess.run([sys.executable, "-m", "fedbroker", "submit", str(tmp_path / "job.yaml"), "--wait",
                           "--coordinator", f"127.0.0.1:{unreachable_port()}", f"--track={uri}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    origin = "config: --track" if code == 2 else "tracking"
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"fedbroker submit: {origin}") and expected in line, line
    assert not (tmp_path / "mlflow.db").exists() and not list(deep.iterdir())  # nothing was made
