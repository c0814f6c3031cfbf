"""Benchmark 9: the cost of each robust aggregation rule against the weighted mean it replaces.

Every rule's `aggregate` over K float32 updates of P parameters (Δ_i = x_i − x_global, as a close builds
them), beside the `none` rule (the job's weighted mean: one float32 matrix-vector product) on the same
array, both on one BLAS thread as the service's own mean runs. FLTrust's time leaves out the training of its
root update g_0 (a few SGD steps on the probe set: the model's cost, not the rule's). Full mode measures
K = 10, 50 at P = 1M and 10M (10M only where memory holds the updates three times over); quick mode
P = 100k.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from bench.harness import Goal, Section, Stat, repeat

RULES: dict[str, dict[str, Any]] = {
    "none": {}, "median": {}, "trimmed_mean": {"beta": 0.1}, "multi_krum": {"f": 2},
    "geometric_median": {}, "norm_bound": {"max_norm": 1.0}, "fltrust": {"probe_dataset": "digits"},
    "centered_clipping": {}, "history_check": {"inner": "none"},
}
# a pre-mix in front of a rule: the row's label, the rule and its parameters
PREMIXED: dict[str, tuple[str, dict[str, Any]]] = {
    "median + bucketing (s=2)": ("median", {"premix": "bucketing", "bucket_size": 2}),
    "centered_clipping + nnm": ("centered_clipping", {"premix": "nnm"}),
}
GOAL_RATIO = 10.0   # median and trimmed mean at K = 50, P = 1M: within 10× the weighted mean


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _time(rule: Any, deltas: np.ndarray, weights: np.ndarray, root: np.ndarray, *, repeats: int, warmup: int) -> Stat:
    """Seconds per `rule.aggregate` on one BLAS thread (with the input's checks, as the service runs it), each
    update from its own site, with the job's memory of two earlier rounds (centered clipping's momentum; the
    history check predicts every site and keeps two curvature pairs, as in its steady state)."""
    from fedbroker.aggregators.robust import RobustInput

    sites = tuple(f"site-{i}" for i in range(deltas.shape[0]))
    memory = None
    for scale in (np.float32(1.1), np.float32(1.05)):
        memory = rule.aggregate(RobustInput(deltas=deltas * scale, weights=weights, rng=np.random.default_rng(1),
                                            root_update=root, sites=sites, memory=memory)).memory

    def call() -> None:
        rule.aggregate(RobustInput(deltas=deltas, weights=weights, rng=np.random.default_rng(0), root_update=root,
                                   sites=sites, memory=memory))

    with threadpool_limits(limits=1, user_api="blas"):
        return Stat.of(repeat(call, repeats=repeats, warmup=warmup), "s")


def run(*, quick: bool) -> Section:
    from fedbroker.aggregators.robust import ROBUST

    started = time.perf_counter()
    section = Section(
        "robust", "9. Robust aggregation cost",
        "Seconds per robust rule `aggregate` over K float32 updates of P parameters, and its cost in weighted means "
        "(the `none` rule on the same array; fastest run over fastest run, the pair least disturbed by other load); "
        "one BLAS thread; FLTrust without training g_0.",
    )
    sizes = [100_000] if quick else [1_000_000, 10_000_000]
    rng = np.random.default_rng(7)
    ratios: dict[tuple[str, int, int], float] = {}
    for p in sizes:
        for k in (10, 50):
            if 3 * 4 * k * p > _available_bytes():
                section.notes.append(f"K={k} P={p:,}: skipped, {3 * 4 * k * p / 2**30:.1f} GiB not available")
                continue
            deltas = rng.standard_normal((k, p), dtype=np.float32) * np.float32(1e-3)
            weights = rng.uniform(1, 5, size=k)
            weights /= weights.sum()
            root = deltas.mean(axis=0, dtype=np.float64)
            base = None  # the weighted mean's fastest run: the run least disturbed by other load, as each rule's
            rows = {**{name: (name, params) for name, params in RULES.items()}, **PREMIXED}
            for label, (name, params) in rows.items():
                rule = ROBUST.create(name, params)
                # quick (the test suite's smoke run) asks for a finite number, not a settled one: one timed call
                stat = _time(rule, deltas, weights, root, repeats=1 if quick else 5, warmup=0 if quick else 1)
                base = stat.min if label == "none" else base
                assert base is not None
                ratios[(label, k, p)] = stat.min / base
                section.rows.append({"rule": label, "K": k, "P": p, "time (s)": stat,
                                     "× weighted mean (fastest runs)": round(stat.min / base, 1)})
            deltas = np.zeros((0, 0), dtype=np.float32)  # let the next size reuse the memory
    k, p = 50, 1_000_000
    if quick:  # P = 100k fits in cache, where the mean is cheaper than any pass that copies: no goal there
        section.notes.append("quick mode: P = 100k only; the ≤ 10× goal is judged at P = 1M (`make bench`)")
    for name in ("median", "trimmed_mean") if not quick else ():
        ratio = ratios.get((name, k, p))
        section.goals.append(Goal(f"{name} at K={k}, P={p:,} (× weighted mean)",
                                  None if ratio is None else round(ratio, 1), f"≤ {GOAL_RATIO:g}×",
                                  None if ratio is None else ratio <= GOAL_RATIO))
    section.seconds = time.perf_counter() - started
    return section


if __name__ == "__main__":
    import sys

    quick = "--quick" in sys.argv
    result = run(quick=quick)
    for row in result.rows:
        print(row["rule"], row["K"], row["P"], row["time (s)"].text(), row["× weighted mean (fastest runs)"])
    for goal in result.goals:
        print(goal)
