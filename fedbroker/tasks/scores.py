"""Federated evaluation's scores per task, made from sums the sites add up, so the federated score is the score
on the union of the sites' held-out samples exactly (never an average of the sites' averages).

A site reports named sums over its held-out samples (`batch_sums`, added with `add_sums`); the coordinator adds
the sites' sums and scores them once (`scores`):

- every task: `n` (samples) and `loss` (the sum of the per-sample losses);
- classification: per class `tp/c`, `pred/c`, `true/c` → accuracy (Σ tp / n) and macro F1;
- multilabel: per label the same counts at threshold 0.5 → per-label and macro F1; and per label the
  histograms of the predicted probability of its positive and negative samples, `pos/l/b` and `neg/l/b` over
  `BINS` equal bins of [0, 1] (only non-empty bins are sent) → AUROC per label (`auroc_from_histograms`);
- regression: `abs` and `sq`, the sums of absolute and squared errors over `values` target values → MAE, RMSE;
- segmentation: per class the pixel counts `inter/c` (predicted c where the mask is c), `pred/c`, `true/c` →
  Dice 2I/(P+T) and IoU I/(P+T−I) per class; the headline `dice` is the mean over foreground classes (1..C−1).

AUROC from histograms: two samples in the same bin count as a tie (½), so the binned AUROC differs from the
exact one by at most ½·Σ_b pos_b·neg_b / (P·N), the share of positive–negative pairs that share a bin, which
`auroc_from_histograms` returns with it (`auroc_bound/l`). With BINS = 1000 that is ≤ 1/2000 when scores are
spread evenly, and it is computed from the data, so a cluttered bin shows as a larger stated bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from fedbroker.job.task import TaskConfig

BINS = 1000
THRESHOLD = 0.5


def _counts(prefix: str, values: np.ndarray, size: int) -> dict[str, float]:
    counts = np.bincount(values.ravel(), minlength=size)[:size]
    return {f"{prefix}/{i}": float(c) for i, c in enumerate(counts) if c}


def batch_sums(task: TaskConfig, predicted: np.ndarray, y: np.ndarray, loss_sum: float) -> dict[str, float]:
    """The sums of one batch: `predicted` is `fedbroker.tasks.losses.predictions` of the model's output, `y` the
    labels, `loss_sum` the sum of the batch's per-sample losses."""
    out: dict[str, float] = {"n": float(len(y)), "loss": float(loss_sum)}
    if task.type in ("classification", "segmentation"):
        size = int(max(int(predicted.max(initial=0)), int(y.max(initial=0))) + 1)
        if task.type == "segmentation":
            size = max(size, task.classes)
        hit = predicted == y
        prefix = "inter" if task.type == "segmentation" else "tp"
        out.update(_counts(prefix, y[hit].astype(np.int64), size))
        out.update(_counts("pred", predicted.astype(np.int64), size))
        out.update(_counts("true", y.astype(np.int64), size))
    elif task.type == "multilabel":
        truth = y >= 0.5
        guess = predicted >= THRESHOLD
        bins = np.clip((predicted * BINS).astype(np.int64), 0, BINS - 1)
        for label in range(predicted.shape[1]):
            for name, count in (("tp", (truth[:, label] & guess[:, label]).sum()), ("pred", guess[:, label].sum()),
                                ("true", truth[:, label].sum())):
                if count:
                    out[f"{name}/{label}"] = float(count)
            out.update(_counts(f"pos/{label}", bins[truth[:, label], label], BINS))
            out.update(_counts(f"neg/{label}", bins[~truth[:, label], label], BINS))
    else:
        error = predicted.reshape(len(y), -1) - y.reshape(len(y), -1)
        out.update({"abs": float(np.abs(error).sum()), "sq": float((error ** 2).sum()), "values": float(error.size)})
    return out


