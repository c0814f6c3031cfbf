"""A history check across rounds, after FLDetector (Zhang, Cao, Jia, Gong, "FLDetector: Defending Federated
Learning Against Model Poisoning Attacks via Detecting Malicious Clients", KDD 2022).

An honest site's update moves with the global model as the loss's curvature says: Δ_i(w_t) ≈ Δ_i(w_k) −
H·(w_t − w_k), with H approximated by L-BFGS from the last rounds' model steps s_j = w_{j+1} − w_j and the
changes of the round's aggregate, y_j = Δ(w_j) − Δ(w_{j+1}) (the aggregate as a gradient step: −Δ plays the
gradient). A site that sends what its own history does not predict (one that behaved, then attacks) is far from
its prediction. Each round every site with a kept earlier update gets its distance to the prediction, over the
round's mean distance (so the scale of the updates cancels); its score is the mean of its last `window` such
distances. Past `warmup` rounds the scores of the round's sites are split in two clusters at the split that
leaves the least within-cluster squared spread (the one-dimensional 2-means, exact by scanning the sorted
scores); the upper cluster is flagged when it holds fewer than half the sites and its mean is at least `ratio`
× the lower's. This replaces the paper's gap statistic (which decides whether there are two clusters at all)
by that fixed ratio. A flagged site stays excluded for the rest of the job, as FLDetector removes it.

A site without a kept update (new, or away longer than the kept steps) is not scored that round but is
recorded; skipping rounds keeps its last update and scores, and its prediction spans the steps it missed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from fedbroker.aggregators.robust.base import ROBUST, RobustInput, RobustResult, RobustRule, RootRequest
from fedbroker.aggregators.robust.coordinatewise import trimmed
from fedbroker.aggregators.robust.memory import RobustMemory, SiteRecord
from fedbroker.aggregators.robust.rule import RuleBase
from fedbroker.algorithms.robust_params import HistoryCheckParams

MIN_SCORES = 2  # a site is judged on two distances at least: one alone, early, with few sites, is noise


class LBFGS:
    """The compact L-BFGS approximation B ≈ H from pairs (s_j, y_j) (Byrd, Nocedal, Schnabel, Math.
    Programming 1994): B v = σv − [σS Y] M⁻¹ [σSᵀv; Yᵀv], M = [[σSᵀS, L], [Lᵀ, −D]], with σ = yᵀs/sᵀs of the
    newest pair. Pairs without positive curvature (sᵀy ≤ 0: noise) are left out; with none left, B = 0 (the
    prediction is the site's last update)."""

    def __init__(self, pairs: tuple[tuple[np.ndarray, np.ndarray], ...]) -> None:
        s_list, y_list = [], []
        for s32, y32 in pairs:
            s, y = s32.astype(np.float64), y32.astype(np.float64)
            if float(s @ y) > 1e-12 * float(np.linalg.norm(s) * np.linalg.norm(y)) and float(s @ y) > 0:
                s_list.append(s)
                y_list.append(y)
        self.used = len(s_list)
        if not s_list:
            return
        self.s, self.y = np.stack(s_list, axis=1), np.stack(y_list, axis=1)
        self.sigma = float(self.y[:, -1] @ self.s[:, -1] / (self.s[:, -1] @ self.s[:, -1]))
        sy = self.s.T @ self.y
        lower = np.tril(sy, k=-1)
        self.middle = np.block([[self.sigma * (self.s.T @ self.s), lower], [lower.T, -np.diag(np.diag(sy))]])

    def times(self, v: np.ndarray) -> np.ndarray:
        """B·v."""
        if not self.used:
            return np.zeros_like(v)
        rhs = np.concatenate([self.sigma * (self.s.T @ v), self.y.T @ v])
        coef = np.linalg.lstsq(self.middle, rhs, rcond=None)[0]
        m = self.used
        return np.asarray(self.sigma * v - (self.sigma * (self.s @ coef[:m]) + self.y @ coef[m:]))


def two_cluster_upper(scores: np.ndarray, ratio: float) -> np.ndarray:
    """A boolean mask of the upper cluster of the 1-D 2-means split, when it is a minority and its mean is at
    least `ratio` × the lower's; all False otherwise."""
    m = scores.shape[0]
    flagged = np.zeros(m, dtype=bool)
    if m < 3:
        return flagged
    order = np.argsort(scores, kind="stable")
    x = scores[order]
    best, split = np.inf, 0
    for k in range(1, m):
        spread = float(((x[:k] - x[:k].mean()) ** 2).sum() + ((x[k:] - x[k:].mean()) ** 2).sum())
        if spread < best:
            best, split = spread, k
    low, high = x[:split], x[split:]
    if 2 * high.size < m and high.mean() >= ratio * max(float(low.mean()), 1e-300):
        flagged[order[split:]] = True
    return flagged


@ROBUST.register("history_check")
class HistoryCheck(RuleBase, HistoryCheckParams):
    """FLDetector's consistency check in front of an inner rule."""

    @property
    def memory_steps(self) -> int:
        """A site away for up to `window` rounds is still predicted (its model step sums the ones it missed)."""
        return self.window

    def root_request(self) -> RootRequest | None:
        """The inner rule's root set (fltrust's g_0 is trained by the service before the close)."""
        return self.inner_rule().root_request()

    def inner_rule(self) -> RobustRule:
        """The rule the unflagged updates go to."""
        return ROBUST.create(self.inner, dict(self.inner_params))

    def combine_rows(self, problem: RobustInput) -> RobustResult:
        """Flag, exclude, then the inner rule on the rest (its kept weights on the original rows)."""
        memory = problem.memory or RobustMemory()
        n = problem.deltas.shape[0]
        notes: dict[str, float] = {}
        flagged = np.zeros(n, dtype=bool)
        if problem.sites:
            memory, flagged, notes = self.check(problem, memory)
        keep = np.flatnonzero(~flagged)
        kept, delta = np.zeros(n), np.zeros(problem.deltas.shape[1])
        if keep.size:
            inner = self.inner_rule().aggregate(RobustInput(
                deltas=problem.deltas[keep], weights=problem.weights[keep], rng=problem.rng,
                root_update=problem.root_update, memory=problem.memory))
            kept[keep] = inner.kept_weight * problem.weights[keep].sum()
            delta = inner.delta
            notes.update({f"inner_{k}": v for k, v in inner.notes.items()})
        notes["history_flagged"] = float(flagged.sum())
        return RobustResult(delta, kept, problem.weights, notes, memory=memory, flagged=flagged)

    def check(self, problem: RobustInput, memory: RobustMemory) -> tuple[RobustMemory, np.ndarray, dict[str, float]]:
        """The round's distances and scores, the flags, and the memory with every site's new record."""
        sites, d = problem.sites, problem.deltas
        hessian = LBFGS(memory.curvature)
        distance = np.full(len(sites), np.nan)
        turned: dict[int, np.ndarray | None] = {}   # B·(w_now − w_k) per close k: sites of one round share it
        for i, site in enumerate(sites):
            record = memory.sites.get(site)
            if record is None or record.update.shape != (d.shape[1],):
                continue
            if record.close not in turned:
                moved = memory.displacement(record.close)
                turned[record.close] = None if moved is None else hessian.times(moved)
            change = turned[record.close]
            if change is not None:
                distance[i] = float(np.linalg.norm(d[i].astype(np.float64) - record.update + change))
        scored = np.isfinite(distance)
        typical = float(np.median(distance[scored])) if scored.any() else 0.0
        records: dict[str, SiteRecord] = dict(memory.sites)
        scores = np.full(len(sites), np.nan)
        for i, site in enumerate(sites):
            old = records.get(site)
            history = old.scores if old is not None else ()
            if scored[i] and typical > 0:
                history = (*history, float(distance[i] / typical))[-self.window:]
            records[site] = SiteRecord(np.asarray(d[i], dtype=np.float32).copy(), memory.closes, history)
            if len(history) >= MIN_SCORES:
                scores[i] = float(np.mean(history))
        judged = np.isfinite(scores)
        new = np.zeros(len(sites), dtype=bool)
        if memory.closes >= self.warmup and judged.sum() >= 3:
            new[np.flatnonzero(judged)] = two_cluster_upper(scores[judged], self.ratio)
        flagged_ids = memory.flagged | {s for s, f in zip(sites, new) if f}
        flagged = np.array([s in flagged_ids for s in sites], dtype=bool)
        notes = {"history_scored": float(scored.sum()), "history_pairs": float(hessian.used),
                 "history_newly_flagged": float(new.sum()),
                 "history_top_score": float(np.nanmax(scores)) if judged.any() else 0.0}
        curvature = (*memory.curvature, *self.new_pair(problem, memory))[-self.pairs:]
        memory = replace(memory, sites=records, flagged=frozenset(flagged_ids), curvature=curvature)
        return memory, flagged, notes

    @staticmethod
    def new_pair(problem: RobustInput, memory: RobustMemory) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
        """This round's curvature pair: s = the last model step, y = the coordinate-wise median over the sites
        that sent updates in both rounds of Δ_i(previous) − Δ_i(now), so neither who takes part nor fewer
        than half of them can bend it (none when no site sent both)."""
        step = memory.previous
        if step is None:
            return ()
        changes = [record.update - row for site, row in zip(problem.sites, problem.deltas)
                   if (record := memory.sites.get(site)) is not None and record.close == memory.closes - 1
                   and record.update.shape == row.shape]
        if not changes:
            return ()
        stacked = np.stack(changes)
        return ((step.copy(), trimmed(stacked, (stacked.shape[0] - 1) // 2)[0].astype(np.float32)),)


