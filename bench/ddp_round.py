"""Benchmark: a distributed-DP secure round (privacy.distributed) against a plain secure round, same run, same sizes.

Both rounds go through the aggregation service's own code in one process, as section 8 drives them (the servicer's
Sec* methods, the masked uploads through `RoundBook.receive_update`, the close), without training. What differs is
what each worker masks and what the close does with the sum: `plain secure` masks its weighted update (clipped and
quantised by the offset quantiser) and the close takes the weighted mean; `distributed DP` masks its gradient sum
scaled by γ, rounded and noised with its Skellam share (`fedbroker.secagg.skellam`: quantise, noise_share, to_ring;
`SecAggClient.masked_integers`), in the round's ring, and the close reads the sum back signed and takes one DP-SGD
step (`fedbroker.aggregators.secure_ddp`). The per-record gradients a real site computes are not here (a DP epoch
costs that in either mode); the gradient sum stands in as a random vector of the model's size.

Timed as section 8: `all work` (the service's and every worker's seconds summed), `in parallel` (the service's plus,
per phase, the slowest worker's) and `service` (the service's alone). 10 % of the workers drop after sharing keys.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.harness import Goal, Section, Stat
from bench.secure_round import Clock, drive_secure_round, masked_update, model, states
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.job.settings import sections_settings
from fedbroker.job.spec import ModelSpec
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.secagg import SecAggClient, skellam

JOB = "bench-ddp"
GOAL_N, TARGET = 50, 1.2
SAMPLES = 100  # each worker's records
PRIVACY = pb.DistributedDPSettings(enabled=True, noise_multiplier=1.0, clip=1.0, sample_rate=0.05, quorum=2)


def _install(book: RoundBook, spec: ModelSpec, base: dict[str, np.ndarray], ids: list[str], ddp: bool) -> None:
    settings = sections_settings(JOB, training={"lr": 0.1}, aggregation={"secure": True})
    if ddp:
        settings.privacy.distributed.CopyFrom(PRIVACY)
    book.installed.install(settings)
    book.put_global(JOB, 1, spec.to_json(), base)
    book.open_round(JOB, 1, ids, time.time() + 3600, seed=1, num_samples={w: SAMPLES for w in ids})


def one_round(spec: ModelSpec, base: dict[str, np.ndarray], trained: Callable[[str], dict[str, np.ndarray]],
              ids: list[str], dead: set[str], *, ddp: bool) -> Clock:
    """One secure round of `ids` (those in `dead` drop after sharing), plain or distributed DP."""
    book, clock = RoundBook(), Clock()
    try:
        _install(book, spec, base, ids, ddp)
        drive_secure_round(book, clock, spec, base, trained, ids, dead, job=JOB, mask=_masked, samples=SAMPLES)
    finally:
        book.stop()
    return clock


def _masked(session: Any, worker: str, crypto: SecAggClient, vector: np.ndarray, excluded: Any) -> np.ndarray:
    """What a worker masks: its weighted update (plain), or its γ-scaled, rounded, noised gradient sum (DDP)."""
    if session.ddp is None:
        return masked_update(session, worker, crypto, vector, excluded)
    ddp = session.ddp
    rng = np.random.default_rng(int(worker[1:]))  # each worker's own noise (ids are w000, w001, …)
    levels = skellam.quantise(vector, scale=ddp.scale, rng=rng)  # stands in for the clipped gradient sum
    levels += skellam.noise_share(rng, size=levels.shape[0], variance=ddp.share_variance)
    ring = skellam.to_ring(levels, bits=ddp.bits)
    return crypto.masked_integers(ring, excluded, bits=ddp.bits)


def run(*, quick: bool) -> Section:
    started = time.perf_counter()
    section = Section(
        "ddp_round", "Distributed-DP secure round vs plain secure round (the service's path)",
        "Seconds for one secure round of N workers × P parameters through the aggregation service's code in one "
        "process, no training, no network, 10 % dropout: a plain secure round (weighted updates, offset quantiser, "
        "weighted mean) against a distributed-DP one (γ-scaled sums with each worker's Skellam share, the signed ring "
        "sum, one DP-SGD step). Same run, alternated, so both see the same load. `all work`, `in parallel` and "
        "`service` as in section 8.",
    )
    width, sizes = (100, (10,)) if quick else (1000, (GOAL_N,))
    spec = model(width)
    p = width * width + width
    warm = [f"w{i}" for i in range(4)]
    for ddp in (False, True):
        one_round(model(8), *states(model(8), warm), warm, set(), ddp=ddp)
    goal: dict[str, float] = {}
    for n in sizes:
        ids = [f"w{i:03d}" for i in range(n)]
        base, trained = states(spec, ids)
        dead = set(np.random.default_rng(n).choice(ids, round(0.1 * n), replace=False).tolist())
        plains, ddps = [], []
        for _ in range(2):
            plains.append(one_round(spec, base, trained, ids, dead, ddp=False))
            ddps.append(one_round(spec, base, trained, ids, dead, ddp=True))
        stats = {f"{kind} {part} (s)": Stat.of([getattr(c, attr)() if attr else c.service for c in clocks], "s")
                 for kind, clocks in (("plain secure", plains), ("distributed DP", ddps))
                 for part, attr in (("all work", "total"), ("in parallel", "parallel"), ("service", ""))}
        ratios = {f"DDP / plain secure, {part}": stats[f"distributed DP {part} (s)"].median
                  / stats[f"plain secure {part} (s)"].median for part in ("all work", "in parallel", "service")}
        section.rows.append({"N": n, "P": p, "dropout": "10%", **stats, **ratios})
        goal = ratios
    judged = not quick
    where = f"N={GOAL_N}, P≈1M, 10 % dropout" if judged else f"quick sizes N={sizes[-1]}, P={p}: not judged"
    for part in ("in parallel", "all work", "service"):
        name = f"DDP / plain secure, {part}"
        target = f"≤ {TARGET}" if part != "service" else "reported"
        met = (goal[name] <= TARGET if judged else None) if part != "service" else None
        section.goals.append(Goal(f"{name} ({where})", round(goal[name], 2), target, met))
    section.seconds = time.perf_counter() - started
    return section
