"""Weighted means of model updates: one BLAS pass over updates held as rows of a float32 matrix.

Why rows: Σ w_k·x_k over K separate arrays costs numpy a multiply and an add per update, a third of
the speed of reading the updates once. With the updates as rows of one matrix X the sum is a single
sgemv, y ← α·Xᵀw + β·y, which reads each update once at the speed of a plain streaming read (`make
bench`). So the aggregation service receives each upload straight into a free row (`reserve`): the
running mean folds its rows when all are taken; rounds that need every update (selection, alignment)
keep theirs in `UpdateRows` and take the mean at the close (`weighted_mean_of_rows`).

Arithmetic: the products and the sum of one fold are float32 (sgemv, one BLAS thread: OpenBLAS's
threads collapse when the cores are busy), the running sum is float32 and is added into a float64 sum
every FLUSH folds. The rounding error stays below about (ROWS + FLUSH + 2)·2⁻²⁴ of Σ|w·x|/Σw however
many updates arrive, where a pure float32 sum (Flower's `aggregate`) grows with their number.

Memory: the rows (at most ROWS, within `buffer_bytes`, at least one), one float32 sum, and a float64
sum once more than ROWS·FLUSH updates arrived: independent of the number of workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.linalg import blas
from threadpoolctl import ThreadpoolController

ROWS = 32                  # updates that wait in a running mean's rows before they are folded
BUFFER_BYTES = 512 << 20   # a running mean's rows take at most this much (but always one row)
FLUSH = 8                  # folds summed in float32 before the running sum is added into float64

_blas_threads = ThreadpoolController()


class Layout:
    """Where each tensor of a flat update row lives: names in order, shapes, offsets."""

    def __init__(self, shapes: Mapping[str, Sequence[int]]) -> None:
        self.shapes = {name: tuple(int(d) for d in shape) for name, shape in shapes.items()}
        self.offsets: dict[str, tuple[int, int]] = {}
        size = 0
        for name, shape in self.shapes.items():
            count = int(np.prod(shape, dtype=np.int64))
            self.offsets[name] = (size, size + count)
            size += count
        self.size = size

    @classmethod
    def of(cls, tensors: Mapping[str, np.ndarray]) -> Layout:
        """The layout of one update's tensors, in their order."""
        return cls({name: np.shape(arr) for name, arr in tensors.items()})

    def check(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Refuse an update of other tensors than the layout's."""
        if list(tensors) != list(self.shapes) and sorted(tensors) != sorted(self.shapes):
            raise ValueError(f"updates hold different tensors: {sorted(tensors)} and {sorted(self.shapes)}")
        for name, arr in tensors.items():
            start, stop = self.offsets[name]
            if np.size(arr) != stop - start:
                raise ValueError(f"tensor {name!r} does not match the tensors this mean holds (different sizes)")

    def write(self, tensors: Mapping[str, np.ndarray], row: np.ndarray) -> None:
        """Copy an update into a row (after `check`)."""
        for name, arr in tensors.items():
            start, stop = self.offsets[name]
            row[start:stop] = np.asarray(arr).reshape(-1)

    def views(self, row: np.ndarray) -> dict[str, np.ndarray]:
        """The tensors of a row, as views (no copy)."""
        return {name: row[start:stop].reshape(self.shapes[name]) for name, (start, stop) in self.offsets.items()}


@dataclass(frozen=True)
class Slot:
    """One row of an `UpdateRows`: `values` is the flat float32 update, `bytes` the same memory to receive into."""

    block: int
    index: int
    values: np.ndarray

    @property
    def bytes(self) -> np.ndarray:
        """The row's raw bytes, for receiving an upload straight into it."""
        return self.values.view(np.uint8)


class UpdateRows:
    """Rows of float32 matrices (`per_block` rows each, allocated as needed) that updates are received into.

    A row is taken before an upload is read and given back if the upload is refused, so several uploads
    may stream at once. Pages of a block are only backed by memory once a row is written.
    """

    def __init__(self, size: int, *, per_block: int, max_blocks: int | None = None) -> None:
        self.size = size
        self.per_block = per_block
        self.max_blocks = max_blocks
        self.blocks: list[np.ndarray] = []
        self._free: list[tuple[int, int]] = []

    def take(self) -> Slot | None:
        """A free row (None when the rows are at their limit)."""
        if not self._free:
            if self.max_blocks is not None and len(self.blocks) >= self.max_blocks:
                return None
            self.blocks.append(np.empty((self.per_block, self.size), dtype=np.float32))
            b = len(self.blocks) - 1
            self._free = [(b, i) for i in reversed(range(self.per_block))] + self._free
        b, i = self._free.pop()
        return Slot(b, i, self.blocks[b][i])

    def give_back(self, slot: Slot) -> None:
        """Return a row for reuse."""
        self._free.append((slot.block, slot.index))
        self._free.sort(reverse=True)  # lowest rows first: committed rows stay in long consecutive runs

    @property
    def free(self) -> int:
        """How many more rows may be taken."""
        return len(self._free) + (0 if self.max_blocks is None else
                                  (self.max_blocks - len(self.blocks)) * self.per_block)


class _Sum:
    """Σ w·row: float32 folds (one sgemv per run of consecutive rows) and float64 flushes."""

    def __init__(self, size: int) -> None:
        self.y = np.empty(size, dtype=np.float32)
        self.y_holds = False           # whether y holds a partial sum (else it is scratch)
        self.folds = 0                 # since the last flush
        self.wide: np.ndarray | None = None

    def fold(self, rows: UpdateRows, slots: Sequence[Slot], weights: Sequence[float], *,
             alpha: float = 1.0, beta: float = 1.0) -> None:
        """y ← alpha·Σ w·row + beta·y."""
        if rows.size == 0:  # an empty model: nothing to add (BLAS refuses empty vectors)
            self.y_holds = True
            self.folds += 1
            return
        by_block: dict[int, list[tuple[int, float]]] = {}
        for slot, weight in zip(slots, weights):
            by_block.setdefault(slot.block, []).append((slot.index, float(weight)))
        with _blas_threads.limit(limits=1, user_api="blas"):
            for b, pairs in sorted(by_block.items()):
                pairs.sort()
                start = 0
                while start < len(pairs):  # one sgemv per run of consecutive rows
                    stop = start + 1
                    while stop < len(pairs) and pairs[stop][0] == pairs[stop - 1][0] + 1:
                        stop += 1
                    first, last = pairs[start][0], pairs[stop - 1][0]
                    matrix = rows.blocks[b][first:last + 1].T   # (size × rows), Fortran order: no copy
                    row_weights = np.array([p[1] for p in pairs[start:stop]], dtype=np.float32)
                    blas.sgemv(alpha, matrix, row_weights, beta=beta if self.y_holds else 0.0, y=self.y, overwrite_y=1)
                    self.y_holds, beta = True, 1.0
                    start = stop
        self.folds += 1

    def flush(self) -> None:
        if self.y_holds:
            if self.wide is None:
                self.wide = self.y.astype(np.float64)
            else:
                np.add(self.wide, self.y, out=self.wide)
        self.y_holds = False
        self.folds = 0

    def finish(self, rows: UpdateRows, slots: Sequence[Slot], weights: Sequence[float], total: float) -> np.ndarray:
        """Fold the last rows and return the mean (Σ / total) as float32, in y itself when nothing was flushed."""
        scale = 1.0 / total
        if self.wide is None:  # the division rides on the last sgemv: no extra pass over the model
            if slots:
                self.fold(rows, slots, weights, alpha=scale, beta=scale)
            else:
                self.y *= np.float32(scale)
            return self.y
        if slots:
            self.fold(rows, slots, weights)
        self.flush()
        assert self.wide is not None
        self.y = (self.wide * scale).astype(np.float32)
        self.wide = None
        self.y_holds = True
        return self.y


class RunningWeightedMean:
    """Σ w_k·x_k / Σ w_k, one update at a time, in memory O(model) whatever the number of workers.

    `reserve` hands out a free row to receive an update into; `add(tensors, w, slot=...)` then commits it
    without a copy (`add` without a slot copies the tensors into a row). When a row is wanted and none is
    free, the waiting rows are folded in one BLAS pass (not before: the last ones fold with the division). `result` folds the rest, scaled by 1/Σw, into the running sum
    itself; an `add` after it goes on from a copy with the scaling undone (exact to float32 rounding), so
    a result already handed out never changes.
    """

    def __init__(self, layout: Layout | None = None, *, buffer_bytes: int = BUFFER_BYTES, max_rows: int = ROWS,
                 rows: UpdateRows | None = None) -> None:
        self.buffer_bytes = buffer_bytes
        self.max_rows = max_rows
        self.layout: Layout | None = None
        self._rows: UpdateRows | None = None
        self._sum: _Sum | None = None
        self._waiting: list[tuple[Slot, float]] = []
        self._result: dict[str, np.ndarray] | None = None
        self.total_weight = 0.0
        self.count = 0
        if layout is not None:
            self._start(layout, rows)

    def _start(self, layout: Layout, rows: UpdateRows | None = None) -> None:
        """`rows`: those of an earlier mean of the same model (memory already mapped: uploads fault no pages)."""
        self.layout = layout
        per_block = max(1, min(self.max_rows, self.buffer_bytes // max(4 * layout.size, 1)))
        if rows is None or rows.size != layout.size or rows.per_block != per_block or rows.max_blocks != 1:
            rows = UpdateRows(layout.size, per_block=per_block, max_blocks=1)  # allocated by the first take
        self._rows = rows
        self._sum = _Sum(layout.size)

    @property
    def rows(self) -> UpdateRows | None:
        """The rows, for the next mean of the same model once this one's result is taken."""
        return self._rows

    def reserve(self, layout: Layout) -> Slot | None:
        """A free row for an update in `layout` (None if every row is in use, or the layout differs)."""
        if self.layout is None:
            self._start(layout)
        if self.layout is None or self.layout.shapes != layout.shapes or list(self.layout.shapes) != list(layout.shapes):
            return None
        assert self._rows is not None
        if self._rows.free == 0 and self._waiting:
            self._fold()
        return self._rows.take()

    @property
    def free_rows(self) -> int:
        """How many more updates the mean's rows can receive."""
        return 0 if self._rows is None else self._rows.free

    def release(self, slot: Slot) -> None:
        """Give back a reserved row whose upload was refused."""
        assert self._rows is not None
        self._rows.give_back(slot)

    def add(self, tensors: Mapping[str, np.ndarray], weight: float, *, slot: Slot | None = None) -> None:
        """Fold in one update with `weight`; `slot` is the row it was received into, if any."""
        if self.layout is None:
            self._start(Layout.of(tensors))
        assert self.layout is not None and self._rows is not None and self._sum is not None
        if slot is None:
            self.layout.check(tensors)  # before anything changes
        self._reopen()
        if slot is None:
            if self._rows.free == 0 and self._waiting:
                self._fold()
            slot = self._rows.take()
            if slot is None:  # every row is receiving an upload: fold this one on its own
                single = UpdateRows(self.layout.size, per_block=1)
                slot = single.take()
                assert slot is not None
                self.layout.write(tensors, slot.values)
                self._sum.fold(single, [slot], [weight])
                if self._sum.folds >= FLUSH:
                    self._sum.flush()
                self._count(weight)
                return
            self.layout.write(tensors, slot.values)
        self._waiting.append((slot, float(weight)))
        self._count(weight)

    def _count(self, weight: float) -> None:
        self.total_weight += float(weight)
        self.count += 1

    def _fold(self) -> None:
        assert self._rows is not None and self._sum is not None
        slots = [s for s, _ in self._waiting]
        self._sum.fold(self._rows, slots, [w for _, w in self._waiting])
        for s in slots:
            self._rows.give_back(s)
        self._waiting = []
        if self._sum.folds >= FLUSH:
            self._sum.flush()

    def _reopen(self) -> None:
        """Undo the division into a new sum: the result handed out (maybe a served model) never changes."""
        if self._result is not None and self._sum is not None:
            self._sum.y = self._sum.y * np.float32(self.total_weight)
            self._result = None

    def result(self) -> dict[str, np.ndarray]:
        """Σ w·x / Σ w of every update added, as float32 (computed once)."""
        if self._result is not None:
            return self._result
        if self.count == 0 or self.total_weight <= 0 or self._sum is None or self.layout is None:
            raise ValueError("no positively weighted update to average")
        assert self._rows is not None
        out = self._sum.finish(self._rows, [s for s, _ in self._waiting], [w for _, w in self._waiting],
                               self.total_weight)
        for s, _ in self._waiting:
            self._rows.give_back(s)
        self._waiting = []
        self._result = self.layout.views(out)
        return self._result


def weighted_mean_of_rows(rows: UpdateRows, slots: Sequence[Slot], weights: Sequence[float] | np.ndarray,
                          layout: Layout) -> dict[str, np.ndarray]:
    """The weighted mean of updates already held as rows (selection/alignment rounds): one pass over them."""
    w = [float(x) for x in weights]
    total = sum(w)
    if not slots or total <= 0:
        raise ValueError("no positively weighted update to average")
    acc = _Sum(rows.size)
    cut = len(slots) - (len(slots) - 1) % ROWS - 1   # the last fold takes the final ≤ ROWS rows
    for start in range(0, cut, ROWS):  # ROWS per fold and a flush every FLUSH folds, as the running mean
        acc.fold(rows, slots[start:start + ROWS], w[start:start + ROWS])
        if acc.folds >= FLUSH:
            acc.flush()
    return layout.views(acc.finish(rows, slots[cut:], w[cut:], total))
