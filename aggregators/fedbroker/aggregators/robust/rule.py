"""What every robust rule shares (`RuleBase`): the pre-mix before its own arithmetic, kept weights reported on
the original sites, and the job's memory moved on by the round's aggregate."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import replace
from typing import cast

from fedbroker.aggregators.robust.base import RobustInput, RobustResult, RootRequest
from fedbroker.aggregators.robust.memory import RobustMemory
from fedbroker.aggregators.robust.premix import premixed
from fedbroker.algorithms.robust_params import RobustParams


class RuleBase(ABC):
    """What every rule shares: no root set unless it asks, the pre-mix (`premix`) before its own arithmetic
    (`combine_rows`), kept weights reported on the original sites, and the job's memory moved on by the round's
    aggregate."""

    def root_request(self) -> RootRequest | None:
        """No root set."""
        return None

    @property
    def memory_steps(self) -> int:
        """How many past aggregates the job keeps (centered clipping's momentum needs the last one)."""
        return 1

    def aggregate(self, problem: RobustInput) -> RobustResult:
        """The pre-mix, the rule, and the job's memory after this round."""
        params = cast(RobustParams, self)
        result = premixed(self.combine_rows, problem, premix=params.premix, bucket_size=params.bucket_size,
                          nnm_f=params.nnm_f)
        memory = result.memory if result.memory is not None else (problem.memory or RobustMemory())
        return replace(result, memory=memory.advanced(result.delta, keep=self.memory_steps))

    @abstractmethod
    def combine_rows(self, problem: RobustInput) -> RobustResult:
        """The rule's own aggregate of the (possibly pre-mixed) rows."""
