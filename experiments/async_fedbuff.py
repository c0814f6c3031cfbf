"""Synchronous rounds vs asynchronous FedBuff, in wall-clock time, with workers of different speeds.

`make experiment-async` (or `python -m experiments.async_fedbuff [--quick]`). The real system runs in this
process: the aggregation service on loopback gRPC, the coordinator and `WORKERS` workers on the in-process
bus, every worker training on its digits shard under DP (Opacus, its own policy). Each worker's training
steps are slowed by a per-step delay drawn once per seed from a log-normal whose slowest decile is 10× its
fastest (σ = ln 10 / (2·1.2816)), so a synchronous round waits for its slowest worker while FedBuff keeps
the fast ones busy. Both modes get the same worker-compute budget: ROUNDS synchronous rounds of every
worker make ROUNDS × WORKERS local trainings; the async job publishes ROUNDS × WORKERS / BUFFER versions
of BUFFER updates each. Reported per mode and seed: wall-clock seconds to 0.80 and 0.85 test accuracy (the
coordinator's held-out split) and the final accuracy; a table and a plot in experiments/results/.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import fedbroker.worker.agent
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.bus import MemoryBroker, open_bus
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig
from fedbroker.coordinator.evaluation import evaluate_global
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.job.spec import parse_job
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.worker.agent import WorkerAgent

RESULTS = Path(__file__).resolve().parent / "results"
WORKERS = 12
ROUNDS = 10
BUFFER = 4
MEDIAN_STEP_DELAY_S = 0.05
SIGMA = math.log(10.0) / (2 * 1.2815515655446004)   # q90 / q10 of the delays = 10
TARGETS = (0.80, 0.85)
POLICY = DPPolicy(noise_multiplier=0.8, max_grad_norm=1.0, delta=1e-5, epsilon_budget=1000.0)


def step_delays(seed: int, workers: int) -> dict[str, float]:
    """Each worker's delay per training step, seeded (the same for both modes of a seed)."""
    rng = np.random.default_rng(10_000 + seed)
    draws = rng.lognormal(mean=math.log(MEDIAN_STEP_DELAY_S), sigma=SIGMA, size=workers)
    return {f"w{i:02d}": float(d) for i, d in enumerate(draws)}


class SlowSteps:
    """Wraps the workers' train_local: each step of worker w sleeps delays[w]. The worker is known by the bus's
    handler thread it trains on, whose name ends in `.<worker id>` (`bus-handler-<ns>.worker.w03` on the
    in-process bus, `bus-handler-tasks.w03` on RabbitMQ); a thread it cannot place is an error, never a worker
    without delay (an earlier version matched only RabbitMQ's names and ran every worker at full speed)."""

    def __init__(self, delays: dict[str, float]) -> None:
        self.delays = delays
        self.real = fedbroker.worker.agent.train_local
        self.sleep = time.sleep

    def delay(self) -> float:
        name = threading.current_thread().name
        worker_id = name.rsplit(".", 1)[-1]
        if not name.startswith("bus-handler-") or worker_id not in self.delays:
            raise RuntimeError(f"training on thread {name!r}, which names none of the workers {sorted(self.delays)}")
        return self.delays[worker_id]

    def __call__(self, *args: Any, progress: Callable[[int, int], None] | None = None, **kwargs: Any) -> Any:
        delay = self.delay()

        def slow(step: int, total: int) -> None:
            self.sleep(delay)
            if progress is not None:
                progress(step, total)

        return self.real(*args, progress=slow, **kwargs)


def job(mode: str, seed: int, rounds: int, workers: int) -> dict[str, Any]:
    schedule: dict[str, Any] = {"min_workers": workers, "wait_for_workers_s": 60, "round_timeout_s": 600}
    versions = rounds
    if mode == "async":
        versions = rounds * workers // BUFFER
        schedule.update(mode="async", buffer_size=BUFFER, max_staleness=2 * workers // BUFFER + 2,
                        staleness="polynomial", staleness_params={"a": 0.5})
    return {
        "name": f"exp-{mode}", "category": "digits", "seed": seed,
        "model": {"input_shape": [1, 8, 8], "layers": [
            {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 64}, {"type": "ReLU"},
            {"type": "Linear", "in_features": 64, "out_features": 10}]},
        "training": {"rounds": versions, "local_epochs": 2, "batch_size": 16, "lr": 0.5},
        "schedule": schedule,
        # central scores only, the protocol as measured (the sites' scores would load async's many versions more)
        "evaluation": {"dataset": "digits", "every": 0},
    }


