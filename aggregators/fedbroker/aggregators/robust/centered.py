"""Centered clipping (Karimireddy, He, Jaggi, "Learning from History for Byzantine Robust Optimization", ICML
2021).

From a centre v, every update's difference Δ_i − v is clipped to norm τ and the centre moves by their weighted
mean: v ← v + Σ w_i (Δ_i − v)·min(1, τ/‖Δ_i − v‖), `iterations` times (one, as the paper's analysis uses).
The centre starts from the last round's aggregate, kept in the job's memory: the paper's momentum, which makes
honest updates close to v and leaves an attacker only τ of pull per round, wherever it puts its update. With
f < n/2 attackers of total weight φ and τ at least every honest update's distance to v,
‖v' − μ_H‖ ≤ φ·(‖v − μ_H‖ + τ) (μ_H the honest updates' weighted mean).

τ is the job's `tau`, or `tau_scale` × the median of ‖Δ_i − v‖ this round: fewer than half the updates cannot
move that median past the honest distances, so attackers cannot widen their own clip, and the scale follows the
updates' size as training goes (the paper fixes τ by hand per task).
"""

from __future__ import annotations

import numpy as np

from fedbroker.aggregators.robust.base import ROBUST, RobustInput, RobustResult, combination
from fedbroker.aggregators.robust.rule import RuleBase
from fedbroker.algorithms.robust_params import CenteredClippingParams


def distances_to(deltas: np.ndarray, centre: np.ndarray, *, chunk: int = 1 << 16) -> np.ndarray:
    """‖Δ_i − v‖ for every row, in float64 a column block at a time (no cancellation of ‖Δ‖² − 2Δ·v + ‖v‖²)."""
    out = np.zeros(deltas.shape[0])
    for start in range(0, deltas.shape[1], chunk):
        block = deltas[:, start:start + chunk].astype(np.float64) - centre[start:start + chunk]
        out += np.einsum("ij,ij->i", block, block)
    return np.asarray(np.sqrt(out))


@ROBUST.register("centered_clipping")
class CenteredClipping(RuleBase, CenteredClippingParams):
    """Clipped steps from the last round's aggregate."""

    def start(self, problem: RobustInput) -> tuple[np.ndarray, bool]:
        """The centre v_0: the last round's aggregate when the job kept one of this size, else zero."""
        previous = problem.memory.previous if problem.memory is not None else None
        if previous is not None and previous.shape == (problem.deltas.shape[1],):
            return previous.astype(np.float64), True
        return np.zeros(problem.deltas.shape[1]), False

    def combine_rows(self, problem: RobustInput) -> RobustResult:
        """v after `iterations` clipped steps; kept weight w_i·min(1, τ/‖Δ_i − v‖) of the last step."""
        d, w = problem.deltas, problem.weights
        v, momentum = self.start(problem)
        kept, tau = w, 0.0
        for _ in range(self.iterations):
            dist = distances_to(d, v)
            tau = float(self.tau) if self.tau is not None else float(self.tau_scale * np.median(dist))
            scale = np.minimum(1.0, np.divide(tau, dist, out=np.ones_like(dist), where=dist > 0))
            kept = w * scale
            v = v * (1.0 - kept.sum()) + combination(d, kept)
        notes = {"cc_tau": tau, "cc_clipped": float(np.sum(kept < w * (1 - 1e-12))), "cc_momentum": float(momentum)}
        return RobustResult(v, kept, w, notes)
