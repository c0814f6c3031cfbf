"""Benchmark 7: a SecAgg+ round in one process against a plain weighted sum and Flower's SecAgg+.

Each row is one round of N workers with P parameters, 0 % or 10 % of them dropping after sharing keys
(the costly case: the service rebuilds their mask keys and strips their pairwise masks). `secure` is the
whole `fedbroker.secagg` round (every worker's four steps plus the service's), no network; `plain` is the
service's sum Σ w_i·x_i over the same float64 inputs; `Flower` is Flower's SecAgg+ (its client stage
functions, its server arithmetic; bench/flower_secagg.py) in `.venv-bench`, same N, P, dropout, k and t.
Quantisation error: the standard deviation over coordinates of (secure sum − plain sum), against the
standard deviation of the DP-SGD noise those weighted updates already carry (one step of σ = 1, C = 1,
batch 64, lr 0.05: lr·σ·C/64 per worker, times √Σw_i² = 1/√N for equal weights).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
import time
from typing import Any

import numpy as np

from bench.harness import Goal, Section, Stat, repeat
from fedbroker.secagg import SecAggClient, SecAggParams, SecAggServer

SEED = b"bench-secagg-round-seed"
DP_STEP_STD = 0.05 * 1.0 * 1.0 / 64  # lr·σ·C/batch: one DP-SGD step's noise per coordinate of one update
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed_round(inputs: dict[str, np.ndarray], params: SecAggParams, dead: set[str], seed: int) -> dict[str, Any]:
    """One round with the client and the service's seconds kept apart; returns them and the sum."""
    rng = np.random.default_rng(seed)
    clock = {"client": 0.0, "server": 0.0}

    def on(side: str, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args)
        clock[side] += time.perf_counter() - t0
        return out

    server = on("server", SecAggServer, params, SEED)
    clients = {w: on("client", SecAggClient, w, params, SEED, rng) for w in inputs}
    for w, c in clients.items():
        on("server", server.add_keys, w, on("client", c.advertise))
    rosters = on("server", server.rosters)
    for w, c in clients.items():
        on("server", server.add_shares, w, on("client", c.share_keys, rosters[w]))
    inboxes = on("server", server.inboxes)
    for w, c in clients.items():
        on("client", c.open_inbox, inboxes[w])
    on("server", server.exclude, ())
    for w, c in clients.items():
        if w not in dead:
            on("server", server.add_masked, w, on("client", c.masked_input, inputs[w]))
    for w, request in on("server", server.unmask_requests).items():
        on("server", server.add_unmask, w, on("client", clients[w].unmask, request.survivors, request.dropped))
    result = on("server", server.finish)
    return {"client_s": clock["client"], "server_s": clock["server"], "result": result}


def flower_rounds(python: str | None, n: int, p: int, dropout: float, params: SecAggParams,
                  repeats: int) -> dict[str, Any] | None:
    if python is None:
        return None
    k = min(params.neighbours, n - 1)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [python, "-m", "bench.flower_secagg", str(n), str(p), str(dropout), str(k + 1), str(params.threshold),
               str(repeats), out.name]
        env = {**os.environ, "PYTHONPATH": REPO}
        subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=1800)
        with open(out.name) as f:
            data: dict[str, Any] = json.load(f)
    return data


