"""One dishonest site sends forged evaluation sums (deploy/SECURITY.md, "Federated evaluation"): negative counts, a
histogram that does not add up to its samples, intersections above the predicted pixels, a million keys. Each is
refused naming the site, nothing of it is recorded, and the round's score is made from the honest sites' sums
alone, exactly as if the forger had not reported."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest

from fedbroker.coordinator.control import InvalidControlMessage, check_control
from fedbroker.coordinator.federated import accept_report
from fedbroker.coordinator.store import StateStore
from fedbroker.federated_evaluation import SiteScore, combine
from fedbroker.job.status import EvaluationStatus
from fedbroker.job.task import TaskConfig
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.tasks.scores import add_sums, batch_sums, scores


def _site(task: TaskConfig, seed: int) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    if task.type == "segmentation":
        pred = rng.integers(0, 3, size=(6, 8, 8))
        return batch_sums(task, pred, np.where(rng.random(pred.shape) < 0.6, pred, 0), 2.0)
    truth = rng.random((40, 2)) < 0.4
    return batch_sums(task, np.clip(truth * 0.3 + rng.random((40, 2)) * 0.7, 0, 1), truth.astype(np.float32), 4.0)


def _report(worker: str, sums: dict[str, float], n: int) -> pb.EvaluationReport:
    return pb.EvaluationReport(job_id="j-1", round=1, model_version=2, worker_id=worker, accuracy=0.5, loss=0.1,
                               num_samples=n, sums=sums)


def _forgeries(task: TaskConfig, honest: dict[str, float]) -> dict[str, dict[str, float]]:
    if task.type == "segmentation":
        return {"intersection above predictions": {**honest, "inter/1": honest["pred/1"] + 1},
                "negative count": {**honest, "true/2": -3.0, "pred/2": honest["pred/2"] - 3 - honest["true/2"]}}
    key = next(k for k in honest if k.startswith("neg/1/"))
    return {"negative count": {**honest, key: -1.0},
            "histogram not adding up to n": {**honest, key: honest[key] + 2}}


@pytest.mark.parametrize("task", [TaskConfig(type="multilabel", labels=2), TaskConfig(type="segmentation", classes=3)],
                         ids=["multilabel", "segmentation"])
def test_forged_sums_are_refused_naming_the_site_and_the_honest_sites_sums_make_the_score(
        tmp_path: Path, task: TaskConfig, caplog: pytest.LogCaptureFixture) -> None:
    store = StateStore(str(tmp_path / "c.sqlite"))
    store.add_job("j-1", "j", json.dumps({"task": task.to_dict()}), 1, "{}")
    store.ask_evaluation("j-1", 1, model_version=2, workers=["liar", "a", "b"], deadline=time.time() + 600, task=task)
    honest = {w: _site(task, seed) for seed, w in enumerate(("liar", "a", "b"))}
    n = {w: int(s["n"]) for w, s in honest.items()}
    with caplog.at_level(logging.WARNING):
        for what, forged in _forgeries(task, honest["liar"]).items():
            assert accept_report(store, _report("liar", forged, n["liar"])) == "implausible_sums", what
            assert "worker liar" in caplog.text and "impossible" in caplog.text
    for w in ("a", "b"):
        assert accept_report(store, _report(w, honest[w], n[w])) == "recorded"
    rows = {e.worker_id: e for e in store.evaluations("j-1")}
    assert rows["liar"].status == EvaluationStatus.ASKED and rows["liar"].sums is None   # nothing of it kept
    (scored,) = store.evaluation_rounds("j-1")
    assert scored.score is not None and scored.score.num_samples == n["a"] + n["b"]
    expected = scores(task, add_sums([honest["a"], honest["b"]]))
    made = dict(scored.score.scores)
    assert made.keys() == expected.keys()
    assert all(made[k] == pytest.approx(v, abs=1e-12, nan_ok=True) for k, v in expected.items())
    # the liar may still send its honest sums; the round then holds all three
    assert accept_report(store, _report("liar", honest["liar"], n["liar"])) == "recorded"
    (done,) = store.evaluation_rounds("j-1")
    assert done.score == combine([_as_site(honest[w]) for w in ("liar", "a", "b")], task)


def _as_site(sums: dict[str, float]) -> SiteScore:
    return SiteScore(accuracy=0.5, loss=0.1, num_samples=int(sums["n"]), sums=sums)


def test_a_million_keys_are_refused_on_the_control_queue_naming_the_site() -> None:
    sums = {f"pos/0/{i}": 1.0 for i in range(1_000_000)}
    env = pb.Envelope(evaluation_report=_report("liar", sums, 10))
    with pytest.raises(InvalidControlMessage, match="at most 131072 named sums, got 1000000 from worker 'liar'"):
        check_control(env)
