"""Coordinate-wise median and β-trimmed mean (Yin, Chen, Ramchandran, Bartlett, ICML 2018).

Per coordinate j, the trimmed mean drops the k = ⌈βn⌉ largest and k smallest of the n values Δ_1j … Δ_nj
and averages the n − 2k left; the median is the same with k = ⌊(n − 1)/2⌋ (the middle value, or the mean
of the two middle ones). Each coordinate is judged alone, so an update can be kept in one coordinate and
dropped in the next: an update's `kept_weight` is the mean over coordinates of the share it got.

How: up to 24 updates, a block of coordinates at a time goes through a sorting network (Batcher's odd-even
merge sort: each compare-exchange is an elementwise min and max over the block, 2.5× faster than a sort at
n = 10). More updates go a block of columns at a time into a (block, n) copy whose rows are one coordinate
each, and each row is sorted in place. At n ≤ a few hundred a sort of such short contiguous rows (numpy's
vectorised sort) is faster than `np.partition` with the two order statistics a trimmed mean needs (0.26 s
against 0.15 s at n = 50, P = 1M, the weighted mean 0.012 s), and even with the one a median needs (0.18 s
against 0.12 s); bench/robust.py measures both rules against the weighted mean. Both rules
ignore the job's weighting, as the paper's: a weighted median would let one site claiming many samples
decide every coordinate.
"""

from __future__ import annotations

import math
from fractions import Fraction
from functools import lru_cache

import numpy as np

from fedbroker.aggregators.robust.base import ROBUST, RobustInput, RobustResult, uniform
from fedbroker.aggregators.robust.rule import RuleBase
from fedbroker.algorithms.robust_params import MedianParams, TrimmedMeanParams

BLOCK = 1 << 12          # coordinates per sorted block: (BLOCK, n) stays in cache
NETWORK_BLOCK = 1 << 13  # coordinates per block through the sorting network: n rows of it stay in cache
NETWORK_UP_TO = 24       # at most this many updates go through a sorting network, more through np.sort
SHARE_SAMPLE = 1 << 16   # coordinates, evenly spread, that each update's kept share is measured on


def trimmed(deltas: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(the per-coordinate mean of the values left after dropping the k largest and k smallest, each update's
    mean share over coordinates). Needs 0 <= 2k < n."""
    n, p = deltas.shape
    if not 0 <= 2 * k < n:
        raise ValueError(f"cannot drop {k} value(s) at each end of {n} update(s)")
    out = np.empty(p)
    if n <= NETWORK_UP_TO:
        _network_trimmed(deltas, k, out)
        return out, kept_shares(deltas, k)
    for start in range(0, p, BLOCK):
        block = np.ascontiguousarray(deltas[:, start:start + BLOCK].T)   # (b, n): one coordinate per row
        block.sort(axis=1)
        out[start:start + BLOCK] = block[:, k:n - k].sum(axis=1, dtype=np.float64) / (n - 2 * k)
    return out, kept_shares(deltas, k)


@lru_cache(maxsize=NETWORK_UP_TO + 1)
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort as compare-exchange pairs (i < j: afterwards x_i <= x_j) sorting n values
    (Knuth, TAOCP vol. 3, 5.3.4; O(n log² n) pairs: 32 for n = 10)."""
    pairs: list[tuple[int, int]] = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            for j in range(k % p, n - k, 2 * k):
                pairs.extend((i + j, i + j + k) for i in range(min(k, n - j - k))
                             if (i + j) // (2 * p) == (i + j + k) // (2 * p))
            k //= 2
        p *= 2
    return tuple(pairs)


def _network_trimmed(deltas: np.ndarray, k: int, out: np.ndarray) -> None:
    """The trimmed mean of few updates: a block of coordinates (n contiguous rows) goes through the sorting
    network, each compare-exchange an elementwise min and max over the block, with no transposition."""
    n, p = deltas.shape
    pairs = sorting_network(n)
    low = np.empty(min(p, NETWORK_BLOCK), dtype=deltas.dtype)
    for start in range(0, p, NETWORK_BLOCK):
        block = np.array(deltas[:, start:start + NETWORK_BLOCK])
        scratch = low[:block.shape[1]]
        for i, j in pairs:
            np.minimum(block[i], block[j], out=scratch)
            np.maximum(block[i], block[j], out=block[j])
            block[i] = scratch
        out[start:start + NETWORK_BLOCK] = block[k:n - k].sum(axis=0, dtype=np.float64) / (n - 2 * k)


def kept_shares(deltas: np.ndarray, k: int) -> np.ndarray:
    """Each update's share of the trimmed mean, averaged over coordinates: 1/(n − 2k) where its value is among
    those kept (ties at an edge share it), 0 where it was dropped. A statistic for the close's report, so it is
    measured on at most SHARE_SAMPLE coordinates evenly spread (every one for smaller models), which costs a
    fraction of the sort above."""
    n, p = deltas.shape
    if p == 0:
        return np.full(n, 1.0 / n)
    stride = -(-p // SHARE_SAMPLE)
    sample = np.ascontiguousarray(deltas[:, ::stride].T)
    ordered = np.sort(sample, axis=1)
    inside = (sample >= ordered[:, k:k + 1]) & (sample <= ordered[:, n - k - 1:n - k])
    return np.asarray((inside / inside.sum(axis=1, keepdims=True)).mean(axis=0))


@ROBUST.register("median")
class Median(RuleBase, MedianParams):
    """The coordinate-wise median."""

    def combine_rows(self, problem: RobustInput) -> RobustResult:
        """Per coordinate, the middle value (the mean of the two middle ones for an even n)."""
        d = problem.deltas
        n = d.shape[0]
        delta, kept = trimmed(d, (n - 1) // 2)
        return RobustResult(delta, kept, uniform(n))


@ROBUST.register("trimmed_mean")
class TrimmedMean(RuleBase, TrimmedMeanParams):
    """The coordinate-wise β-trimmed mean."""

    def trim(self, n: int) -> tuple[int, bool]:
        """k = ⌈βn⌉ values dropped per side, and whether it had to be lowered so one value is left."""
        k = math.ceil(Fraction(repr(float(self.beta))) * n)  # β as written: ⌈0.1 · 30⌉ is 3, not 4
        most = (n - 1) // 2
        return min(k, most), k > most

    def combine_rows(self, problem: RobustInput) -> RobustResult:
        """Per coordinate, the mean of the values left after dropping ⌈βn⌉ at each end."""
        d = problem.deltas
        n = d.shape[0]
        k, lowered = self.trim(n)
        delta, kept = trimmed(d, k)
        return RobustResult(delta, kept, uniform(n), {"trimmed_per_side": float(k), "trim_lowered": float(lowered)})
