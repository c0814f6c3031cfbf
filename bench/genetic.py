"""Benchmark 5: cost of one genetic base-model selection (population 100, 20 generations) for N clients.

`GeneticSelection.choose` on a GA round, as the service calls it when a round closes (digits MLP 64-64-10,
4,810 parameters per update, m = N / 5), under both fitness readings: `probe` (the default: penultimate
features of every update and the cross-entropy of every candidate aggregate on a 256-sample probe set,
one batched numpy forward per generation) and `reported_loss` (parameter cosines and reported losses).
"""

from __future__ import annotations

import time

import numpy as np

from bench.harness import Goal, Section, Stat, loglog_slope, repeat
from fedbroker.aggregators.selection import SelectionInput

PARAMETERS = 64 * 64 + 64 + 64 * 10 + 10


def run(*, quick: bool) -> Section:
    from fedbroker.aggregators.probe_sets import probe_arrays
    from fedbroker.aggregators.selection import Candidate, Probe
    from fedbroker.aggregators.selection.genetic import GeneticSelection
    from fedbroker.job.spec import parse_model

    spec = parse_model({"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 64}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 64, "out_features": 10}]})
    probe = Probe(spec, *probe_arrays("digits", 256, 0))

    started = time.perf_counter()
    section = Section(
        "genetic", "5. Genetic selection cost",
        "Seconds per `GeneticSelection.choose` on a GA round (population 100, 20 generations, m = N/5, "
        f"updates of {PARAMETERS:,} parameters), including every per-round feature or cosine computation; "
        "`probe`: a 256-sample digits probe set.",
    )
    sizes = [50, 200] if quick else [50, 200, 1000]
    rng = np.random.default_rng(5)
    medians: dict[str, list[float]] = {"probe": [], "reported_loss": []}
    for fitness, n in [(f, n) for f in medians for n in sizes]:
        candidates = [Candidate(worker_id=f"w{i:04d}", vector=rng.standard_normal(PARAMETERS),
                                num_samples=int(rng.integers(50, 500)), reported_loss=float(rng.uniform(0.1, 2.0)))
                      for i in range(n)]
        global_vector = rng.standard_normal(PARAMETERS)
        selector = GeneticSelection(m=max(1, n // 5), population=100, generations=20, ga_gap=1, fitness=fitness,
                                    probe_dataset="digits" if fitness == "probe" else "")
        seeds = iter(range(1000))
        last = {}

        def call() -> None:
            last["s"] = selector.choose(SelectionInput(candidates=candidates, round_index=1, global_vector=global_vector,
                                        rng=np.random.default_rng(next(seeds)), probe=probe))

        # quick mode (tests/house/test_bench_quick.py) asks for a finite number, not a stable one: one timed call
        stat = Stat.of(repeat(call, repeats=1 if quick else 5, warmup=0 if quick else 1), "s")
        assert last["s"].stats.get("ga_ran") == 1.0, last["s"]
        medians[fitness].append(stat.median)
        section.rows.append({"fitness": fitness, "N clients": n, "m": max(1, n // 5), "population": 100,
                             "generations": 20, "time (s)": stat, "ms / generation": stat.scaled(1000 / 20, "ms")})
    for fitness, times in medians.items():
        slope = loglog_slope(sizes, times)
        section.goals.append(Goal(f"{fitness}: fitted exponent of time in N", None if slope is None else round(slope, 2),
                                  "reported (no target)", None,
                                  f"{times[-1]:.3g} s at N={sizes[-1]}; the service's selection limit is 30 s"))
    section.seconds = time.perf_counter() - started
    return section
