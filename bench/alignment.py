"""Benchmark 4: cost of neuron alignment (FedDNA, PFNM, NAFI) against neurons per layer n and clients K.

Each client holds an MLP d → n → 10 (d = 64 like digits, 784 like MNIST): one shared random network
whose hidden units each client permutes at random and perturbs with Gaussian noise (σ = 0.1), so there
is a true matching to find. One call of the registered algorithm's `align` is timed (FedDNA round 1,
before its freeze; PFNM/NAFI one-shot with `max_global_width = 2n`, so the assignment problems keep
the shape n × (L + n) at every n). The log-log slope of time against n (at K = 10) and against K
(at n = 256) is the fitted growth exponent, next to the papers' stated complexity.

Cells run cheapest first; a cell whose time, extrapolated from the cells already measured, would pass
the per-cell cap or the section's budget is skipped and listed with its estimate.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from bench.harness import Goal, Section, Stat, loglog_slope, repeat
from fedbroker.aggregators.alignment import AlignInput

PAPER = {  # (exponent in n, exponent in K, as the papers state the cost)
    "feddna": (2.0, 1.0, "O(K·n²·m)"),
    "pfnm": (3.0, 1.0, "Hungarian O(n³) per client"),
    "nafi": (3.0, 1.0, "Hungarian O(n³) per client"),
}


def make_clients(k: int, n: int, d: int, rng: np.random.Generator) -> list[list[Any]]:
    from fedbroker.aggregators.alignment import Layer

    w1 = rng.standard_normal((n, d)) / np.sqrt(d)
    b1 = rng.standard_normal(n) * 0.1
    w2 = rng.standard_normal((10, n)) / np.sqrt(n)
    b2 = rng.standard_normal(10) * 0.1
    clients = []
    for _ in range(k):
        perm = rng.permutation(n)
        noise = lambda shape: rng.standard_normal(shape) * 0.1  # noqa: E731
        clients.append([Layer((w1 + noise(w1.shape))[perm], (b1 + noise(n))[perm]),
                        Layer((w2 + noise(w2.shape))[:, perm], b2 + noise(10))])
    return clients


def algorithm(name: str, n: int) -> Any:
    from fedbroker.aggregators.alignment import ALIGNMENT

    return ALIGNMENT.create(name, {"max_global_width": 2 * n} if name in ("pfnm", "nafi") else {})


def _estimate(done: dict[tuple[int, int], float], n: int, k: int, exps: tuple[float, float]) -> float:
    """Time of cell (n, k) extrapolated from the nearest measured smaller cell."""
    best = None
    for (n0, k0), t in done.items():
        if n0 <= n and k0 <= k:
            est = t * (n / n0) ** exps[0] * (k / k0) ** exps[1]
            dist = np.log(n / n0) + np.log(k / k0)
            if best is None or dist < best[0]:
                best = (dist, est)
    return 0.0 if best is None else best[1]


def run(*, quick: bool) -> Section:
    started = time.perf_counter()
    section = Section(
        "alignment", "4. Alignment cost",
        "Seconds for one `align` call of K clients' MLPs d → n → 10; slopes are least-squares fits of log time "
        "(fastest run of each cell) against log n (K = 10) and log K (n = 256), next to the papers' stated "
        "complexity. Cells under 1 s run 3 times, under 10 s twice, longer ones once.",
    )
    if quick:
        ns, ks, dims, cap, budget = [32, 64], [5, 10], [64], 5.0, 40.0
        n_fix, k_fix = 64, 10
    else:
        ns, ks, dims, cap, budget = [64, 256, 1024], [5, 10, 50], [64, 784], 90.0, 420.0
        n_fix, k_fix = 256, 10
    rng = np.random.default_rng(11)
    skipped: list[str] = []
    for d in dims:
        for name in ("feddna", "pfnm", "nafi"):
            paper_n, paper_k, stated = PAPER[name]
            done: dict[tuple[int, int], float] = {}
            exps = [paper_n, paper_k]
            for n, k in sorted(((n, k) for n in ns for k in ks), key=lambda c: c[0] ** 3 * c[1]):
                estimate = _estimate(done, n, k, (exps[0], exps[1]))
                left = budget - (time.perf_counter() - started)
                if estimate > cap or estimate > left:
                    skipped.append(f"{name} d={d} n={n} K={k} (≈{estimate:.0f} s)")
                    continue
                clients = make_clients(k, n, d, rng)
                alg = algorithm(name, n)
                weights = np.full(k, 1.0 / k)
                seed = iter(range(100))

                def call() -> None:
                    alg.align(AlignInput(clients=clients, weights=weights, rng=np.random.default_rng(next(seed)), round_index=1))

                first = repeat(call, repeats=1, warmup=0)[0]
                more = 2 if first < 1.0 else 1 if first < 10.0 else 0
                stat = Stat.of([first] + (repeat(call, repeats=more, warmup=0) if more else []), "s")
                done[(n, k)] = stat.min  # estimates and fits use the least disturbed run (shared machine)
                section.rows.append({"algorithm": name, "d": d, "n": n, "K": k, "time (s)": stat})
                # refit the exponents as cells come in, so later estimates follow what is measured
                along_n = [(nn, t) for (nn, kk), t in done.items() if kk == k]
                along_k = [(kk, t) for (nn, kk), t in done.items() if nn == n]
                if len(along_n) >= 2:
                    exps[0] = min(3.5, max(1.0, loglog_slope(*zip(*along_n)) or exps[0]))
                if len(along_k) >= 2:
                    exps[1] = min(2.5, max(0.5, loglog_slope(*zip(*along_k)) or exps[1]))
            fit_n = [(n, t) for (n, k), t in done.items() if k == k_fix]
            fit_k = [(k, t) for (n, k), t in done.items() if n == n_fix]
            slope_n = loglog_slope(*zip(*fit_n)) if len(fit_n) >= 2 else None
            slope_k = loglog_slope(*zip(*fit_k)) if len(fit_k) >= 2 else None
            section.goals.append(Goal(
                f"{name} d={d}: fitted exponent in n (K={k_fix}) / in K (n={n_fix})",
                None if slope_n is None else round(slope_n, 2),
                f"paper {stated}: n^{paper_n:g}, K^{paper_k:g}", None,
                f"K exponent {'–' if slope_k is None else f'{slope_k:.2f}'}",
            ))
    if skipped:
        section.notes.append(f"Skipped (estimated over the {cap:.0f} s cap per cell or the {budget:.0f} s budget): "
                             + "; ".join(skipped) + ".")
    section.notes.append("PFNM/NAFI run with max_global_width = 2n (the default 700 would cap n = 1024 layers).")
    section.seconds = time.perf_counter() - started
    return section
