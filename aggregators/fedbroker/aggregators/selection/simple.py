"""The selections that need no model arithmetic: everyone, or m at random."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedbroker.aggregators.selection.base import (
    SELECTION,
    Candidate,
    ProbeRequest,
    Selection,
    check_candidates,
    random_choice,
)
from fedbroker.aggregators.selection.probe import Probe
from fedbroker.algorithm_params import AllParams, RandomParams


@SELECTION.register("all")
class AllSelection(AllParams):
    """Aggregate every received update (plain FedAvg)."""

    def needs_vectors(self, round_index: int) -> bool:
        """No parameters are read."""
        return False

    def probe_request(self, round_index: int) -> ProbeRequest | None:
        """No probe set."""
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
        """Every candidate."""
        check_candidates(candidates, round_index=round_index)
        return Selection(chosen=[c.worker_id for c in candidates], stats={"ga_ran": 0.0, "fallback": 0.0})


@SELECTION.register("random")
class RandomSelection(RandomParams):
    """m updates uniformly at random (the usual FL client sampling, applied after training)."""

    def needs_vectors(self, round_index: int) -> bool:
        """No parameters are read."""
        return False

    def probe_request(self, round_index: int) -> ProbeRequest | None:
        """No probe set."""
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
        """m candidates drawn with `rng`."""
        check_candidates(candidates, round_index=round_index)
        return Selection(chosen=random_choice(candidates, self.m, rng), stats={"ga_ran": 0.0, "fallback": 0.0})
