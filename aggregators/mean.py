"""Weighted means of model updates, in cache-sized blocks, with float64 sums across groups of updates.

Arithmetic: each product w·x is formed in float32 (models travel as float32) and summed in float32
over a group of at most `GROUP` updates; the group sums are added in float64. The error is therefore
at most about (GROUP + 1)·2⁻²⁴ of Σ|w·x| whatever the number of updates, where a pure float32 sum (as
in Flower's `aggregate`) grows with K, and numpy runs float32 kernels two to three times faster than
the float32→float64 casts a float64-per-update mean needs (`make bench` measures both).

Speed: `group += w·x` is a numpy multiply into a cache-sized scratch block and an in-place add; folding
a group into float64 and the final division are single numpy passes that cast in numpy's small internal
buffers. (BLAS `saxpy` does the update in one pass, but OpenBLAS runs it threaded above 10,000 values
and that collapses when the cores are busy: 8 ms instead of 0.1 ms per million values, measured here.)

Memory: the incremental mean holds a float64 accumulator and one float32 group sum per tensor
(3 × the model) and nothing model-sized besides. The in-memory mean reads each update once: it sums
one block of every update while that block's accumulator is still in cache.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

# 32 Ki values: a block's float64 accumulator, float32 group sum and float32 product (512 KiB) fit the
# L2 cache of current x86 cores; bench/averaging.py measured 2^14-2^16 within a few percent.
BLOCK = 1 << 15
# Updates summed in float32 before their sum is added in float64 (bounds the float32 rounding error).
GROUP = 8


class RunningWeightedMean:
    """Σ w_k·x_k and Σ w_k, one update at a time: memory O(model), independent of the number of workers."""

    def __init__(self) -> None:
        self._sums: dict[str, np.ndarray] = {}     # float64, flat: the groups already folded
        self._group: dict[str, np.ndarray] = {}    # float32, flat: Σ w·x of the current group
        self._in_group = 0
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._product = np.empty(0, dtype=np.float32)  # one block of w·x
        self.total_weight = 0.0
        self.count = 0

    def add(self, tensors: Mapping[str, np.ndarray], weight: float) -> None:
        if not self._sums:
            for name, arr in tensors.items():
                self._shapes[name] = tuple(np.shape(arr))
                self._sums[name] = np.zeros(int(np.prod(self._shapes[name], dtype=np.int64)), dtype=np.float64)
                self._group[name] = np.empty_like(self._sums[name], dtype=np.float32)
        flats = {name: np.asarray(arr).reshape(-1) for name, arr in tensors.items()}
        for name, x in flats.items():  # check every tensor before touching the sums
            if name not in self._group or x.size != self._group[name].size:
                raise ValueError(f"tensor {name!r} does not match the tensors this mean holds")
        w = np.float32(weight)
        first = self._in_group == 0
        for name, x in flats.items():
            group = self._group[name]
            if first:
                np.multiply(x, w, out=group, casting="same_kind")
            else:
                _axpy(group, x, w, self._scratch())
        self._in_group += 1
        if self._in_group == GROUP:
            self._fold()
        self.total_weight += float(weight)
        self.count += 1

    def _fold(self) -> None:
        """Add the current group's float32 sum into the float64 sums (numpy casts in small buffers)."""
        for name, acc in self._sums.items():
            np.add(acc, self._group[name], out=acc)
        self._in_group = 0

    def _scratch(self) -> np.ndarray:
        if self._product.size == 0:
            self._product = np.empty(BLOCK, dtype=np.float32)
        return self._product

    def result(self, dtype: np.dtype = np.dtype(np.float32)) -> dict[str, np.ndarray]:
        if self.count == 0 or self.total_weight <= 0:
            raise ValueError("no positively weighted update to average")
        if self._in_group:
            self._fold()
        out: dict[str, np.ndarray] = {}
        for name, acc in self._sums.items():
            result = np.empty(acc.size, dtype=dtype)
            np.divide(acc, self.total_weight, out=result, casting="same_kind")
            out[name] = result.reshape(self._shapes[name])
        return out


def _axpy(group: np.ndarray, x: np.ndarray, w: np.float32, scratch: np.ndarray) -> None:
    """group += w·x in float32, in place, one cache-sized block at a time (no model-sized temporary)."""
    for start in range(0, x.size, BLOCK):
        stop = min(start + BLOCK, x.size)
        product = scratch[: stop - start]
        np.multiply(x[start:stop], w, out=product, casting="same_kind")
        block = group[start:stop]
        np.add(block, product, out=block)


def weighted_mean(updates: Sequence[Mapping[str, np.ndarray]],
                  weights: Sequence[float] | np.ndarray) -> dict[str, np.ndarray]:
    """The same mean over updates held in memory (selection and alignment need them all).

    Block by block across all updates, so each update is read once and nothing model-sized is
    allocated but the result.
    """
    pairs = [(update, float(weight)) for update, weight in zip(updates, weights)]
    total = sum(weight for _, weight in pairs)
    if not pairs or total <= 0:
        raise ValueError("no positively weighted update to average")
    names = list(pairs[0][0])
    for update, _ in pairs[1:]:
        if sorted(update) != sorted(names):
            raise ValueError(f"updates hold different tensors: {sorted(update)} and {sorted(names)}")
    ws = [np.float32(weight) for _, weight in pairs]
    acc = np.empty(BLOCK, dtype=np.float64)
    group = np.empty(BLOCK, dtype=np.float32)
    product = np.empty(BLOCK, dtype=np.float32)
    out: dict[str, np.ndarray] = {}
    for name in names:
        shape = tuple(np.shape(pairs[0][0][name]))
        flats = [np.asarray(update[name]).reshape(-1) for update, _ in pairs]
        size = flats[0].size
        if any(f.size != size for f in flats):
            raise ValueError(f"tensor {name!r} has different sizes across updates")
        result = np.empty(size, dtype=np.float32)
        for start in range(0, size, BLOCK):
            stop = min(start + BLOCK, size)
            a, g, p = acc[: stop - start], group[: stop - start], product[: stop - start]
            a.fill(0.0)
            for first in range(0, len(flats), GROUP):
                np.multiply(flats[first][start:stop], ws[first], out=g, casting="same_kind")
                for k in range(first + 1, min(first + GROUP, len(flats))):
                    _axpy(g, flats[k][start:stop], ws[k], p)
                np.add(a, g, out=a)
            np.divide(a, total, out=a)
            result[start:stop] = a
        out[name] = result.reshape(shape)
    return out
