"""Benchmark: a grouped secure + robust round (aggregation.secure_group_size 5, median over the group means)
against a plain secure round (one SecAgg+ sum of everyone, FedAvg) at the same N and P, in the same run.

Both rounds go through the aggregation service's own code in one process, driven by section 8's driver
(bench/secure_round.py `drive_secure_round`): the servicer's Sec* methods for the service, `SecAggClient`'s steps
and `weighted_vector` for each worker (one thread plays every worker), the masked uploads through
`RoundBook.receive_update`, the close. The only difference is the job's aggregation section: in the grouped
round each worker's roster, shares and masks are its group's (4 peers instead of N − 1), and the close
unmasks G sums and runs the median over the G group means. No dropout, no training, no spool. `all work`: the
service's and every worker's seconds summed; `in parallel`: the service's plus, per phase, the slowest
worker's (bench/secure_round.py's Clock).
"""

from __future__ import annotations

import time
from typing import Any

from bench.harness import Goal, Section, Stat
from bench.secure_round import Clock, drive_secure_round, model, states
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.job.spec import ModelSpec

JOB = "bench-groups"
GROUP = 5
TARGET = 2.0


def one_round(spec: ModelSpec, ids: list[str], aggregation: dict[str, Any]) -> Clock:
    """One secure round (grouped when `aggregation` says so), every step timed by party and phase."""
    base, trained = states(spec, ids)
    book, clock = RoundBook(), Clock()
    try:
        book.put_global(JOB, 1, spec.to_json(), base)
        book.open_round(JOB, 1, ids, time.time() + 3600, aggregation, seed=1, num_samples={w: 100 for w in ids})
        drive_secure_round(book, clock, spec, base, trained, ids, set(), job=JOB)
    finally:
        book.stop()
    return clock


def run(*, quick: bool) -> Section:
    started = time.perf_counter()
    section = Section(
        "secure_groups", "Secure and robust together: groups vs one secure sum",
        f"Seconds for one secure round of N workers × P parameters through the aggregation service's code in one "
        f"process, no training: `plain secure` (one SecAgg+ sum, FedAvg) against `grouped` (secure_group_size "
        f"{GROUP}: one SecAgg+ instance per group, the median over the group means). Target: grouped ≤ {TARGET:g}× "
        f"plain in all work, same run.")
    n, width = (20, 100) if quick else (20, 700)
    spec, ids = model(width), [f"w{i:02d}" for i in range(n)]
    p = width * width + width
    grouped = {"secure": True, "robust": "median", "secure_group_size": GROUP}
    one_round(model(8), ids, {"secure": True})  # imports and first calls: not timed
    one_round(model(8), ids, grouped)
    plains, groups = [], []
    for _ in range(2 if quick else 3):  # alternated, so both see the same load
        plains.append(one_round(spec, ids, {"secure": True}))
        groups.append(one_round(spec, ids, grouped))
    stats = {f"{kind} {part} (s)": Stat.of([getattr(c, attr)() if attr else c.service for c in clocks], "s")
             for kind, clocks in (("plain secure", plains), ("grouped", groups))
             for part, attr in (("all work", "total"), ("in parallel", "parallel"), ("service", ""))}
    ratios = {f"grouped / plain, {part}": stats[f"grouped {part} (s)"].median / stats[f"plain secure {part} (s)"].median
              for part in ("all work", "in parallel", "service")}
    section.rows.append({"N": n, "P": p, "groups": n // GROUP, **stats, **ratios})
    judged = not quick
    for name, value in ratios.items():
        met = (value <= TARGET if judged else None) if "all work" in name else None
        section.goals.append(Goal(f"{name} (N={n}, P={p}{'' if judged else ': quick, not judged'})", round(value, 2),
                                  f"≤ {TARGET:g}" if "all work" in name else "reported", met))
    section.seconds = time.perf_counter() - started
    return section
