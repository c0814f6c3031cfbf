"""Federated evaluation's scores per task, made from sums the sites add up, so the federated score is the score
on the union of the sites' held-out samples exactly (never an average of the sites' averages).

A site reports named sums over its held-out samples (`batch_sums`, added with `add_sums`); the coordinator adds
the sites' sums and scores them once (`scores`):

- every task: `n` (samples) and `loss` (the sum of the per-sample losses);
- classification: per class `tp/c`, `pred/c`, `true/c` of the arg-max class → accuracy (Σ tp / n), F1 per class
  and macro; and, for a model of at most `CURVE_CLASSES` classes, per class c the histograms of the predicted
  probability of c (softmax) over the samples of class c, `pos/c/b`, and the others, `neg/c/b` (one-vs-rest),
  over `BINS` equal bins of [0, 1] (only non-empty bins are sent) → AUROC and average precision per class with
  their binning bounds, sensitivity/specificity at the job's threshold; binary: of class 1, else macro means;
- multilabel: per label the counts at 0.5 (`tp/l`, `pred/l`, `true/l`) and the histograms `pos/l/b`, `neg/l/b`
  of its probability (sigmoid) at `curve_bins(task)` bins → per label AUROC, AP, sensitivity, specificity and
  F1 at the job's threshold, and their macro means;
- regression: `abs` and `sq`, the sums of absolute and squared errors over `values` target values → MAE, RMSE;
- segmentation: per class the pixel counts `inter/c` (predicted c where the mask is c), `pred/c`, `true/c` →
  Dice 2I/(P+T) and IoU I/(P+T−I) per class; the headline `dice` is the mean over foreground classes (1..C−1).

The curve scores and their bounds are `fedbroker.tasks.curves` (its docstring derives the bounds). Report size:
a histogram pair per class or label at 1000 bins is 2000 sums; a report may hold `CURVE_BUDGET` histogram bins,
so classification sends them for at most 32 classes (a wider model's AUROC/AP cannot be asked for), and a
multilabel task of more than 32 labels gets ⌊CURVE_BUDGET / (2·labels)⌋ bins (≥ 31 up to 1024 labels; none
beyond), its bounds widening with the coarser bins, as computed from the data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np

from fedbroker.job.task import TaskConfig
from fedbroker.tasks import curves

BINS = 1000              # the fine fixed binning of a probability
THRESHOLD = 0.5          # multilabel tp/pred counts; the job's threshold (evaluation.threshold) reads the histograms
CURVE_CLASSES = 32       # classification: histograms for a model of at most this many classes
CURVE_BUDGET = 64_000    # histogram bins one report may carry (2 per class or label)
CURVE_LABELS = 1024      # multilabel: histograms for at most this many labels (CURVE_BUDGET // 2048 = 31 bins)
# Score names: whether higher is better. Per-class scores are `<name>/<class>`.
DIRECTIONS: Mapping[str, bool] = {
    "accuracy": True, "macro_f1": True, "auroc": True, "ap": True, "sensitivity": True, "specificity": True,
    "youden": True, "dice": True, "iou": True, "mae": False, "rmse": False, "loss": False}


def curve_bins(task: TaskConfig, width: int) -> int:
    """The bins of the probability histograms for a task whose model outputs `width` classes or labels (0: none
    sent, so no AUROC/AP); the same on every site and at the coordinator."""
    if task.type == "classification":
        return BINS if 2 <= width <= CURVE_CLASSES else 0
    if task.type == "multilabel":
        if width <= CURVE_CLASSES:
            return BINS
        return CURVE_BUDGET // (2 * width) if width <= CURVE_LABELS else 0
    return 0


def score_names(task: TaskConfig, width: int) -> tuple[str, ...]:
    """The headline scores the task can produce (`evaluation.score` picks one) for a model of `width` outputs."""
    curve = ("auroc", "ap", "sensitivity", "specificity", "youden") if curve_bins(task, width) else ()
    return {"classification": ("accuracy", "macro_f1", *curve, "loss"),
            "multilabel": ("macro_f1", *curve, "loss"),
            "regression": ("mae", "rmse", "loss"),
            "segmentation": ("dice", "iou", "loss")}[task.type]


def threshold_problem(task: TaskConfig, width: int, threshold: float) -> str:
    """Why sensitivity/specificity cannot be read at `threshold` ("" when they can): it must lie on the
    histograms' bin edges, strictly inside (0, 1)."""
    bins = curve_bins(task, width) or BINS
    edge = round(threshold * bins)
    if not 0 < threshold < 1 or abs(threshold * bins - edge) > 1e-9:
        return f"must be a multiple of 1/{bins} in (0, 1) (the edges of this task's {bins} score bins), got {threshold!r}"
    return ""


