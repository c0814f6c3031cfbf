"""Which accepted update lives in which row: a round's running mean, or its store of kept updates.

An upload is received straight into a free row when its tensors come in the model's order, so accepting
it copies nothing; a refused upload (or one that lost a race to a retry of itself) gives its row back.
The book calls everything here under its lock.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedbroker.aggregators.mean import ROWS, Layout, RunningWeightedMean, Slot, UpdateRows


class Rows:
    """A round's rows. FedAvg-style rounds fold each update into a running weighted mean (memory O(model));
    rounds whose selection or alignment needs every update keep one row per update until the close."""

    def __init__(self, layout: Layout, *, incremental: bool, weights_positive: bool,
                 spare: UpdateRows | None = None) -> None:
        self.layout = layout
        self.mean = RunningWeightedMean(layout, rows=spare) if incremental else None
        # the unweighted mean, while every weight so far is 0 (then Σw = 0 falls back to it)
        self.plain_mean = RunningWeightedMean(layout) if incremental and not weights_positive else None
        self.kept = None if incremental else UpdateRows(layout.size, per_block=ROWS)

    def reserve(self, names: Sequence[str]) -> Reservation | None:
        """A free row to receive an upload of tensors `names` into; None to receive it apart (then copied)."""
        if sys.byteorder != "little" or list(names) != list(self.layout.shapes):
            return None  # tensors in another order: received apart and copied into a row on acceptance
        slot = self.mean.reserve(self.layout) if self.mean is not None else self.kept.take() if self.kept else None
        return Reservation(self, slot) if slot is not None else None

    def release(self, slot: Slot) -> None:
        """Give back the row of an upload that was refused (or lost a race to a retry of itself)."""
        if self.mean is not None:
            self.mean.release(slot)
        elif self.kept is not None:
            self.kept.give_back(slot)

    def add(self, tensors: Mapping[str, np.ndarray], raw_weight: float, slot: Slot | None) -> Slot | None:
        """Count an accepted update; `slot` is the row it was received into, if any.

        Returns the row that holds it when the round keeps every update (None for a running mean).
        """
        if self.mean is not None:
            if self.plain_mean is not None:
                self.plain_mean.add(tensors, 1.0)  # copies: `slot` belongs to the weighted mean
            self.mean.add(tensors, raw_weight, slot=slot)
            if raw_weight > 0:  # Σw > 0 from now on: the unweighted fallback can no longer be needed
                self.plain_mean = None
            return None
        assert self.kept is not None
        if slot is None:  # restored from the spool, or sent in another tensor order: copy into a row
            slot = self.kept.take()
            assert slot is not None  # the store grows as needed
            self.layout.write(tensors, slot.values)
        return slot

    def spare(self) -> UpdateRows | None:
        """The running mean's rows, for the next round to receive into (memory already mapped)."""
        return self.mean.rows if self.mean is not None else None


@dataclass
class Reservation:
    """The row an upload is being received into, and whether its acceptance took it."""

    rows: Rows
    slot: Slot
    used: bool = False

    def take(self, rows: Rows) -> Slot | None:
        """The reserved row for the acceptance into `rows`; None when it belongs to other rows (a new round)."""
        if rows is not self.rows:
            return None
        self.used = True
        return self.slot

    def release_unused(self) -> None:
        """Give the row back if the upload was refused before it was counted."""
        if not self.used:
            self.rows.release(self.slot)
