"""Benchmark 1: weighted averaging of K updates of P float32 parameters (FedAvg and DWFed weights).

Measured in one process, on the same inputs: the memory-bandwidth floor (numpy reading the K·P·4
bytes once, `np.add.reduce` per update), our incremental `RunningWeightedMean` (one update at a time,
as the aggregation service folds uploads), our in-memory `weighted_mean_of_rows` (selection/alignment
rounds), a naive mean (model-sized float64 temporaries) and Flower's
`flwr.server.strategy.aggregate.aggregate`. Updates are a pool of distinct buffers, together three
times the L3 cache, handed out round-robin: every read comes from memory and K = 50 × 10M (2 GB of
updates) needs only the pool. The service receives each upload into a row of the mean, so ours are
timed on rows: each update is copied into the row (standing for the receive, untimed) and then read
out of the cache (untimed) before the mean's calls are timed. Peak memory is tracemalloc's peak during
one call (numpy reports its allocations to tracemalloc), in units of one update (P·4 bytes).

Flower needs protobuf < 7 and fedbroker protobuf 7, so `python -m bench` runs this module with the
interpreter of `.venv-bench` (`make bench-env`) when there is one; this module imports only numpy and
`aggregators.mean` (numpy, scipy's BLAS, threadpoolctl) and `fedbroker.app.glibc_malloc` (ctypes).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.harness import Goal, Section, Stat
from fedbroker.aggregators.mean import ROWS, Layout, RunningWeightedMean, UpdateRows, weighted_mean_of_rows
from fedbroker.app.glibc_malloc import keep_freed_memory

GB = 1e9


def l3_bytes() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
        return int(text.rstrip("KMG")) * unit
    except (OSError, ValueError):
        return 32 << 20


def naive_running_mean(updates: list[np.ndarray], weights: np.ndarray) -> np.ndarray:
    """The incremental mean with model-sized float64 temporaries (our first version), for comparison."""
    acc = np.zeros(updates[0].shape, dtype=np.float64)
    for arr, w in zip(updates, weights):
        acc += np.multiply(arr, float(w), dtype=np.float64)
    return (acc / float(np.sum(weights))).astype(np.float32)


def flower_aggregate() -> Callable[..., Any] | None:
    try:
        from flwr.server.strategy.aggregate import aggregate
    except Exception:  # not installed here (the main venv): the bench says so
        return None
    return aggregate


def interleaved(methods: list[tuple[str, Callable[[], Any]]], *, repeats: int, warmup: int = 2) -> dict[str, list[float]]:
    """Seconds per method, the methods taking turns within each repeat.

    Every method allocates (Flower a copy of each update, ours the accumulators) and glibc's heap
    adapts to what ran before; taking turns, after `warmup` unrecorded rounds, gives every method the
    same steady-state heap a long-running service has, instead of favouring whichever runs last.
    """
    out: dict[str, list[float]] = {name: [] for name, _ in methods}
    for i in range(warmup + repeats):
        for name, fn in methods:
            elapsed = timed(fn)
            if i >= warmup:
                out[name].append(elapsed)
    return out


def timed(fn: Callable[[], Any]) -> float:
    """Wall-clock seconds of one call (gc off), or the seconds a self-timed method returns (a float)."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    return result if isinstance(result, float) else elapsed


