"""MLflow tracking without a federation: which points a job's `jobs show` document yields (a round once it has
closed, its sites' score once settled, async steps by version), the settings as params, and a real SQLite
store read back with MLflow's own client: logging twice writes each point once."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from mlflow.tracking import MlflowClient  # the tracking extra: `make test` installs it (requirements-tracking.txt)

from fedbroker.app.cli import main
from fedbroker.app.tracking import JobTracker, Point, job_params, resolve_uri, round_points, weights_digest
from fedbroker.errors import ConfigError
from tests.lifecycle.test_jobs import JOB

SPEC = {"name": "t", "evaluation": {"dataset": "digits", "every": 1}, "training": {"rounds": 3, "lr": 0.1},
        "model": {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 3}]},
        "aggregation": {"weighting": "fedavg", "weighting_params": {}}, "seed": 0}


def row(number: int, *, status: str = "closed", version: int = 0, federated: float = 0.0) -> dict:
    return {"round": number, "status": status, "participants": 2, "uploaded": 2, "aggregated": 2,
            "accuracy": 0.5 + number / 10, "loss": 1.0 / number, "seconds": 1.5, "mean_train_loss": 0.9,
            "model_version": version or number + 1, "mean_staleness": 0.25 * number,
            "federated_accuracy": federated, "federated_loss": 0.7 if federated else 0.0,
            "federated_samples": 40 if federated else 0, "evaluated_sites": 2 if federated else 0}


def participant(number: int, worker: str, status: str, epsilon: float) -> dict:
    return {"round": number, "worker_id": worker, "status": status, "epsilon": epsilon}


def doc(rounds: list[dict], *, mode: str = "sync", spec: dict = SPEC, participants: list[dict] | None = None) -> dict:
    return {"job_id": "t-0001", "name": "t", "category": "digits", "mode": mode, "submitter": "alice",
            "status": "running", "rounds_done": len(rounds), "rounds_total": 3, "error": "", "spec": spec,
            "rounds": rounds, "participants": participants or []}


def event(kind: str, number: int, at: float) -> dict:
    return {"kind": kind, "round": number, "time_unix": at}


def by_key(points: list[Point]) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for p in points:
        out.setdefault(p.key, {})[p.step] = p.value
    return out


def test_a_round_is_logged_once_it_has_closed_and_its_sites_score_once_it_has_settled():
    rounds = [row(1, federated=0.61), row(2, federated=0.64), row(3, status="open")]
    events = [event("round_closed", 1, 100.0), event("federated_score", 1, 101.5), event("round_closed", 2, 200.0)]
    points = round_points(doc(rounds), events)
    got = by_key(points)
    assert got["accuracy"] == {1: 0.6, 2: 0.7} and got["loss"] == {1: 1.0, 2: 0.5}
    assert got["model_version"] == {1: 2.0, 2: 3.0} and got["train_loss"] == {1: 0.9, 2: 0.9}
    # round 2's sites have not settled: a score more reports could still move is not logged
    assert got["federated_accuracy"] == {1: 0.61} and got["evaluated_sites"] == {1: 2.0}
    stamps = {(p.key, p.step): p.timestamp_ms for p in points}
    assert stamps[("accuracy", 1)] == 100_000 and stamps[("federated_accuracy", 1)] == 101_500
    assert stamps[("accuracy", 2)] == 200_000


def test_a_closed_round_whose_close_event_is_not_yet_read_waits_for_the_next_sync():
    assert round_points(doc([row(1)]), []) == []


def test_an_async_job_steps_by_global_version_with_its_staleness():
    rounds = [row(1, version=4), row(2, version=7)]
    got = by_key(round_points(doc(rounds, mode="async"),
                              [event("round_closed", 1, 1.0), event("round_closed", 2, 2.0)]))
    assert got["versions"] == {4: 1.0, 7: 2.0} and got["mean_staleness"] == {4: 0.25, 7: 0.5}
    assert "model_version" not in got


def test_epsilon_is_the_largest_and_mean_spent_on_the_sites_whose_update_the_round_took():
    people = [participant(1, "a", "aggregated", 2.0), participant(1, "b", "uploaded", 4.0),
              participant(1, "c", "refused", 0.0), participant(1, "d", "missed", 0.0),
              participant(2, "a", "aggregated", 9.0)]
    got = by_key(round_points(doc([row(1)], participants=people), [event("round_closed", 1, 1.0)]))
    assert got["epsilon_max"] == {1: 4.0} and got["epsilon_mean"] == {1: 3.0}
    assert got["refused_or_failed"] == {1: 2.0}


def test_without_dp_or_an_evaluation_set_there_is_no_epsilon_nor_central_score():
    spec = {**SPEC, "evaluation": {"dataset": "", "every": 1}}
    got = by_key(round_points(doc([row(1)], spec=spec, participants=[participant(1, "a", "aggregated", 0.0)]),
                              [event("round_closed", 1, 1.0)]))
    assert not {"epsilon_max", "epsilon_mean", "accuracy", "loss"} & got.keys()


def test_params_are_the_specs_leaves_dotted_with_lists_as_json_and_long_values_as_digests():
    params = job_params(SPEC)
    assert params["training.lr"] == "0.1" and params["evaluation.dataset"] == "digits"
    assert params["model.input_shape"] == "[4]" and json.loads(params["model.layers"]) == SPEC["model"]["layers"]
    assert params["aggregation.weighting_params"] == "{}" and params["seed"] == "0"
    big = job_params({"model": {"layers": [{"type": "standardize", "mean": [0.123456789] * 1000}]}})
    assert big["model.layers"].startswith("sha256:") and "in job.json" in big["model.layers"]


def test_a_track_value_is_a_uri_or_a_db_path(tmp_path):
    assert resolve_uri(None) is None and resolve_uri("") is None
    assert resolve_uri("http://mlflow:5000") == "http://mlflow:5000"
    assert resolve_uri(str(tmp_path / "x.db")) == f"sqlite:///{tmp_path / 'x.db'}"
    with pytest.raises(ConfigError, match="--track: 'runs/mlruns' is neither a URI"):
        resolve_uri("runs/mlruns")


class Job:
    job_id, name, created_unix = "t-0001", "t", 1_700_000_000.0


def test_logging_twice_writes_each_point_once_and_a_new_tracker_resumes_where_the_run_stops(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    events = [event("round_closed", 1, 100.0), event("round_closed", 2, 200.0)]
    first = JobTracker.open(uri, job=Job())
    assert first.log(doc([row(1)]), events[:1]) == len(round_points(doc([row(1)]), events[:1]))
    assert first.log(doc([row(1)]), events[:1]) == 0
    again = JobTracker.open(uri, job=Job())  # as a tracker run again after an interruption
    assert again.run_id == first.run_id
    added = again.log(doc([row(1), row(2)]), events)
    assert added == len(round_points(doc([row(2)]), events[1:]))
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    history = client.get_metric_history(run.info.run_id, "accuracy")
    assert [(m.step, m.value, m.timestamp) for m in history] == [(1, 0.6, 100_000), (2, 0.7, 200_000)]
    assert run.data.params == job_params(SPEC) and run.data.tags["fedbroker.job_id"] == "t-0001"
    assert run.data.tags["fedbroker.status"] == "running"


def test_without_mlflow_the_track_flag_names_the_extra_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as where the extra is not installed
    monkeypatch.setitem(sys.modules, "mlflow.tracking", None)
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(JOB))
    code = main(["submit", str(job), "--wait", "--track", "--coordinator", "127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 2
    assert "fedbroker submit: config: --track: MLflow is not installed: pip install 'fedbroker[tracking]'" in err


def test_track_without_staying_with_the_job_is_refused_before_it_travels(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(JOB))
    code = main(["submit", str(job), "--track", str(tmp_path / "m.db"), "--coordinator", "127.0.0.1:1"])
    assert code == 2
    assert "--track: needs --follow or --wait" in capsys.readouterr().err
    assert not (tmp_path / "m.db").exists()


def test_the_weights_digest_depends_on_every_name_dtype_shape_and_value_but_not_on_order():
    a = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(3, dtype=np.float32)}
    base = weights_digest(a)
    assert weights_digest({"b": a["b"], "w": a["w"]}) == base
    assert weights_digest({**a, "w": a["w"].reshape(3, 2)}) != base
    assert weights_digest({**a, "b": a["b"].astype(np.float64)}) != base
    assert weights_digest({"w": a["w"], "c": a["b"]}) != base
    changed = a["w"].copy()
    changed[1, 2] += 1e-6
    assert weights_digest({**a, "w": changed}) != base


def test_an_experiment_without_track_is_refused(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(JOB))
    code = main(["submit", str(job), "--wait", "--experiment", "study", "--coordinator", "127.0.0.1:1"])
    assert code == 2
    assert "fedbroker submit: config: --experiment: names the MLflow experiment of --track" in capsys.readouterr().err
