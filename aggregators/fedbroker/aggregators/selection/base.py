"""The selection interface: of the N updates received this round, which ones to aggregate."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from fedbroker.aggregators.registry import Registry
from fedbroker.aggregators.selection.probe import Probe


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


@dataclass(frozen=True)
class ProbeRequest:
    """The probe set a selector needs the service to load: a named data set, how many samples, which."""

    dataset: str
    size: int
    seed: int


class Selector(Protocol):
    def needs_vectors(self, round_index: int) -> bool: ...

    def probe_request(self, round_index: int) -> ProbeRequest | None:
        """The probe set this round's choice evaluates models on (None: it needs none)."""

    def choose(
        self,
        candidates: Sequence[Candidate],
        *,
        round_index: int,
        global_vector: np.ndarray,
        rng: np.random.Generator,
        deadline: float | None = None,
        probe: Probe | None = None,
    ) -> Selection: ...


SELECTION: Registry[Selector] = Registry("selection")
MAX_M = 100_000  # the most updates a round may choose: the most clients it may have (schedule.clients_per_round)


def require_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    """Raise ValueError naming the parameter unless it is an integer in [minimum, maximum] (bools are not
    counts; maximum None = unbounded, for arguments that are not job parameters)."""
    allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an integer {allowed}, got {value}")


def check_candidates(candidates: Sequence[Candidate], *, round_index: int) -> None:
    """Reject what no selector can work with: no candidates, repeated ids, negative counts, bad rounds."""
    require_int("round_index", round_index, 1)
    if len(candidates) == 0:
        raise ValueError("selection needs at least one candidate update")
    seen: set[str] = set()
    for c in candidates:
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