def add_sums(parts: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The key-wise sum of several sites' (or batches') sums."""
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total


def _indexed(sums: Mapping[str, float], prefix: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in sums.items():
        head, _, index = key.partition("/")
        if head == prefix and index.isdigit():
            out[int(index)] = value
    return out


def auroc_from_histograms(pos: np.ndarray, neg: np.ndarray) -> tuple[float, float]:
    """(AUROC, bound on its binning error) from the histograms of the positives' and negatives' scores over the
    same bins: P(score⁺ > score⁻) with ties in a bin counted ½; NaN for both when a side is empty."""
    p_total, n_total = float(pos.sum()), float(neg.sum())
    if not p_total or not n_total:
        return math.nan, math.nan
    below = np.concatenate([[0.0], np.cumsum(neg)[:-1]])   # negatives in lower bins
    wins = float((pos * below).sum()) + 0.5 * float((pos * neg).sum())
    return wins / (p_total * n_total), 0.5 * float((pos * neg).sum()) / (p_total * n_total)


def _f1(tp: float, pred: float, true: float) -> float:
    return 2 * tp / (pred + true) if pred + true else math.nan


def scores(task: TaskConfig, sums: Mapping[str, float], *, size: int = 0) -> dict[str, float]:
    """The task's scores from (summed) sums, by name; the headline is `task.metric`. `size`: the classes or
    labels to score (0: as many as the sums name)."""
    n = sums.get("n", 0.0)
    out: dict[str, float] = {"loss": sums.get("loss", 0.0) / n if n else math.nan}
    if task.type == "regression":
        values = sums.get("values", 0.0)
        out["mae"] = sums.get("abs", 0.0) / values if values else math.nan
        out["rmse"] = math.sqrt(sums.get("sq", 0.0) / values) if values else math.nan
        return out
    first = "inter" if task.type == "segmentation" else "tp"
    hits, pred, true = _indexed(sums, first), _indexed(sums, "pred"), _indexed(sums, "true")
    size = size or task.classes or task.labels or (max([*hits, *pred, *true], default=-1) + 1)
    if task.type == "classification":
        out["accuracy"] = sum(hits.values()) / n if n else math.nan
        f1s = [_f1(hits.get(c, 0.0), pred.get(c, 0.0), true.get(c, 0.0)) for c in range(size)]
        out["macro_f1"] = float(np.nanmean(f1s)) if any(not math.isnan(f) for f in f1s) else math.nan
    elif task.type == "segmentation":
        for c in range(size):
            i, p, t = hits.get(c, 0.0), pred.get(c, 0.0), true.get(c, 0.0)
            out[f"dice/{c}"] = 2 * i / (p + t) if p + t else math.nan
            out[f"iou/{c}"] = i / (p + t - i) if p + t - i else math.nan
        fg = [out[f"dice/{c}"] for c in range(1, size) if not math.isnan(out[f"dice/{c}"])]
        out["dice"] = float(np.mean(fg)) if fg else math.nan
        fg_iou = [out[f"iou/{c}"] for c in range(1, size) if not math.isnan(out[f"iou/{c}"])]
        out["iou"] = float(np.mean(fg_iou)) if fg_iou else math.nan
    else:
        f1s = []
        for label in range(size):
            f1 = _f1(hits.get(label, 0.0), pred.get(label, 0.0), true.get(label, 0.0))
            out[f"f1/{label}"] = f1
            f1s.append(f1)
            pos, neg = np.zeros(BINS), np.zeros(BINS)
            for b, v in _indexed_pair(sums, "pos", label).items():
                pos[b] = v
            for b, v in _indexed_pair(sums, "neg", label).items():
                neg[b] = v
            out[f"auroc/{label}"], out[f"auroc_bound/{label}"] = auroc_from_histograms(pos, neg)
        kept = [f for f in f1s if not math.isnan(f)]
        out["macro_f1"] = float(np.mean(kept)) if kept else math.nan
        aurocs = [out[f"auroc/{label}"] for label in range(size) if not math.isnan(out[f"auroc/{label}"])]
        out["macro_auroc"] = float(np.mean(aurocs)) if aurocs else math.nan
    return out


def _indexed_pair(sums: Mapping[str, float], prefix: str, label: int) -> dict[int, float]:
    start = f"{prefix}/{label}/"
    return {int(key[len(start):]): value for key, value in sums.items()
            if key.startswith(start) and key[len(start):].isdigit()}


def sums_problems(task: TaskConfig, sums: Mapping[str, float], num_samples: int) -> list[str]:
    """What makes a site's reported sums impossible (the coordinator refuses such a report; it cannot see a
    consistent forgery): unknown names, negative or fractional counts, counts that disagree with each other or
    with the report's sample count."""
    problems: list[str] = []
    allowed = {"classification": ("tp", "pred", "true"), "segmentation": ("inter", "pred", "true"),
               "multilabel": ("tp", "pred", "true", "pos", "neg"), "regression": ("abs", "sq", "values")}[task.type]
    for key, value in sums.items():
        head = key.partition("/")[0]
        if key not in ("n", "loss") and head not in allowed:
            problems.append(f"unknown sum {key[:40]!r} for task {task.type}")
        elif not math.isfinite(value) or (key != "loss" and value < 0):
            problems.append(f"sum {key[:40]!r} is {value!r}")
        elif head in ("n", "tp", "pred", "true", "inter", "pos", "neg", "values") and value != int(value):
            problems.append(f"count {key[:40]!r} is not whole: {value!r}")
    if problems:
        return problems[:5]
    if sums.get("n") != num_samples:
        problems.append(f"n is {sums.get('n')} but the report counts {num_samples} samples")
    hits = _indexed(sums, "inter" if task.type == "segmentation" else "tp")
    pred, true = _indexed(sums, "pred"), _indexed(sums, "true")
    if any(v > min(pred.get(c, 0.0), true.get(c, 0.0)) for c, v in hits.items()):
        problems.append("a class's hits exceed its predicted or true count")
    if task.type == "classification" and (sum(pred.values()) != num_samples or sum(true.values()) != num_samples):
        problems.append("the predicted and true counts must each add up to the sample count")
    if task.type == "segmentation" and sum(pred.values()) != sum(true.values()):
        problems.append("the predicted and true pixel counts must add up to the same total")
    if task.type == "multilabel":
        for label, t in true.items():
            if sum(_indexed_pair(sums, "pos", label).values()) != t:
                problems.append(f"label {label}'s positive histogram does not add up to its true count")
                break
        labels = {int(k.split("/")[1]) for k in sums if k.startswith(("pos/", "neg/")) and k.split("/")[1].isdigit()}
        for label in sorted(labels):
            if sum(_indexed_pair(sums, "pos", label).values()) + sum(_indexed_pair(sums, "neg", label).values()) \
                    != num_samples:
                problems.append(f"label {label}'s histograms do not add up to the sample count")
                break
    if task.type == "segmentation" and task.classes and any(c >= task.classes for c in [*pred, *true]):
        problems.append(f"a class index beyond the task's {task.classes} classes")
    return problems