def peak_traced(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    del result
    return peak


def run(*, quick: bool) -> Section:
    started = time.perf_counter()
    # A long-running service's heap keeps freed memory; without it, the first configuration in a process
    # measured Flower (K fresh copies per call) up to 5x slower from page faults alone.
    kept = keep_freed_memory(mmap_threshold=32 << 20, trim_threshold=1 << 30)
    section = Section(
        "averaging", "1. Weighted averaging",
        "Throughput of a weighted mean of K updates × P float32 parameters (GB/s of update data read), against "
        "the bandwidth floor (numpy `add.reduce` streaming the same K·P·4 bytes) and Flower's `aggregate` on the "
        "same inputs in the same process. `incremental` = `RunningWeightedMean` (the service's FedAvg/DWFed path, "
        "one update at a time, received into its rows), `in-memory` = `weighted_mean_of_rows` (rounds that keep every "
        "update), `naive` = float64 whole-array temporaries (the first version of the incremental mean). Peak memory = tracemalloc peak during the call ÷ one update (P·4 B).",
    )
    aggregate = flower_aggregate()
    if aggregate is None:
        section.notes.append("Flower is not importable in this interpreter (run `make bench-env`): no Flower baseline.")
    else:
        import flwr

        section.notes.append(f"Flower {flwr.__version__} (`flwr.server.strategy.aggregate.aggregate`).")
    sizes = [(10, 1_000_000)] if quick else [(10, 1_000_000), (50, 1_000_000), (10, 10_000_000), (50, 10_000_000)]
    weightings = ["fedavg", "dwfed"]
    # quick mode (tests/house/test_bench_quick.py) asks for a finite number, not a settled one: one timed round
    repeats, warmup = (1, 0) if quick else (5, 2)
    cache = l3_bytes()
    rng = np.random.default_rng(20240601)
    worst: dict[str, list[tuple[float, str]]] = {"incremental_floor": [], "inmemory_floor": [], "incremental_flower": [],
                                                 "inmemory_flower": []}
    peaks: dict[tuple[str, int, int], float] = {}
    warmed = False
    scratch = np.ones(3 * cache // 4, dtype=np.float32)

    def evict() -> None:
        """Read 3× the L3 cache of other data, so what was just written is read back from memory."""
        np.add.reduce(scratch)

    for k, p in sizes:
        pool_n = max(2, math.ceil(3 * cache / (4 * p)))
        pool = [rng.standard_normal(p, dtype=np.float32) for _ in range(pool_n)]
        cursor = iter(range(1 << 30))

        def batch(k: int = k, pool: list[np.ndarray] = pool) -> list[np.ndarray]:
            """The next K updates of the pool: each call starts where the last one stopped, so what it
            reads was not touched by the call before and is out of the cache."""
            start = next(cursor) * k
            return [pool[(start + i) % len(pool)] for i in range(k)]

        data_gb = k * p * 4 / GB
        for weighting in weightings:
            if weighting == "fedavg":  # sample counts, as Flower's num_examples
                counts = rng.integers(50, 2000, size=k)
                weights = counts.astype(np.float64)
                flower_weights: list[Any] = [int(c) for c in counts]
            else:  # DWFed: each worker's ISH in (0, 1]
                weights = rng.uniform(0.2, 1.0, size=k)
                flower_weights = [float(w) for w in weights]

            def floor() -> None:
                for u in batch():
                    np.add.reduce(u)

            layout = Layout({"w": (p,)})

            def incremental() -> float:
                """Seconds in the mean's own calls; each update is first copied into the row the mean
                reserved (the upload's receive, untimed) and then pushed out of the cache (untimed)."""
                spent = 0.0
                mean = RunningWeightedMean()
                for u, w in zip(batch(), weights):
                    t0 = time.perf_counter()
                    slot = mean.reserve(layout)
                    spent += time.perf_counter() - t0
                    assert slot is not None
                    np.copyto(slot.values, u)
                    evict()
                    t0 = time.perf_counter()
                    mean.add({"w": slot.values}, float(w), slot=slot)
                    spent += time.perf_counter() - t0
                t0 = time.perf_counter()
                mean.result()
                return spent + time.perf_counter() - t0

            def in_memory() -> float:
                """Seconds of `weighted_mean_of_rows` over K updates already received into rows (untimed)."""
                rows = UpdateRows(p, per_block=ROWS)
                slots = []
                for u in batch():
                    slot = rows.take()
                    assert slot is not None
                    np.copyto(slot.values, u)
                    slots.append(slot)
                evict()
                t0 = time.perf_counter()
                weighted_mean_of_rows(rows, slots, weights, layout)
                return time.perf_counter() - t0

            def naive() -> np.ndarray:
                return naive_running_mean(batch(), weights)

            def flower() -> Any:
                assert aggregate is not None
                return aggregate([([u], w) for u, w in zip(batch(), flower_weights)])

            methods: list[tuple[str, Callable[[], Any]]] = [
                ("floor", floor), ("incremental", incremental), ("in-memory", in_memory), ("naive", naive),
            ]
            if aggregate is not None:
                methods.append(("flower", flower))
            if not warmed and not quick:  # the first configuration of a process runs slow for a while (heap growth,
                deadline = time.perf_counter() + 3.0  # page faults); let it settle first
                while time.perf_counter() < deadline:
                    interleaved(methods, repeats=1, warmup=0)
                warmed = True
            times = {name: Stat.of(values, "s") for name, values in interleaved(methods, repeats=repeats, warmup=warmup).items()}
            if aggregate is not None:  # same answer on the same inputs, or the comparison is meaningless
                same = batch()
                mean = RunningWeightedMean()
                for u, w in zip(same, weights):
                    mean.add({"w": u}, float(w))
                ours, theirs = mean.result()["w"], aggregate([([u], w) for u, w in zip(same, flower_weights)])[0]
                if not np.allclose(ours, theirs, rtol=1e-4, atol=1e-5):
                    section.notes.append(f"K={k} P={p} {weighting}: Flower's mean differs from ours!")
            for name, fn in methods:
                peak = 0.0 if name == "floor" else peak_traced(fn) / (p * 4)
                peaks[(name, k, p)] = max(peaks.get((name, k, p), 0.0), peak)
                t = times[name]
                floor_ratio = times["floor"].median / t.median
                flower_ratio = times["flower"].median / t.median if "flower" in times else None
                section.rows.append({
                    "weights": weighting, "K": k, "P": f"{p / 1e6:g}M", "method": name,
                    "time (s)": t, "GB/s": t.inverse(data_gb, "GB/s"),
                    "% of floor": round(100 * floor_ratio, 1),
                    "× Flower": None if flower_ratio is None else round(flower_ratio, 2),
                    "peak mem (× update)": round(peak, 2),
                })
                label = f"K={k} P={p / 1e6:g}M {weighting}"
                if name == "incremental":
                    worst["incremental_floor"].append((floor_ratio, label))
                    if flower_ratio is not None:
                        worst["incremental_flower"].append((flower_ratio, label))
                if name == "in-memory":
                    worst["inmemory_floor"].append((floor_ratio, label))
                    if flower_ratio is not None:
                        worst["inmemory_flower"].append((flower_ratio, label))
        del pool
    for key, target, name, factor in [
        ("incremental_floor", "≥ 80 %", "incremental mean, % of the bandwidth floor", 100),
        ("inmemory_floor", "≥ 80 %", "in-memory mean, % of the bandwidth floor", 100),
        ("incremental_flower", "≥ 2×", "incremental mean vs Flower's aggregate (throughput ×)", 1),
        ("inmemory_flower", "≥ 2×", "in-memory mean vs Flower's aggregate (throughput ×)", 1),
    ]:
        cells = worst[key]
        if not cells:
            section.goals.append(Goal(name, None, target, None, "no Flower baseline in this run"))
            continue
        low, where = min(cells)
        best, best_where = max(cells)
        threshold = 0.8 if factor == 100 else 2.0
        section.goals.append(Goal(name, round(low * factor, 2), target, low >= threshold,
                                  f"worst {where}; best {best * factor:.3g} at {best_where}"))
    ks = sorted({k for k, _ in sizes})
    ps = sorted({p for _, p in sizes})
    growth = [peaks[("incremental", ks[-1], p)] / peaks[("incremental", ks[0], p)]
              for p in ps if ("incremental", ks[0], p) in peaks and peaks[("incremental", ks[0], p)] > 0]
    inc_peak = max(peaks[("incremental", k, p)] for k, p in sizes)
    section.goals.append(Goal(
        "incremental peak memory independent of K (peak at the largest K ÷ peak at the smallest)",
        round(max(growth), 3) if growth and len(ks) > 1 else None, "≈ 1", (max(growth) < 1.1) if growth and len(ks) > 1 else None,
        f"peak ≤ {inc_peak:.2f}× one update: the rows updates are received into (≤ {ROWS}, ≤ 512 MiB) and the "
        "float32 sum, which becomes the result",
    ))
    if kept:
        section.notes.append("glibc keeps freed memory (M_TRIM_THRESHOLD 1 GiB, M_MMAP_THRESHOLD 32 MiB): the "
                             "steady state of a long-running service; without it, the first configuration in a "
                             "process measured Flower up to 5× slower from page faults alone.")
    section.notes.append(
        f"Update pool: distinct buffers totalling ≥ 3× the {cache >> 20} MiB L3 cache, handed out round-robin with each "
        "call starting where the previous one stopped, so every method reads from memory, never from cache."
    )
    section.seconds = time.perf_counter() - started
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", required=True, help="write the section here")
    args = parser.parse_args()
    section = run(quick=args.quick)
    with open(args.json, "w") as f:
        json.dump(section.to_json(), f, allow_nan=False)


if __name__ == "__main__":
    main()
