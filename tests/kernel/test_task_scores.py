"""Federated evaluation's per-task scores come from summed counts: scored over sites they equal the pooled score."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedbroker.job.task import TaskConfig
from fedbroker.tasks.scores import BINS, add_sums, auroc_from_histograms, batch_sums, scores, sums_problems


def _exact_auroc(scores_: np.ndarray, truth: np.ndarray) -> float:
    pos, neg = scores_[truth], scores_[~truth]
    wins = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(wins) / (len(pos) * len(neg))


def _split(n: int, sites: int, rng: np.random.Generator) -> list[np.ndarray]:
    cuts = np.sort(rng.choice(np.arange(1, n), size=sites - 1, replace=False))
    return np.split(rng.permutation(n), cuts)


def test_federated_dice_equals_pooled_dice_to_1e_9() -> None:
    rng = np.random.default_rng(0)
    task = TaskConfig(type="segmentation", classes=3)
    pred = rng.integers(0, 3, size=(40, 16, 16))
    mask = np.where(rng.random((40, 16, 16)) < 0.7, pred, rng.integers(0, 3, size=(40, 16, 16)))
    pooled = scores(task, batch_sums(task, pred, mask, 0.0))
    parts = _split(40, 5, rng)
    federated = scores(task, add_sums(batch_sums(task, pred[i], mask[i], 0.0) for i in parts))
    for c in range(3):
        inter = ((pred == c) & (mask == c)).sum()
        exact = 2 * inter / ((pred == c).sum() + (mask == c).sum())
        assert abs(federated[f"dice/{c}"] - exact) < 1e-9 and abs(pooled[f"dice/{c}"] - exact) < 1e-9
        iou = inter / (((pred == c) | (mask == c)).sum())
        assert abs(federated[f"iou/{c}"] - iou) < 1e-9
    # an average of the sites' own Dice is not the pooled Dice: the sums are what make it exact
    site_means = [scores(task, batch_sums(task, pred[i], mask[i], 0.0))["dice/1"] for i in parts]
    assert abs(float(np.mean(site_means)) - federated["dice/1"]) > 1e-9


def test_federated_auroc_lies_within_its_stated_binning_bound_of_the_pooled_exact_auroc() -> None:
    rng = np.random.default_rng(1)
    task = TaskConfig(type="multilabel", labels=2)
    truth = rng.random((500, 2)) < 0.3
    probs = np.clip(truth * 0.2 + rng.random((500, 2)) * 0.8, 0, 1)
    # a clump of near-equal scores that share bins: the bound must grow to cover it
    probs[:100, 1] = 0.5 + rng.random(100) * 1e-4
    parts = _split(500, 4, rng)
    got = scores(task, add_sums(batch_sums(task, probs[i], truth[i].astype(np.float32), 0.0) for i in parts))
    for label in range(2):
        exact = _exact_auroc(probs[:, label], truth[:, label])
        bound = got[f"auroc_bound/{label}"]
        assert 0 < bound < 0.05
        assert abs(got[f"auroc/{label}"] - exact) <= bound + 1e-12
    assert got["auroc_bound/1"] > got["auroc_bound/0"]


def test_the_binning_bound_is_tight_for_ties_in_one_bin() -> None:
    pos, neg = np.zeros(BINS), np.zeros(BINS)
    pos[10], neg[10] = 1, 1
    auroc, bound = auroc_from_histograms(pos, neg)
    assert auroc == 0.5 and bound == 0.5


def test_regression_mae_and_rmse_are_those_of_the_pooled_errors() -> None:
    rng = np.random.default_rng(2)
    task = TaskConfig(type="regression")
    pred, target = rng.normal(size=(60, 1)), rng.normal(size=60)
    got = scores(task, add_sums(batch_sums(task, pred[i], target[i], 0.0) for i in _split(60, 3, rng)))
    assert got["mae"] == pytest.approx(np.abs(pred[:, 0] - target).mean(), abs=1e-12)
    assert got["rmse"] == pytest.approx(math.sqrt(((pred[:, 0] - target) ** 2).mean()), abs=1e-12)


def test_classification_accuracy_and_macro_f1_match_a_pooled_count() -> None:
    rng = np.random.default_rng(3)
    task = TaskConfig()
    y = rng.integers(0, 4, 200)
    pred = np.where(rng.random(200) < 0.6, y, rng.integers(0, 4, 200))
    got = scores(task, add_sums(batch_sums(task, pred[i], y[i], 0.0) for i in _split(200, 4, rng)))
    assert got["accuracy"] == pytest.approx((pred == y).mean())
    f1 = [2 * ((pred == c) & (y == c)).sum() / ((pred == c).sum() + (y == c).sum()) for c in range(4)]
    assert got["macro_f1"] == pytest.approx(np.mean(f1))


def test_forged_sums_that_contradict_themselves_are_named() -> None:
    task = TaskConfig(type="segmentation", classes=2)
    honest = batch_sums(task, np.zeros((2, 4, 4), np.int64), np.zeros((2, 4, 4), np.int64), 1.0)
    assert sums_problems(task, honest, 2) == []
    forged = {**honest, "inter/0": honest["inter/0"] + 5}
    assert any("hits exceed" in p for p in sums_problems(task, forged, 2))
    assert any("unknown sum" in p for p in sums_problems(task, {**honest, "secret": 1.0}, 2))
    assert any("is nan" in p for p in sums_problems(task, {**honest, "pred/1": math.nan}, 2))
    assert any("n is" in p for p in sums_problems(task, honest, 3))
    multilabel = TaskConfig(type="multilabel", labels=1)
    sums = batch_sums(multilabel, np.array([[0.9], [0.1]]), np.array([[1.0], [0.0]]), 0.0)
    assert sums_problems(multilabel, sums, 2) == []
    assert sums_problems(multilabel, {**sums, "pos/0/999": 3.0}, 2)
