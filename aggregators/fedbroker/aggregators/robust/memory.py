"""What a job keeps from one robust round to the next: the last aggregates (centered clipping's momentum, the
history check's model steps) and, per site, its last update and its history scores.

Immutable: a rule returns a new memory in its result and the service keeps it with the job only once the close
is committed, so a close that fails (and is retried) never half-moves it. Pure numpy; vectors are kept in
float32, the updates' own precision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np


@dataclass(frozen=True)
class SiteRecord:
    """One site as the history check last saw it."""

    update: np.ndarray              # its last update Δ_i (float32)
    close: int                      # the memory's `closes` when it sent it (the model it trained from)
    scores: tuple[float, ...] = ()  # its last normalised distances to the prediction, oldest first


@dataclass(frozen=True)
class RobustMemory:
    """`steps[-1]` is the last round's aggregate, w_t − w_{t−1}; `closes` counts the rounds behind `steps` since
    the job's model was installed; `sites`, `flagged` and `curvature` are the history check's."""

    closes: int = 0
    steps: tuple[np.ndarray, ...] = ()
    sites: Mapping[str, SiteRecord] = field(default_factory=dict)
    flagged: frozenset[str] = frozenset()
    curvature: tuple[tuple[np.ndarray, np.ndarray], ...] = ()  # the history check's (s_j, y_j) pairs, oldest first

    @property
    def previous(self) -> np.ndarray | None:
        """The last round's aggregate (None before the first)."""
        return self.steps[-1] if self.steps else None

    def advanced(self, delta: np.ndarray, *, keep: int) -> RobustMemory:
        """After a round whose aggregate was `delta`: it becomes `previous`, the last `keep` kept."""
        step = np.asarray(delta, dtype=np.float32).copy()
        kept = tuple(s for s in self.steps if s.shape == step.shape)  # a model of another size starts over
        return replace(self, closes=self.closes + 1, steps=(*kept, step)[-max(1, keep):])

    def displacement(self, since: int) -> np.ndarray | None:
        """w_now − w_since, the sum of the aggregates since close `since` (None when they are not all kept)."""
        gap = self.closes - since
        if gap < 0 or gap > len(self.steps):
            return None
        if gap == 0:
            return np.zeros(self.steps[-1].shape) if self.steps else None
        return np.asarray(np.sum([s.astype(np.float64) for s in self.steps[-gap:]], axis=0))


def memory_arrays(memory: RobustMemory) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    """The memory as plain named arrays and JSON metadata (the spool's `.npz` form: nothing pickled); site ids
    are in the metadata, never in an array's name."""
    arrays: dict[str, np.ndarray] = {f"step-{k}": s for k, s in enumerate(memory.steps)}
    for k, (s, y) in enumerate(memory.curvature):
        arrays[f"pair-s-{k}"], arrays[f"pair-y-{k}"] = s, y
    ids = sorted(memory.sites)
    for k, site in enumerate(ids):
        arrays[f"site-{k}"] = memory.sites[site].update
    meta: dict[str, object] = {
        "closes": memory.closes, "steps": len(memory.steps), "pairs": len(memory.curvature),
        "sites": [[site, memory.sites[site].close, list(memory.sites[site].scores)] for site in ids],
        "flagged": sorted(memory.flagged)}
    return arrays, meta


def memory_from_arrays(arrays: Mapping[str, np.ndarray], meta: Mapping[str, object]) -> RobustMemory:
    """`memory_arrays` read back; a KeyError or ValueError when the file is not one."""
    steps = tuple(np.asarray(arrays[f"step-{k}"], dtype=np.float32) for k in range(_count(meta, "steps")))
    curvature = tuple((np.asarray(arrays[f"pair-s-{k}"], dtype=np.float32),
                       np.asarray(arrays[f"pair-y-{k}"], dtype=np.float32)) for k in range(_count(meta, "pairs")))
    rows = meta["sites"]
    if not isinstance(rows, list):
        raise ValueError("the kept robust memory's sites are not a list")
    sites = {str(site): SiteRecord(np.asarray(arrays[f"site-{k}"], dtype=np.float32), int(close),
                                   tuple(float(x) for x in scores))
             for k, (site, close, scores) in enumerate(rows)}
    flagged = meta["flagged"]
    if not isinstance(flagged, list):
        raise ValueError("the kept robust memory's flagged sites are not a list")
    return RobustMemory(_count(meta, "closes"), steps, sites, frozenset(str(s) for s in flagged), curvature)


def _count(meta: Mapping[str, object], key: str) -> int:
    value = meta[key]
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"the kept robust memory's {key} is not a count: {value!r}")
    return value
