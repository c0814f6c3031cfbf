"""The selections that need no model arithmetic: everyone, or m at random."""

from __future__ import annotations

from fedbroker.aggregators.selection.base import (
    SELECTION,
    ProbeRequest,
    Selection,
    SelectionInput,
    random_choice,
)
from fedbroker.algorithms.params import AllParams, RandomParams

_NO_SEARCH = {"ga_ran": 0.0, "fallback": 0.0}  # the stats every choice reports (no GA ran, none fell back)


class _ReadsNoModel:
    """A selection that chooses by ids alone: it reads no parameters and no probe set."""

    def needs_vectors(self, round_index: int) -> bool:
        """No parameters are read."""
        return False

    def probe_request(self, round_index: int) -> ProbeRequest | None:
        """No probe set."""
        return None


@SELECTION.register("all")
class AllSelection(_ReadsNoModel, AllParams):
    """Aggregate every received update (plain FedAvg)."""

    def choose(self, problem: SelectionInput) -> Selection:
        """Every candidate."""
        return Selection(chosen=[c.worker_id for c in problem.candidates], stats=dict(_NO_SEARCH))


@SELECTION.register("random")
class RandomSelection(_ReadsNoModel, RandomParams):
    """m updates uniformly at random (the usual FL client sampling, applied after training)."""

    def choose(self, problem: SelectionInput) -> Selection:
        """m candidates drawn with the problem's `rng`."""
        return Selection(chosen=random_choice(problem.candidates, self.m, problem.rng), stats=dict(_NO_SEARCH))
