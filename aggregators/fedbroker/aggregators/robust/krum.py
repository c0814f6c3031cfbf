"""Multi-Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, NeurIPS 2017).

Each update's score is the sum of its squared distances to its n − f − 2 nearest other updates; the m
lowest-scoring updates are averaged (with the job's weights, renormalised over them: Multi-Krum's plain
average when the weighting is uniform). With n ≥ 2f + 3 and f attackers, an update that scores lowest is
close to a crowd of honest ones, so a far-off attacker is never chosen. All n² distances come from one Gram
matrix D Dᵀ (summed in float64), so the cost is one pass over the updates plus O(n² log n).
"""

from __future__ import annotations

import numpy as np

from fedbroker.aggregators.robust.base import (
    ROBUST,
    RobustInput,
    RobustResult,
    combination,
    gram,
    squared_distances,
)
from fedbroker.aggregators.robust.rule import RuleBase
from fedbroker.algorithms.robust_params import MultiKrumParams


def krum_scores(distances: np.ndarray, neighbours: int) -> np.ndarray:
    """Per update, the sum of its `neighbours` smallest squared distances to the others."""
    n = distances.shape[0]
    others = distances + np.diag(np.full(n, np.inf))   # never its own distance
    nearest = np.sort(others, axis=1)[:, :neighbours]
    return np.asarray(nearest.sum(axis=1))


@ROBUST.register("multi_krum")
class MultiKrum(RuleBase, MultiKrumParams):
    """The average of the m updates with the lowest Krum scores."""

    def sizes(self, n: int) -> tuple[int, int, bool]:
        """(neighbours n − f − 2, m, whether n < 2f + 3 so the guarantee does not hold), each at least 1."""
        neighbours = max(1, min(n - 1, n - self.f - 2))
        m = self.m if self.m is not None else n - self.f
        return neighbours, max(1, min(n, m)), n < 2 * self.f + 3

    def combine_rows(self, problem: RobustInput) -> RobustResult:
        """The m lowest-scoring updates' weighted mean (ties broken by position: no randomness)."""
        d, w = problem.deltas, problem.weights
        n = d.shape[0]
        neighbours, m, undersized = self.sizes(n)
        scores = krum_scores(squared_distances(gram(d)), neighbours) if n > 1 else np.zeros(1)
        chosen = np.sort(np.argsort(scores, kind="stable")[:m])
        kept = np.zeros(n)
        total = w[chosen].sum()
        kept[chosen] = w[chosen] / total if total > 0 else 1.0 / m
        notes = {"krum_averaged": float(m), "krum_undersized": float(undersized),
                 "krum_best_score": float(scores[chosen].min()) if n > 1 else 0.0}
        return RobustResult(combination(d, kept), kept, w, notes)
