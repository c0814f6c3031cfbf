"""Scores read from the histograms of a predicted probability: AUROC and average precision with a bound on what
the binning cost, and sensitivity, specificity, precision and F1 at a threshold on the bins' edges.

A site sends, for one class (one-vs-rest) or one label, `pos[b]` and `neg[b]`: how many of its positive and
negative held-out samples got a probability in bin b = ⌊p·B⌋ of B equal bins of [0, 1] (p = 1 in the last). The
coordinator adds the sites' histograms; all that follows is computed from those sums, so it is the same as if
one site held every sample. Within a bin the order of the samples is lost; the bounds below are over every
order (and every grouping into exact ties) the bin could have held.

AUROC (P positives, N negatives). The exact AUROC counts a positive–negative pair as won (1), tied (½) or lost
(0); pairs in different bins are ordered by their bins, pairs in the same bin count ½ here. Only those
Σ_b pos_b·neg_b pairs can be wrong, each by at most ½, so

    |AUROC_binned − AUROC_exact| ≤ ½ · Σ_b pos_b·neg_b / (P·N)                          (the `auroc_bound`).

Tight: when every positive of each shared bin scores above (below) its negatives the exact value is the binned
one plus (minus) the bound. With B = 1000 and scores spread evenly the bound is about 1/(2B) = 0.0005.

Average precision, AP = (1/P) Σ over positives (ranked by score, highest first) of the precision at that
positive's rank — scikit-learn's `average_precision_score`, which treats a group of exactly equal scores as one
threshold: each positive of the group gets the precision at the group's end. Take a bin b with p positives and
q negatives, and T positives and F negatives in the bins above. Its i-th positive (i = 1..p, in the true order)
has at least T + i positives and at most F + q negatives ranked at or above it; ties only move the precision up
to the group's end, at most T + p positives over T + p + F samples. So each of the bin's positives contributes
a precision in

    [(T+i)/(T+i+F+q),  (T+p)/(T+p+F)],

and AP lies in [AP_lo, AP_hi], the sums of those ends over every bin divided by P. We report the midpoint and
half the width as `ap_bound`; both ends are reached (negatives with distinct scores above the bin's positives;
the bin's positives tied above its negatives), so the bound is tight. It is 0 for a bin whose positives are its
only samples and whose precision cannot change inside it; it grows with the positives and negatives sharing a
bin, that is with the ties the binning made.

At a threshold t on the bins' edges (t·B a whole number k) a sample counts as predicted positive when its bin is
k or above, which is p ≥ t (up to the rounding of p·B in the last bit): sensitivity = Σ_{b≥k} pos_b / P,
specificity = Σ_{b<k} neg_b / N, exact. The Youden point is the edge that maximises sensitivity + specificity − 1.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.special import digamma


def auroc(pos: np.ndarray, neg: np.ndarray) -> tuple[float, float]:
    """(AUROC, its binning bound) from the histograms of the positives' and negatives' scores over the same bins:
    P(score⁺ > score⁻) with a shared bin counted ½; NaN for both when a side is empty."""
    p_total, n_total = float(pos.sum()), float(neg.sum())
    if not p_total or not n_total:
        return math.nan, math.nan
    below = np.concatenate([[0.0], np.cumsum(neg)[:-1]])   # negatives in lower bins
    shared = float((pos * neg).sum())
    wins = float((pos * below).sum()) + 0.5 * shared
    return wins / (p_total * n_total), 0.5 * shared / (p_total * n_total)


def average_precision(pos: np.ndarray, neg: np.ndarray) -> tuple[float, float]:
    """(AP, its binning bound): the midpoint and half-width of [AP_lo, AP_hi] (module docstring); NaN for both
    without a positive (and exactly (1, 0) without a negative)."""
    p_total = float(pos.sum())
    if not p_total:
        return math.nan, math.nan
    p, q = pos[::-1].astype(np.float64), neg[::-1].astype(np.float64)   # highest bin first
    above_p = np.cumsum(p) - p
    above_n = np.cumsum(q) - q
    kept = p > 0
    p, q, t, f = p[kept], q[kept], above_p[kept], above_n[kept]
    high = float((p * (t + p) / (t + p + f)).sum())
    # Σ_{i=1..p} (T+i)/(T+i+c) = p − c·Σ_{i=1..p} 1/(T+c+i) = p − c·(ψ(T+c+p+1) − ψ(T+c+1)), with c = F + q
    c = f + q
    harmonic = np.where(c > 0, digamma(t + c + p + 1) - digamma(t + c + 1), 0.0)
    low = float((p - c * harmonic).sum())
    lo, hi = low / p_total, high / p_total
    return (lo + hi) / 2, (hi - lo) / 2


def at_threshold(pos: np.ndarray, neg: np.ndarray, edge: int) -> dict[str, float]:
    """Counts and rates with the samples in bins `edge` and above called positive: sensitivity (recall),
    specificity, precision and F1 (NaN where a rate has no denominator)."""
    tp, fp = float(pos[edge:].sum()), float(neg[edge:].sum())
    fn, tn = float(pos[:edge].sum()), float(neg[:edge].sum())
    return {"sens": tp / (tp + fn) if tp + fn else math.nan, "spec": tn / (tn + fp) if tn + fp else math.nan,
            "precision": tp / (tp + fp) if tp + fp else math.nan,
            "f1": 2 * tp / (2 * tp + fp + fn) if tp + fp + fn else math.nan}


def youden(pos: np.ndarray, neg: np.ndarray) -> tuple[float, float]:
    """(J = max over the bins' edges of sensitivity + specificity − 1, the edge as a threshold in [0, 1]); the
    lowest such edge; NaN for both when a side is empty."""
    p_total, n_total = float(pos.sum()), float(neg.sum())
    if not p_total or not n_total:
        return math.nan, math.nan
    bins = len(pos)
    sens = np.concatenate([np.cumsum(pos[::-1])[::-1], [0.0]]) / p_total    # edge k: bins k.. positive
    spec = np.concatenate([[0.0], np.cumsum(neg)]) / n_total
    j = sens + spec - 1
    k = int(np.argmax(j))
    return float(j[k]), k / bins
