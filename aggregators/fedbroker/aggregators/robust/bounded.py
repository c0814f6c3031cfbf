"""The rules that keep the weighted mean's shape: `none` (the mean itself), norm bounding (Sun, Kairouz,
Suresh, McMahan, "Can you really backdoor federated learning?", 2019) and FLTrust (Cao, Fang, Liu, Gong,
NDSS 2021).

Norm bounding scales every update to at most M in L2 norm, Δ_i ← Δ_i · min(1, M/‖Δ_i‖), then takes the job's
weighted mean: one update's pull on the result is at most its weight times M.

FLTrust trusts the service's own update g_0, trained on a small root (probe) set from the global model:
TS_i = ReLU(cos(Δ_i, g_0)), every update is rescaled to ‖g_0‖, and Δ = Σ TS_i (‖g_0‖/‖Δ_i‖) Δ_i / Σ TS_i.
An update pointing away from g_0 gets no weight, and ‖Δ‖ ≤ ‖g_0‖. The service trains g_0 (torch) and passes
it in; nothing here trains.
"""

from __future__ import annotations

import numpy as np

from fedbroker.aggregators.robust.base import (
    ROBUST,
    RobustInput,
    RobustResult,
    RootRequest,
    combination,
    dots,
    row_norms,
    uniform,
)
from fedbroker.aggregators.robust.rule import RuleBase
from fedbroker.aggregators.selection import ProbeRequest
from fedbroker.algorithms.robust_params import FLTrustParams, NormBoundParams, NoRobustParams


@ROBUST.register("none")
class NoRobust(RuleBase, NoRobustParams):
    """The job's weighted mean (what a close does without a rule; here for the contract and the bench)."""

    def combine_rows(self, problem: RobustInput) -> RobustResult:
        """Σ w_i Δ_i."""
        d, w = problem.deltas, problem.weights
        return RobustResult(combination(d, w), w, w)


@ROBUST.register("norm_bound")
class NormBound(RuleBase, NormBoundParams):
    """Every update's norm capped at max_norm, then the job's weighted mean."""

    def combine_rows(self, problem: RobustInput) -> RobustResult:
        """Σ w_i · min(1, M/‖Δ_i‖) · Δ_i (the weights are not renormalised: a bounded update pulls less)."""
        d, w = problem.deltas, problem.weights
        norms = row_norms(d)
        scale = np.minimum(1.0, np.divide(self.max_norm, norms, out=np.ones_like(norms), where=norms > 0))
        kept = w * scale
        return RobustResult(combination(d, kept), kept, w, {"norm_bounded": float(np.sum(scale < 1.0)),
                                                           "norm_largest": float(norms.max())})


@ROBUST.register("fltrust")
class FLTrust(RuleBase, FLTrustParams):
    """Trust scores from the cosine to the service's root update g_0; every update rescaled to ‖g_0‖."""

    def root_request(self) -> RootRequest | None:
        """The root set g_0 is trained on, and its training."""
        return RootRequest(ProbeRequest(self.probe_dataset, self.probe_size, self.probe_seed), epochs=self.epochs,
                           lr=self.lr, batch_size=self.batch_size)

    def combine_rows(self, problem: RobustInput) -> RobustResult:
        """Σ TS_i (‖g_0‖/‖Δ_i‖) Δ_i / Σ TS_i; zero (the global model kept) when no update is trusted."""
        d = problem.deltas
        n = d.shape[0]
        if problem.root_update is None:
            raise ValueError("fltrust needs the service's root update g_0 (trained on its root set)")
        g0 = np.asarray(problem.root_update, dtype=np.float64).reshape(-1)
        if g0.shape != (d.shape[1],) or not np.all(np.isfinite(g0)):
            raise ValueError(f"fltrust's root update must be {d.shape[1]} finite values, got shape {g0.shape}")
        g0_norm = float(np.linalg.norm(g0))
        norms = row_norms(d)
        cosine = np.divide(dots(d, g0), norms * g0_norm, out=np.zeros(n), where=(norms > 0) & (g0_norm > 0))
        trust = np.maximum(cosine, 0.0)
        total = float(trust.sum())
        share = trust / total if total > 0 else np.zeros(n)
        scale = np.divide(share * g0_norm, norms, out=np.zeros(n), where=norms > 0)
        notes = {"fltrust_root_norm": g0_norm, "fltrust_trusted": float(np.sum(trust > 0))}
        return RobustResult(combination(d, scale), share, uniform(n), notes)