def _counts(prefix: str, values: np.ndarray, size: int) -> dict[str, float]:
    counts = np.bincount(values.ravel(), minlength=size)[:size]
    return {f"{prefix}/{i}": float(c) for i, c in enumerate(counts) if c}


def _histograms(out: dict[str, float], probs: np.ndarray, truth: np.ndarray, bins: int) -> None:
    """`pos/j/b` and `neg/j/b` of each column j of `probs` (n, width), split by the boolean `truth` (n, width)."""
    binned = np.clip(np.floor(probs.astype(np.float64) * bins).astype(np.int64), 0, bins - 1)
    for j in range(probs.shape[1]):
        out.update(_counts(f"pos/{j}", binned[truth[:, j], j], bins))
        out.update(_counts(f"neg/{j}", binned[~truth[:, j], j], bins))


def batch_sums(task: TaskConfig, predicted: np.ndarray, y: np.ndarray, loss_sum: float) -> dict[str, float]:
    """The sums of one batch: `predicted` is `fedbroker.tasks.losses.predictions` of the model's output
    (classification: (n, k) probabilities, or (n,) class indices for counts alone), `y` the labels, `loss_sum`
    the sum of the batch's per-sample losses."""
    out: dict[str, float] = {"n": float(len(y)), "loss": float(loss_sum)}
    if task.type in ("classification", "segmentation"):
        probs = predicted if task.type == "classification" and predicted.ndim == 2 else None
        if probs is not None:
            predicted = probs.argmax(axis=1)
        size = int(max(int(predicted.max(initial=0)), int(y.max(initial=0))) + 1)
        if task.type == "segmentation":
            size = max(size, task.classes)
        hit = predicted == y
        prefix = "inter" if task.type == "segmentation" else "tp"
        out.update(_counts(prefix, y[hit].astype(np.int64), size))
        out.update(_counts("pred", predicted.astype(np.int64), size))
        out.update(_counts("true", y.astype(np.int64), size))
        bins = curve_bins(task, probs.shape[1]) if probs is not None else 0
        if probs is not None and bins:
            truth = y.astype(np.int64)[:, None] == np.arange(probs.shape[1])[None, :]
            _histograms(out, probs, truth, bins)
    elif task.type == "multilabel":
        truth = y >= 0.5
        guess = predicted >= THRESHOLD
        for label in range(predicted.shape[1]):
            for name, count in (("tp", (truth[:, label] & guess[:, label]).sum()), ("pred", guess[:, label].sum()),
                                ("true", truth[:, label].sum())):
                if count:
                    out[f"{name}/{label}"] = float(count)
        bins = curve_bins(task, predicted.shape[1])
        if bins:
            _histograms(out, predicted, truth, bins)
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
    """(AUROC, bound on its binning error): `fedbroker.tasks.curves.auroc`."""
    return curves.auroc(pos, neg)


def _f1(tp: float, pred: float, true: float) -> float:
    return 2 * tp / (pred + true) if pred + true else math.nan


