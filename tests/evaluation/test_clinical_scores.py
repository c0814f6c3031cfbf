"""The scores clinicians read, through the real path: workers score the global model on their own held-out files
(worker/evaluation.py → fedbroker.tasks.losses.evaluation_sums), the coordinator adds their sums, and the job's
rounds carry AUROC and average precision per finding (multilabel) and per class (binary classification) that lie
within their stated binning bounds of scikit-learn's on the pooled predictions of the same model; the job's
`evaluation.score` is the headline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from sklearn.metrics import average_precision_score, roc_auc_score

from fedbroker.config import DataSection, PartitionSection
from fedbroker.coordinator.checkpoints import load_checkpoint
from fedbroker.coordinator.service import status_reply
from fedbroker.datasets import load_worker_data, train_test_split
from fedbroker.job.spec import parse_model
from fedbroker.model import build_model, load_numpy_state
from fedbroker.worker.agent import WorkerAgent
from tests.evaluation.harness import Federation, job

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[Federation]:
    federation = Federation(tmp_path)
    try:
        yield federation
    finally:
        federation.close()


def _site_file(path: Path, seed: int, kind: str) -> None:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(150, 4)).astype(np.float32)
    if kind == "multilabel":
        y: np.ndarray = np.stack([x[:, 0] > 0, x[:, 1] + x[:, 2] > 0, rng.random(150) < 0.3], axis=1)
        y = y.astype(np.float32)
    else:
        y = (x[:, 0] - x[:, 3] + rng.normal(0, 0.7, 150) > 0).astype(np.int64)
    np.savez(path, x=x, y=y)


def _workers(fed: Federation, kind: str) -> list[WorkerAgent]:
    agents = []
    for i in range(3):
        path = fed.tmp / f"site{i}-{kind}.npz"
        _site_file(path, 40 + i, kind)
        agents.append(fed.add_worker(i, 1, partition=PartitionSection(), dataset="npz", categories=("digits",), data=DataSection(
            path=str(path), labels="multilabel" if kind == "multilabel" else "class",
            num_classes=0 if kind == "multilabel" else 2)))
    return agents


def _pooled(fed: Federation, job_id: str, agents: list[WorkerAgent]) -> tuple[np.ndarray, np.ndarray]:
    """The last round's model's outputs on every site's held-out split together, computed here."""
    tensors, spec_json = load_checkpoint(fed.store.last_checkpoint(job_id).checkpoint)
    model = build_model(parse_model(json.loads(spec_json)))
    load_numpy_state(model, tensors)
    xs, ys = [], []
    for agent in agents:
        config = agent.config
        test = train_test_split(load_worker_data(config), test_fraction=config.test_fraction, seed=config.split_seed)[1]
        xs.append(test.x)
        ys.append(test.y)
    with torch.no_grad():
        out = model(torch.from_numpy(np.concatenate(xs)).float()).double()
    return out.numpy(), np.concatenate(ys)


MODEL: dict[str, Any] = {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 8},
                                                        {"type": "ReLU"}]}


def _model(outputs: int) -> dict[str, Any]:
    return {**MODEL, "layers": [*MODEL["layers"], {"type": "Linear", "in_features": 8, "out_features": outputs}]}


def test_a_multilabel_jobs_rounds_carry_auroc_and_ap_per_finding_within_their_bounds(fed: Federation) -> None:
    agents = _workers(fed, "multilabel")
    job_id = fed.run(job(model=_model(3), task={"type": "multilabel", "labels": 3}, training={"rounds": 2},
                         evaluation={"every": 1, "score": "auroc", "threshold": 0.4}))
    last = status_reply(fed.coordinator, job_id).rounds[-1]
    scores = dict(last.federated_scores)
    assert last.federated_metric == "auroc" and last.federated_accuracy == pytest.approx(scores["auroc"])
    probs = torch.sigmoid(torch.from_numpy(_pooled(fed, job_id, agents)[0])).numpy()
    truth = _pooled(fed, job_id, agents)[1] >= 0.5
    assert last.federated_samples == len(truth)
    for label in range(3):
        assert abs(scores[f"auroc/{label}"] - roc_auc_score(truth[:, label], probs[:, label])) <= \
            scores[f"auroc_bound/{label}"] + 1e-9
        assert abs(scores[f"ap/{label}"] - average_precision_score(truth[:, label], probs[:, label])) <= \
            scores[f"ap_bound/{label}"] + 1e-9
        called = probs[:, label] >= 0.4
        assert scores[f"sens/{label}"] == pytest.approx((called & truth[:, label]).sum() / truth[:, label].sum())
    assert scores["auroc/0"] > 0.7   # a learnable finding is learned


def test_a_binary_jobs_rounds_carry_auroc_ap_sensitivity_and_specificity(fed: Federation) -> None:
    agents = _workers(fed, "binary")
    job_id = fed.run(job(model=_model(2), training={"rounds": 2}, evaluation={"every": 1, "score": "ap"}))
    last = status_reply(fed.coordinator, job_id).rounds[-1]
    scores = dict(last.federated_scores)
    assert last.federated_metric == "ap" and last.federated_accuracy == pytest.approx(scores["ap/1"])
    logits, y = _pooled(fed, job_id, agents)
    p1 = torch.softmax(torch.from_numpy(logits), dim=1).numpy()[:, 1]
    assert abs(scores["auroc"] - roc_auc_score(y, p1)) <= scores["auroc_bound"] + 1e-9
    assert abs(scores["ap"] - average_precision_score(y, p1)) <= scores["ap_bound"] + 1e-9
    assert scores["sensitivity"] == pytest.approx(((p1 >= 0.5) & (y == 1)).sum() / (y == 1).sum())
    assert scores["specificity"] == pytest.approx(((p1 < 0.5) & (y == 0)).sum() / (y == 0).sum())
    assert scores["accuracy"] == pytest.approx((logits.argmax(1) == y).mean())