def run_once(mode: str, seed: int, rounds: int, workers: int) -> dict[str, Any]:
    """One federation; the accuracy curve in wall-clock seconds from the job's submission."""
    delays = step_delays(seed, workers)
    original = fedbroker.worker.agent.train_local
    fedbroker.worker.agent.train_local = SlowSteps(delays)
    namespace = f"exp-async-{mode}-{seed}-{int(time.time() * 1000)}"
    tmp = tempfile.TemporaryDirectory(prefix="fedbroker-exp-")
    book = RoundBook()
    server, port = serve(book)
    target = f"127.0.0.1:{port}"
    bus = open_bus(None, namespace=namespace)
    store = StateStore(str(Path(tmp.name) / "coordinator.sqlite"))
    coordinator = Coordinator(bus=bus, store=store, aggregator=AggregatorClient(target), aggregator_target=target,
                              checkpoint_dir=str(Path(tmp.name) / "checkpoints"), evaluator=evaluate_global,
                              poll_interval_s=0.1)
    agents: list[WorkerAgent] = []
    try:
        coordinator.start()
        bus.start()
        for i, worker_id in enumerate(sorted(delays)):
            agent = WorkerAgent(WorkerConfig(
                id=worker_id, partition=PartitionSection(scheme="iid", num_clients=workers, client_index=i, seed=seed),
                dp=POLICY, ledger_path=str(Path(tmp.name) / f"{worker_id}.json"), device="cpu", heartbeat_s=1.0,
                torch_threads=1), open_bus(None, namespace=namespace))
            agent.start()
            agent.bus.start()
            agents.append(agent)
        job_id = coordinator.submit(parse_job(job(mode, seed, rounds, workers)))
        submitted = float(store.job(job_id).created)
        status = coordinator.wait(job_id, timeout=1800)
        if status != "completed":
            raise RuntimeError(f"{mode} seed {seed}: job {status}: {store.job(job_id).error}")
        rows = store.rounds(job_id)
        curve = [(float(r.closed) - submitted, float(r.accuracy)) for r in rows]  # both from the submission
        trainings = sum(1 for p in store.participants(job_id) if p.status in ("aggregated", "uploaded"))
        return {"mode": mode, "seed": seed, "curve": curve, "final_accuracy": curve[-1][1],
                "seconds": curve[-1][0], "rows": len(rows), "recorded_updates": trainings,
                "time_to": {f"{t:.2f}": next((s for s, a in curve if a >= t), None) for t in TARGETS}}
    finally:
        coordinator.stop()
        for agent in agents:
            agent.stop()
            agent.bus.close()
        bus.close()
        server.stop(grace=0)
        store.close()
        MemoryBroker.forget(namespace)
        fedbroker.worker.agent.train_local = original
        tmp.cleanup()


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for mode in ("sync", "async"):
        mine = [r for r in runs if r["mode"] == mode]
        row: dict[str, Any] = {"mode": mode, "seeds": len(mine)}
        for t in TARGETS:
            times = [r["time_to"][f"{t:.2f}"] for r in mine]
            reached = [x for x in times if x is not None]
            row[f"s to {t:.2f}"] = (round(float(np.median(reached)), 1) if len(reached) == len(times) else None)
            row[f"reached {t:.2f}"] = f"{len(reached)}/{len(times)}"
        finals = [r["final_accuracy"] for r in mine]
        row["final accuracy"] = f"{np.mean(finals):.4f} ± {np.std(finals):.4f}"
        row["wall-clock s"] = round(float(np.median([r["seconds"] for r in mine])), 1)
        rows.append(row)
    return rows


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    colours = {"sync": "tab:blue", "async": "tab:orange"}
    for r in runs:
        xs, ys = zip(*r["curve"]) if r["curve"] else ((), ())
        ax.plot(xs, ys, color=colours[r["mode"]], alpha=0.75, marker="." if r["mode"] == "sync" else None,
                label=f"{r['mode']} (seed {r['seed']})")
    for t in TARGETS:
        ax.axhline(t, color="grey", linestyle=":", linewidth=0.8)
    ax.set_xlabel("wall-clock seconds since the job started")
    ax.set_ylabel("global test accuracy (digits)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    ax.set_title(f"sync rounds vs FedBuff: {WORKERS} DP workers, step delays 10× apart (q90/q10)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, 4 rounds' worth (a smoke run)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    from tqdm import tqdm

    seeds = [0] if args.quick else [0, 1, 2]
    rounds = 4 if args.quick else ROUNDS
    runs = []
    with tqdm(total=2 * len(seeds), desc="federations", unit="run") as bar:
        for seed in seeds:
            for mode in ("sync", "async"):
                bar.set_postfix_str(f"{mode}, seed {seed}")
                runs.append(run_once(mode, seed, rounds, WORKERS))
                bar.update(1)
    table = summarise(runs)
    RESULTS.mkdir(exist_ok=True)
    name = "async_quick" if args.quick else "async"
    (RESULTS / f"{name}.json").write_text(json.dumps({
        "workers": WORKERS, "rounds": rounds, "buffer_size": BUFFER, "median_step_delay_s": MEDIAN_STEP_DELAY_S,
        "sigma": SIGMA, "dp": vars(POLICY), "table": table, "runs": runs}, indent=2, default=str))
    plot(runs, RESULTS / f"{name}.png")
    head = list(table[0])
    widths = [max(len(h), *(len(str(r[h])) for r in table)) for h in head]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for r in table:
        print("  ".join(str(r[h]).rjust(w) for h, w in zip(head, widths)))
    print(f"table: {RESULTS / (name + '.json')}   plot: {RESULTS / (name + '.png')}")


if __name__ == "__main__":
    main()
