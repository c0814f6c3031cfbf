"""The geometric median by smoothed Weiszfeld iterations (Pillutla, Kakade, Harchaoui, RFA, IEEE TSP 2022).

The weighted geometric median z minimises Σ_i α_i ‖z − Δ_i‖ (α: the job's weights). Weiszfeld's step
z ← Σ β_i Δ_i / Σ β_i with β_i = α_i / max(ν, ‖z − Δ_i‖) decreases it; ν > 0 (the smoothing) keeps a step
defined when z reaches an update. Less than half the total weight, however far off, cannot move z far; from
the weighted mean, the iterations approach the honest majority geometrically (more slowly the closer the
outliers' weight is to half).

Every z of the iterations is a combination Σ c_j Δ_j of the updates, so ‖z − Δ_i‖² = cᵀGc − 2(Gc)_i + G_ii
from one Gram matrix G = D Dᵀ: the iterations cost O(n²) each, and the updates are read twice in all (G,
then the final combination).
"""

from __future__ import annotations

import numpy as np

from fedbroker.aggregators.robust.base import ROBUST, RobustInput, RobustResult, combination, gram
from fedbroker.aggregators.robust.rule import RuleBase
from fedbroker.algorithms.robust_params import GeometricMedianParams


def weiszfeld(g: np.ndarray, alpha: np.ndarray, *, iterations: int, nu: float,
              tolerance: float) -> tuple[np.ndarray, int, float]:
    """(coefficients c of z = Σ c_j Δ_j, iterations run, the objective Σ α_i ‖z − Δ_i‖) from the Gram matrix,
    starting at the weighted mean. It stops once a step moves z by at most `tolerance` times the weighted
    median of the distances to z: a scale the honest majority sets, however far the outliers are (a relative
    change of the objective, which far outliers dominate, would stop it while z is still on its way)."""
    diag = np.diag(g)

    def distances(c: np.ndarray) -> np.ndarray:
        gc = g @ c
        return np.asarray(np.sqrt(np.maximum(float(c @ gc) - 2.0 * gc + diag, 0.0)))

    c = alpha.copy()
    ran = 0
    while ran < iterations:
        ran += 1
        dist = distances(c)
        beta = alpha / np.maximum(nu, dist)
        step, c = c, beta / beta.sum()
        step = step - c
        moved = float(np.sqrt(max(float(step @ g @ step), 0.0)))
        if moved <= tolerance * max(weighted_median(dist, alpha), nu):
            break
    return c, ran, float(alpha @ distances(c))


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The smallest value whose cumulative weight (in sorted order) reaches half the total."""
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, 0.5 * cumulative[-1])])


@ROBUST.register("geometric_median")
class GeometricMedian(RuleBase, GeometricMedianParams):
    """RFA's robust aggregate: the smoothed weighted geometric median."""

    def combine_rows(self, problem: RobustInput) -> RobustResult:
        """z after at most `iterations` Weiszfeld steps (fewer once a step stops moving it)."""
        d, w = problem.deltas, problem.weights
        c, ran, objective = weiszfeld(gram(d), w, iterations=self.iterations, nu=self.nu, tolerance=self.tolerance)
        return RobustResult(combination(d, c), c, w, {"weiszfeld_iterations": float(ran),
                                                      "weiszfeld_objective": objective})
