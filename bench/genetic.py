"""Benchmark 5: cost of one genetic base-model selection (population 100, 20 generations) for N clients.

`GeneticSelection.choose` on a GA round, as the service calls it when a round closes: the cosine of every
update to the global model (digits MLP 64-64-10, 4,810 parameters per update), then the evolution of
m-subsets with m = N / 5, Loss2 from the reported losses.
"""

from __future__ import annotations

import time

import numpy as np

from bench.harness import Goal, Section, Stat, loglog_slope, repeat

PARAMETERS = 64 * 64 + 64 + 64 * 10 + 10


def run(*, quick: bool) -> Section:
    from fedbroker.aggregators.selection import Candidate
    from fedbroker.aggregators.selection.genetic import GeneticSelection

    started = time.perf_counter()
    section = Section(
        "genetic", "5. Genetic selection cost",
        "Seconds per `GeneticSelection.choose` on a GA round (population 100, 20 generations, m = N/5, "
        f"updates of {PARAMETERS:,} parameters), including the per-round cosines to the global model.",
    )
    sizes = [50, 200] if quick else [50, 200, 1000]
    rng = np.random.default_rng(5)
    medians = []
    for n in sizes:
        candidates = [Candidate(worker_id=f"w{i:04d}", vector=rng.standard_normal(PARAMETERS),
                                num_samples=int(rng.integers(50, 500)), reported_loss=float(rng.uniform(0.1, 2.0)))
                      for i in range(n)]
        global_vector = rng.standard_normal(PARAMETERS)
        selector = GeneticSelection(m=max(1, n // 5), population=100, generations=20, ga_gap=1)
        seeds = iter(range(1000))
        last = {}

        def call() -> None:
            last["s"] = selector.choose(candidates, round_index=1, global_vector=global_vector,
                                        rng=np.random.default_rng(next(seeds)))

        stat = Stat.of(repeat(call, repeats=3 if quick else 5, warmup=1), "s")
        assert last["s"].stats.get("ga_ran") == 1.0, last["s"]
        medians.append(stat.median)
        section.rows.append({"N clients": n, "m": max(1, n // 5), "population": 100, "generations": 20,
                             "time (s)": stat, "ms / generation": stat.scaled(1000 / 20, "ms")})
    slope = loglog_slope(sizes, medians)
    section.goals.append(Goal("fitted exponent of time in N", None if slope is None else round(slope, 2),
                              "reported (no target)", None,
                              f"{medians[-1]:.3g} s at N={sizes[-1]}, far below the service's 30 s selection limit"))
    section.seconds = time.perf_counter() - started
    return section
