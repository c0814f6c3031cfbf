"""The scores clinicians read, federated: Dice/IoU equal the pooled figures to 1e-9 whatever the sites' split;
AUROC and average precision from the sites' summed histograms lie within their stated binning bounds of
scikit-learn's on the pooled predictions, and the bounds are reached; sensitivity, specificity and F1 at the
threshold are the pooled counts' exactly (fedbroker.tasks.curves derives the bounds)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import average_precision_score, f1_score, roc_auc_score

from fedbroker.job.task import TaskConfig
from fedbroker.tasks import curves
from fedbroker.tasks.scores import (
    BINS,
    CURVE_BUDGET,
    add_sums,
    batch_sums,
    curve_bins,
    score_names,
    scores,
    sums_problems,
    threshold_problem,
)


def _split(n: int, sites: int, rng: np.random.Generator) -> list[np.ndarray]:
    cuts = np.sort(rng.choice(np.arange(1, n), size=sites - 1, replace=False))
    return np.split(rng.permutation(n), cuts)


def _federated(task: TaskConfig, predicted: np.ndarray, y: np.ndarray, parts: list[np.ndarray],
               **kw: float) -> dict[str, float]:
    return scores(task, add_sums(batch_sums(task, predicted[i], y[i], 0.0) for i in parts), **kw)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), sites=st.integers(2, 7), classes=st.integers(2, 5))
def test_federated_dice_and_iou_equal_the_pooled_figures_for_any_split(seed: int, sites: int, classes: int) -> None:
    rng = np.random.default_rng(seed)
    task = TaskConfig(type="segmentation", classes=classes)
    pred = rng.integers(0, classes, size=(30, 9, 7))
    mask = np.where(rng.random(pred.shape) < rng.random(), pred, rng.integers(0, classes, size=pred.shape))
    got = _federated(task, pred, mask, _split(30, sites, rng))
    for c in range(classes):
        p, t = pred == c, mask == c
        if p.sum() + t.sum():
            assert abs(got[f"dice/{c}"] - 2 * (p & t).sum() / (p.sum() + t.sum())) < 1e-9
            assert abs(got[f"iou/{c}"] - (p & t).sum() / (p | t).sum()) < 1e-9


def _probabilities(rng: np.random.Generator, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    y = rng.integers(0, k, n)
    logits = rng.normal(size=(n, k)) + 1.5 * np.eye(k)[y]
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return probs, y


@pytest.mark.parametrize("k", [2, 4])
def test_classification_auroc_and_ap_lie_within_their_bounds_of_sklearns_pooled_scores(k: int) -> None:
    rng = np.random.default_rng(k)
    probs, y = _probabilities(rng, 900, k)
    probs[:200] = np.round(probs[:200], 2)     # ties and crowded bins: the bounds must cover them
    task = TaskConfig()
    for split in range(3):
        got = _federated(task, probs, y, _split(900, 3 + split, rng))
        for c in range(k):
            truth = y == c
            assert abs(got[f"auroc/{c}"] - roc_auc_score(truth, probs[:, c])) <= got[f"auroc_bound/{c}"] + 1e-12
            assert abs(got[f"ap/{c}"] - average_precision_score(truth, probs[:, c])) <= got[f"ap_bound/{c}"] + 1e-12
            assert 0 < got[f"auroc_bound/{c}"] < 0.02 and 0 < got[f"ap_bound/{c}"] < 0.05
    if k == 2:
        assert got["auroc"] == got["auroc/1"] and got["ap"] == got["ap/1"]
    else:
        assert got["auroc"] == pytest.approx(np.mean([got[f"auroc/{c}"] for c in range(k)]))


def test_multilabel_auroc_and_ap_lie_within_their_bounds_of_sklearns_pooled_scores() -> None:
    rng = np.random.default_rng(7)
    truth = rng.random((700, 3)) < [0.1, 0.4, 0.7]
    probs = np.clip(truth * 0.25 + rng.random((700, 3)) * 0.75, 0, 1)
    probs[:150, 2] = 0.5 + rng.random(150) * 1e-4          # a clump in one bin
    task = TaskConfig(type="multilabel", labels=3)
    got = _federated(task, probs, truth.astype(np.float32), _split(700, 5, rng))
    for label in range(3):
        assert abs(got[f"auroc/{label}"] - roc_auc_score(truth[:, label], probs[:, label])) <= \
            got[f"auroc_bound/{label}"] + 1e-12
        assert abs(got[f"ap/{label}"] - average_precision_score(truth[:, label], probs[:, label])) <= \
            got[f"ap_bound/{label}"] + 1e-12
    assert got["ap_bound/2"] > got["ap_bound/0"] and got["auroc_bound/2"] > got["auroc_bound/0"]


def _worst_case(positives_first: bool) -> tuple[np.ndarray, np.ndarray]:
    """Three crowded bins; in each the positives all above (tied, for AP's top end) or all below its negatives."""
    scores_, truth = [], []
    for base, p, q in ((0.9005, 4, 3), (0.5005, 2, 5), (0.1005, 1, 2)):
        if positives_first:
            scores_ += [base + 4e-4] * p + [base - 4e-4 + 1e-5 * i for i in range(q)]
        else:
            scores_ += [base + 4e-4 - 1e-5 * i for i in range(q)] + [base - 4e-4 + 1e-5 * i for i in range(p)]
        truth += [True] * p + [False] * q if positives_first else [False] * q + [True] * p
    return np.array(scores_), np.array(truth)


@pytest.mark.parametrize("positives_first", [True, False])
def test_the_bounds_are_reached_on_a_constructed_worst_case(positives_first: bool) -> None:
    s, truth = _worst_case(positives_first)
    pos = np.bincount(np.floor(s[truth] * BINS).astype(int), minlength=BINS).astype(float)
    neg = np.bincount(np.floor(s[~truth] * BINS).astype(int), minlength=BINS).astype(float)
    auroc, auroc_bound = curves.auroc(pos, neg)
    ap, ap_bound = curves.average_precision(pos, neg)
    sign = 1 if positives_first else -1
    assert roc_auc_score(truth, s) == pytest.approx(auroc + sign * auroc_bound, abs=1e-12)
    assert average_precision_score(truth, s) == pytest.approx(ap + sign * ap_bound, abs=1e-12)
    assert auroc_bound > 0.1 and ap_bound > 0.05


def test_without_shared_bins_the_scores_are_exact_and_the_bound_is_0_for_auroc() -> None:
    s = np.array([0.95, 0.85, 0.75, 0.65, 0.55, 0.45])
    truth = np.array([True, False, True, True, False, False])
    pos = np.bincount(np.floor(s[truth] * BINS).astype(int), minlength=BINS).astype(float)
    neg = np.bincount(np.floor(s[~truth] * BINS).astype(int), minlength=BINS).astype(float)
    assert curves.auroc(pos, neg) == (pytest.approx(roc_auc_score(truth, s)), 0.0)
    ap, bound = curves.average_precision(pos, neg)
    assert bound == pytest.approx(0.0, abs=1e-12) and ap == pytest.approx(average_precision_score(truth, s))


def test_sensitivity_specificity_and_f1_at_the_threshold_are_the_pooled_counts_exactly() -> None:
    rng = np.random.default_rng(11)
    probs, y = _probabilities(rng, 600, 2)
    got = _federated(TaskConfig(), probs, y, _split(600, 4, rng), threshold=0.3)
    called = probs[:, 1] >= 0.3
    assert got["sensitivity"] == (called & (y == 1)).sum() / (y == 1).sum()
    assert got["specificity"] == (~called & (y == 0)).sum() / (y == 0).sum()
    assert got["macro_f1"] == pytest.approx(f1_score(y, probs.argmax(1), average="macro"), abs=1e-12)
    assert got["f1/1"] == pytest.approx(f1_score(y, probs.argmax(1)), abs=1e-12)
    truth = rng.random((500, 4)) < 0.3
    p = np.clip(truth * 0.3 + rng.random((500, 4)) * 0.7, 0, 1)
    ml = _federated(TaskConfig(type="multilabel", labels=4), p, truth.astype(np.float32), _split(500, 3, rng),
                    threshold=0.6)
    for label in range(4):
        hit = p[:, label] >= 0.6
        assert ml[f"sens/{label}"] == (hit & truth[:, label]).sum() / truth[:, label].sum()
        assert ml[f"spec/{label}"] == (~hit & ~truth[:, label]).sum() / (~truth[:, label]).sum()
        assert ml[f"f1/{label}"] == pytest.approx(f1_score(truth[:, label], hit), abs=1e-12)
    assert ml["macro_f1"] == pytest.approx(f1_score(truth, p >= 0.6, average="macro"), abs=1e-12)


def test_the_youden_point_is_the_best_edge() -> None:
    pos, neg = np.zeros(10), np.zeros(10)
    pos[[6, 8]], neg[[1, 3, 7]] = 1, 1
    j, edge = curves.youden(pos, neg)
    assert (j, edge) == (pytest.approx(2 / 3), 0.4)


def test_report_size_is_bounded_and_wide_tasks_get_coarser_bins_or_none() -> None:
    assert curve_bins(TaskConfig(), 10) == BINS and curve_bins(TaskConfig(), 100) == 0
    assert "auroc" not in score_names(TaskConfig(), 100) and "auroc" in score_names(TaskConfig(), 2)
    wide = TaskConfig(type="multilabel", labels=100)
    assert curve_bins(wide, 100) == CURVE_BUDGET // 200
    probs = np.random.default_rng(0).random((3000, 100))
    sums = batch_sums(wide, probs, (probs > 0.5).astype(np.float32), 0.0)
    assert sum(k.startswith(("pos/", "neg/")) for k in sums) <= CURVE_BUDGET
    assert curve_bins(TaskConfig(type="multilabel", labels=5000), 5000) == 0
    assert threshold_problem(wide, 100, 0.5) == "" and "multiple of 1/320" in threshold_problem(wide, 100, 0.501)


def _forge(task: TaskConfig, honest: dict[str, float], n: int, **changes: float) -> list[str]:
    return sums_problems(task, {**honest, **changes}, n)


def test_forged_histograms_are_named() -> None:
    rng = np.random.default_rng(3)
    probs, y = _probabilities(rng, 50, 3)
    task = TaskConfig()
    honest = batch_sums(task, probs, y, 1.0)
    assert sums_problems(task, honest, 50) == []
    key = next(k for k in honest if k.startswith("pos/0/"))
    assert any("adds up to" in p for p in _forge(task, honest, 50, **{key: honest[key] + 1}))
    assert any("is -1.0" in p for p in _forge(task, honest, 50, **{key: -1.0}))
    assert any("outside" in p for p in _forge(task, honest, 50, **{"neg/0/1000": 1.0}))
    assert any("outside" in p for p in _forge(task, honest, 50, **{"neg/40/1": 1.0}))
    dropped = {k: v for k, v in honest.items() if not k.startswith(("pos/2/", "neg/2/"))}
    assert any("column 2" in p for p in sums_problems(task, dropped, 50))
    assert math.isnan(scores(task, {"n": 0.0})["accuracy"])


def test_a_score_the_task_cannot_produce_is_refused_at_submission_naming_it() -> None:
    from fedbroker.errors import ConfigError, ConfigErrors
    from fedbroker.job.spec import parse_job

    def submit(outputs: int, task: dict[str, object], **evaluation: object) -> list[str]:
        job = {"name": "j", "category": "c", "model": {"input_shape": [4], "layers": [
            {"type": "Linear", "in_features": 4, "out_features": outputs}]}, "task": task,
            "evaluation": {"every": 1, **evaluation}}
        try:
            parse_job(job)
        except ConfigErrors as exc:
            return [str(e) for e in exc.errors]
        except ConfigError as exc:
            return [str(exc)]
        return []

    assert submit(2, {"type": "classification"}, score="auroc", threshold=0.25) == []
    assert submit(3, {"type": "multilabel", "labels": 3}, score="ap") == []
    (wide,) = submit(40, {"type": "classification"}, score="auroc")
    assert wide.startswith("evaluation.score") and "'auroc'" in wide and "accuracy, macro_f1, loss" in wide
    (dice,) = submit(1, {"type": "regression"}, score="dice")
    assert dice.startswith("evaluation.score") and "mae, rmse, loss" in dice
    (off,) = submit(2, {"type": "classification"}, threshold=0.3333)
    assert off.startswith("evaluation.threshold") and "multiple of 1/1000" in off


def test_a_site_without_histograms_leaves_no_curve_scores_rather_than_ones_of_a_subset() -> None:
    rng = np.random.default_rng(5)
    probs, y = _probabilities(rng, 60, 3)
    task = TaskConfig()
    new = batch_sums(task, probs[:30], y[:30], 0.0)
    old = batch_sums(task, probs[30:].argmax(1), y[30:], 0.0)     # an older site: counts only
    mixed = scores(task, add_sums([new, old]))
    assert "auroc" not in mixed and mixed["accuracy"] == pytest.approx((probs.argmax(1) == y).mean())
    assert "auroc" in scores(task, new)