def run(*, quick: bool) -> Section:
    from bench.flower_env import bench_python

    started = time.perf_counter()
    section = Section(
        "secagg", "7. Secure aggregation (SecAgg+) cost",
        "Seconds for one in-process SecAgg+ round (all N workers' steps + the service's, no network) vs the "
        "plain weighted sum of the same inputs and vs Flower's SecAgg+ (client stage functions + server "
        "arithmetic, same k, t, dropout). Dropped workers share keys, then send nothing. `quant err` is the "
        "std over coordinates of secure − plain sum; `DP std` the noise one DP-SGD step leaves in that sum.",
    )
    section.notes.append("Flower's client stage returns its masked vector as bytes (np.save) that its server reads "
                         "back; that serialisation is inside Flower's times and has no counterpart in ours (in "
                         "process, arrays). Its masks are int64 words from numpy's Mersenne Twister, ours uint32 "
                         "words from AES-256-CTR")
    python = bench_python()
    if python is None:
        section.notes.append("Flower's SecAgg+ not measured: no `.venv-bench` with Flower (`make bench-env`)")
    sizes = [(10, 20_000), (20, 20_000)] if quick else [(10, 1_000_000), (50, 1_000_000), (100, 1_000_000)]
    ratios_plain, ratios_flower, noise_margins = [], [], []
    for n, p in sizes:
        params = SecAggParams.choose(n, 1.0 / n)  # equal weights 1/N on updates bounded by 1: |w·x| ≤ 1/N
        rng = np.random.default_rng(n)
        ids = [f"w{i:03d}" for i in range(n)]
        raw = {w: rng.uniform(-0.9, 0.9, p) for w in ids}
        weights = {w: 1.0 / n for w in ids}
        inputs = {w: weights[w] * raw[w] for w in ids}
        for dropout in (0.0, 0.1):
            dead = set(rng.choice(ids, round(dropout * n), replace=False).tolist()) if dropout else set()
            alive = [w for w in ids if w not in dead]

            def plain() -> np.ndarray:
                acc = np.zeros(p)
                for w in alive:
                    acc += weights[w] * raw[w]
                return acc

            plain_stat = Stat.of(repeat(plain, repeats=3), "s")
            reps = 2 if quick or n <= 10 else 1
            runs = [timed_round(inputs, params, dead, seed) for seed in range(reps)]
            secure = Stat.of([r["client_s"] + r["server_s"] for r in runs], "s")
            error = runs[0]["result"].total - plain()
            quant_std = float(error.std())
            dp_std = DP_STEP_STD * math.sqrt(sum(weights[w] ** 2 for w in alive))
            flower = flower_rounds(python, n, p, dropout, params, reps)
            flower_stat = Stat.of([r["total_s"] for r in flower["runs"]], "s") if flower else None
            ratios_plain.append(secure.median / plain_stat.median)
            noise_margins.append(dp_std / quant_std)
            if flower_stat is not None:
                ratios_flower.append(flower_stat.median / secure.median)
            section.rows.append({
                "N": n, "P": p, "dropout": f"{dropout:.0%}", "k": min(params.neighbours, n - 1), "t": params.threshold,
                "bits": params.bits, "secure (s)": secure, "per worker (s)": Stat.of([r["client_s"] / n for r in runs], "s"),
                "service (s)": Stat.of([r["server_s"] for r in runs], "s"), "plain (s)": plain_stat,
                "secure / plain": secure.median / plain_stat.median,
                "Flower (s)": flower_stat, "Flower / ours": None if flower_stat is None else flower_stat.median / secure.median,
                "quant err": quant_std, "err bound (std)": runs[0]["result"].error_std,
                "max err": float(np.abs(error).max()), "bound (max)": runs[0]["result"].error_max,
                "DP std": dp_std, "DP std / quant err": dp_std / quant_std,
                "Flower max err": None if flower is None else flower["runs"][0]["max_abs_error"],
            })
    section.goals.append(Goal("quantisation error below DP noise (smallest DP std / quant err std)",
                              round(min(noise_margins), 1), "≥ 100", min(noise_margins) >= 100))
    section.goals.append(Goal("secure round / plain weighted sum (largest)", round(max(ratios_plain), 1),
                              "reported (no target)", None, "the masks' PRG and the unmasking dominate"))
    section.goals.append(Goal("Flower's SecAgg+ time / ours (smallest)",
                              round(min(ratios_flower), 2) if ratios_flower else None, "> 1",
                              (min(ratios_flower) > 1) if ratios_flower else None))
    section.seconds = time.perf_counter() - started
    return section
