"""The selection interface: of the N updates received this round, which ones to aggregate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from fedbroker.aggregators.registry import Registry
from fedbroker.aggregators.selection.probe import Probe
from fedbroker.algorithms.catalogue import SELECTIONS
from fedbroker.algorithms.params import require_int
from fedbroker.close_report import SelectionRecord


@dataclass(frozen=True)
class Candidate:
    """One received update, as the selector sees it."""

    worker_id: str
    vector: np.ndarray
    num_samples: int
    reported_loss: float | None = None
    raw_weight: float = 1.0     # the job's weighting's raw weight of this update (for candidate aggregates)


@dataclass(frozen=True)
class Selection:
    """The chosen worker ids (in candidate order), numbers for metrics, and why a fallback happened."""

    chosen: list[str]
    stats: dict[str, float] = field(default_factory=dict)
    reason: str = ""

    def record(self, *, method: str, accepted: int) -> SelectionRecord:
        """The close report's record of this choice by the selection `method` among `accepted` updates."""
        fitness = self.stats.get("fitness")
        return SelectionRecord(method=method, accepted=accepted, chosen=len(self.chosen),
                               ga_round=bool(self.stats.get("ga_round", 0.0)), ga_ran=bool(self.stats.get("ga_ran", 0.0)),
                               fallback=bool(self.stats.get("fallback", 0.0)),
                               fitness=None if fitness is None else float(fitness))


@dataclass(frozen=True)
class ProbeRequest:
    """The probe set a selector needs the service to load: a named data set, how many samples, which."""

    dataset: str
    size: int
    seed: int


class Selector(Protocol):
    """What the service calls; every registered selection extends its parameters' frozen kw-only dataclass
    (`fedbroker.algorithms.params`)."""

    def needs_vectors(self, round_index: int) -> bool:
        """Whether this round's choice reads the updates' parameters (else they need not be flattened)."""

    def probe_request(self, round_index: int) -> ProbeRequest | None:
        """The probe set this round's choice evaluates models on (None: it needs none)."""

    def choose(self, problem: SelectionInput) -> Selection:
        """The ids of the updates to aggregate, in candidate order, seeded by the problem's `rng`."""


SELECTION: Registry[Selector] = Registry(SELECTIONS)


@dataclass(frozen=True)
class SelectionInput:
    """One round's selection problem, as one object so every selector takes one argument; built only past the
    checks no selector can work without (candidates, distinct ids, counts >= 0, a round >= 1).

    `global_vector`: the current global model flattened (empty when `needs_vectors` said no). `deadline` (a
    time.monotonic() value) bounds a search such as the GA's; `probe` is the service's probe set when
    `probe_request` asked for one.
    """

    candidates: Sequence[Candidate]
    round_index: int
    global_vector: np.ndarray
    rng: np.random.Generator
    deadline: float | None = None
    probe: Probe | None = None

    def __post_init__(self) -> None:
        require_int("round_index", self.round_index, 1)
        if len(self.candidates) == 0:
            raise ValueError("selection needs at least one candidate update")
        seen: set[str] = set()
        for c in self.candidates:
            if c.worker_id in seen:
                raise ValueError(f"worker {c.worker_id!r} appears more than once among the candidates")
            seen.add(c.worker_id)
            n = c.num_samples
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
                raise ValueError(f"worker {c.worker_id!r}: num_samples must be an integer >= 0, got {n!r}")


def random_choice(candidates: Sequence[Candidate], m: int, rng: np.random.Generator) -> list[str]:
    """m distinct candidates drawn uniformly (all of them when m >= N), listed in candidate order."""
    n = len(candidates)
    if m >= n:
        return [c.worker_id for c in candidates]
    picked = np.sort(rng.choice(n, size=m, replace=False))
    return [candidates[int(i)].worker_id for i in picked]
