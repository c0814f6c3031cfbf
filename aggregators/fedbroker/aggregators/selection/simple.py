"""The selections that need no model arithmetic: everyone, or m at random."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedbroker.aggregators.selection.base import (
    MAX_M,
    SELECTION,
    Candidate,
    ProbeRequest,
    Selection,
    check_candidates,
    random_choice,
    require_int,
)
from fedbroker.aggregators.selection.probe import Probe


@SELECTION.register("all")
@dataclass(frozen=True, kw_only=True)
class AllSelection:
    """Aggregate every received update (plain FedAvg)."""

    def needs_vectors(self, round_index: int) -> bool:
        return False

    def probe_request(self, round_index: int) -> ProbeRequest | None:
        return None

    def choose(
        self,
        candidates: Sequence[Candidate],
        *,
        round_index: int,
        global_vector: np.ndarray,
        rng: np.random.Generator,
        deadline: float | None = None,
        probe: Probe | None = None,
    ) -> Selection:
        check_candidates(candidates, round_index=round_index)
        return Selection(chosen=[c.worker_id for c in candidates], stats={"ga_ran": 0.0, "fallback": 0.0})


@SELECTION.register("random")
@dataclass(frozen=True, kw_only=True)
class RandomSelection:
    """m updates uniformly at random (the usual FL client sampling, applied after training)."""

    m: int

    def __post_init__(self) -> None:
        require_int("m", self.m, 1, MAX_M)  # the most clients a round may have

    def needs_vectors(self, round_index: int) -> bool:
        return False

    def probe_request(self, round_index: int) -> ProbeRequest | None:
        return None

    def choose(
        self,
        candidates: Sequence[Candidate],
        *,
        round_index: int,
        global_vector: np.ndarray,
        rng: np.random.Generator,
        deadline: float | None = None,
        probe: Probe | None = None,
    ) -> Selection:
        check_candidates(candidates, round_index=round_index)
        return Selection(chosen=random_choice(candidates, self.m, rng), stats={"ga_ran": 0.0, "fallback": 0.0})