def _mean(values: Iterable[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return float(np.mean(kept)) if kept else math.nan


def histograms(sums: Mapping[str, float], width: int, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """(pos, neg), each (width, bins), of the `pos/j/b` and `neg/j/b` sums (read in one pass)."""
    pos, neg = np.zeros((width, bins)), np.zeros((width, bins))
    for key, value in sums.items():
        head, _, rest = key.partition("/")
        if head in ("pos", "neg"):
            j, _, b = rest.partition("/")
            if j.isdigit() and b.isdigit() and int(j) < width and int(b) < bins:
                (pos if head == "pos" else neg)[int(j), int(b)] = value
    return pos, neg


def _curve_scores(out: dict[str, float], pos: np.ndarray, neg: np.ndarray, edge: int) -> None:
    """Per column j: auroc/j, ap/j with their bounds, and sens/spec/precision/f1/youden at the edge."""
    for j in range(len(pos)):
        out[f"auroc/{j}"], out[f"auroc_bound/{j}"] = curves.auroc(pos[j], neg[j])
        out[f"ap/{j}"], out[f"ap_bound/{j}"] = curves.average_precision(pos[j], neg[j])
        for name, value in curves.at_threshold(pos[j], neg[j], edge).items():
            out[f"{name}/{j}"] = value
        out[f"youden/{j}"], out[f"youden_threshold/{j}"] = curves.youden(pos[j], neg[j])


def _headlines(out: dict[str, float], columns: list[int]) -> None:
    """auroc, ap (with bounds), sensitivity, specificity, youden over `columns` (one: that column's; several:
    their means; a mean's bound is the mean of the bounds)."""
    for name, key in (("auroc", "auroc"), ("auroc_bound", "auroc_bound"), ("ap", "ap"), ("ap_bound", "ap_bound"),
                      ("sensitivity", "sens"), ("specificity", "spec"), ("youden", "youden")):
        out[name] = _mean(out[f"{key}/{j}"] for j in columns)


def _width(task: TaskConfig, sums: Mapping[str, float], size: int) -> int:
    if size:
        return size
    if task.classes or task.labels:
        return task.classes or task.labels
    found = [int(k.split("/")[1]) for k in sums if k.count("/") >= 1 and k.split("/")[1].isdigit()]
    return max(found, default=-1) + 1


def scores(task: TaskConfig, sums: Mapping[str, float], *, size: int = 0,
           threshold: float = THRESHOLD) -> dict[str, float]:
    """The task's scores from (summed) sums, by name (module docstring); the headline is the job's
    `evaluation.score` (`headline`). `size`: the classes or labels to score (0: the task's, else as many as the
    sums name); `threshold`: where sensitivity, specificity (and multilabel F1) are read, on a bin edge."""
    n = sums.get("n", 0.0)
    out: dict[str, float] = {"loss": sums.get("loss", 0.0) / n if n else math.nan}
    if task.type == "regression":
        values = sums.get("values", 0.0)
        out["mae"] = sums.get("abs", 0.0) / values if values else math.nan
        out["rmse"] = math.sqrt(sums.get("sq", 0.0) / values) if values else math.nan
        return out
    first = "inter" if task.type == "segmentation" else "tp"
    hits, pred, true = _indexed(sums, first), _indexed(sums, "pred"), _indexed(sums, "true")
    size = _width(task, sums, size)
    if task.type == "segmentation":
        for c in range(size):
            i, p, t = hits.get(c, 0.0), pred.get(c, 0.0), true.get(c, 0.0)
            out[f"dice/{c}"] = 2 * i / (p + t) if p + t else math.nan
            out[f"iou/{c}"] = i / (p + t - i) if p + t - i else math.nan
        out["dice"] = _mean(out[f"dice/{c}"] for c in range(1, size))
        out["iou"] = _mean(out[f"iou/{c}"] for c in range(1, size))
        return out
    for c in range(size):
        out[f"f1/{c}"] = _f1(hits.get(c, 0.0), pred.get(c, 0.0), true.get(c, 0.0))
    if task.type == "classification":
        out["accuracy"] = sum(hits.values()) / n if n else math.nan
    bins = curve_bins(task, size)
    pos, neg = histograms(sums, size, bins) if bins else (np.zeros((0, 0)), np.zeros((0, 0)))
    # every sample in every column's histograms: a site without them (one from before) leaves no curve scores
    if bins and size and bool(np.all(pos.sum(axis=1) + neg.sum(axis=1) == n)):
        f1_counts = {c: out[f"f1/{c}"] for c in range(size)}
        _curve_scores(out, pos, neg, round(threshold * bins))
        if task.type == "classification":   # F1 per class is the arg-max's; the threshold's is `f1_at/c`
            for c in range(size):
                out[f"f1_at/{c}"], out[f"f1/{c}"] = out[f"f1/{c}"], f1_counts[c]
        _headlines(out, [1] if task.type == "classification" and size == 2 else list(range(size)))
    out["macro_f1"] = _mean(out[f"f1/{c}"] for c in range(size))
    if "auroc" in out:
        out["macro_auroc"] = _mean(out[f"auroc/{c}"] for c in range(size))
    return out


def headline(task: TaskConfig, score: str = "") -> tuple[str, bool]:
    """(the headline score's name, whether higher is better): the job's `evaluation.score`, or the task's own
    (`TaskConfig.metric`)."""
    name = score or task.metric
    return name, DIRECTIONS.get(name, True)


def sums_problems(task: TaskConfig, sums: Mapping[str, float], num_samples: int) -> list[str]:
    """What makes a site's reported sums impossible (the coordinator refuses such a report; it cannot see a
    consistent forgery): unknown names, negative or fractional counts, counts that disagree with each other or
    with the report's sample count, histograms outside the task's bins or not adding up."""
    problems: list[str] = []
    allowed = {"classification": ("tp", "pred", "true", "pos", "neg"), "segmentation": ("inter", "pred", "true"),
               "multilabel": ("tp", "pred", "true", "pos", "neg"), "regression": ("abs", "sq", "values")}[task.type]
    for key, value in sums.items():
        head = key.partition("/")[0]
        if key not in ("n", "loss") and head not in allowed:
            problems.append(f"unknown sum {key[:40]!r} for task {task.type}")
        elif not math.isfinite(value) or (key != "loss" and value < 0):
            problems.append(f"sum {key[:40]!r} is {value!r}")
        elif head in ("n", "tp", "pred", "true", "inter", "pos", "neg", "values") and value != int(value):
            problems.append(f"count {key[:40]!r} is not whole: {value!r}")
        if len(problems) >= 5:
            return problems
    if problems:
        return problems
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
    if task.type in ("classification", "multilabel"):
        problems.extend(_histogram_problems(task, sums, true, num_samples))
    if task.type == "segmentation" and task.classes and any(c >= task.classes for c in [*pred, *true]):
        problems.append(f"a class index beyond the task's {task.classes} classes")
    return problems


def _histogram_problems(task: TaskConfig, sums: Mapping[str, float], true: Mapping[int, float],
                        num_samples: int) -> list[str]:
    """The `pos/j/b`, `neg/j/b` histograms: well-formed names, j and b within the task's histograms, and per
    class or label Σ pos = its true count and Σ pos + Σ neg = the sample count (read in one pass)."""
    width = task.labels if task.type == "multilabel" else CURVE_CLASSES
    bins = curve_bins(task, width)
    totals: dict[tuple[str, int], float] = {}
    for key, value in sums.items():
        head, _, rest = key.partition("/")
        if head not in ("pos", "neg"):
            continue
        column, _, b = rest.partition("/")
        if not (column.isdigit() and b.isdigit() and int(column) < width and int(b) < bins):
            return [f"histogram sum {key[:40]!r} is outside the task's {width} columns of {bins} bins"]
        totals[head, int(column)] = totals.get((head, int(column)), 0.0) + value
    problems = []
    for j in sorted({j for _, j in totals} | (set(true) if totals else set())):  # all columns, or none
        if totals.get(("pos", j), 0.0) != true.get(j, 0.0):
            problems.append(f"column {j}'s positive histogram adds up to {totals.get(('pos', j), 0.0):g}, "
                            f"not its true count {true.get(j, 0.0):g}")
        elif totals.get(("pos", j), 0.0) + totals.get(("neg", j), 0.0) != num_samples:
            problems.append(f"column {j}'s histograms add up to "
                            f"{totals.get(('pos', j), 0.0) + totals.get(('neg', j), 0.0):g}, not the sample count "
                            f"{num_samples}")
        if len(problems) >= 3:
            break
    return problems
