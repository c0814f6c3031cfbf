"""Weighting and selection experiments: DWFed (ISH weights) vs FedAvg, and GA base-model selection vs random.

    python -m experiments.weighting_selection            # full run (~12 min on 2 cores) → experiments/results/
    python -m experiments.weighting_selection --quick    # smoke run (~1 min) into a temporary folder unless --out

1. DWFed protocol (Chen et al. 2022, §4.1): 100 workers, 1-class and 2-class non-IID, fraction C of 0.1 and 0.2,
   FedAvg vs DWFed under both readings of eq. 12; FedAvg on an IID split as the paper's reference curve.
2. Base-model protocol (Wang et al. 2025, §5): 50 workers that all train every round, 10 of them aggregated,
   chosen by the GA every `ga_gap` rounds (random in between) vs at random every round; Dirichlet 0.1 / 0.5 and
   IID; FedAvg and FedProx local training.

Every run goes through `experiments.harness.simulate`, i.e. the service's RoundBook and trainer. Paired design:
within a seed every method sees the same partition, initial weights, participants and batch orders, and the GA and
random runs draw the same random subsets in non-GA rounds, so a difference comes from the algorithm alone.
Hyper-parameters are fixed in the protocol dataclasses below, chosen before any comparison was run, and are
printed in each table's caption; none was tuned per method.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from typing import Any

import numpy as np

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PREFIX = "weighting_selection"


# ---------------------------------------------------------------- protocols (fixed up front)

@dataclass(frozen=True)
class DWFedProtocol:
    """DWFed §4.1 on digits. The paper's B=10, E=5 and 100 rounds (its MNIST ncom) are kept; its CNN becomes a
    64-32-10 MLP and η=0.01 becomes 0.1 (the tiny MLP on 14 samples per worker barely moves at 0.01 in 100
    rounds); targets 0.6 and 0.8 are the paper's two accuracy levels (§4.2)."""

    dataset: str = "digits"
    workers: int = 100
    classes_per_client: tuple[int, ...] = (1, 2)
    clients_per_round: tuple[int, ...] = (10, 20)
    seeds: tuple[int, ...] = (0, 1, 2)
    rounds: int = 100
    hidden: int = 32
    lr: float = 0.1
    batch_size: int = 10
    epochs: int = 5
    targets: tuple[float, ...] = (0.6, 0.8)
    tail: int = 20  # fluctuation = std (and mean |Δ|) of test accuracy over the last `tail` rounds
    iid_reference: bool = True
    # Ours, beyond the paper: a Dirichlet split, where D_k (and sample counts) really differ between workers, at
    # the smaller fraction only (time budget); each worker keeps at least 2 samples (100 workers share 1,437).
    dirichlet_alpha: tuple[float, ...] = (0.5,)
    dirichlet_clients_per_round: tuple[int, ...] = (10,)
    min_size: int = 2
    methods: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: {
        "FedAvg": {"weighting": "fedavg"},
        "DWFed (ratio)": {"weighting": "dwfed", "weighting_params": {"ish_form": "ratio"}},
        "DWFed (one_minus)": {"weighting": "dwfed", "weighting_params": {"ish_form": "one_minus"}},
    })


@dataclass(frozen=True)
class GAProtocol:
    """Base-model selection §5.1 (Table 1: 50 clients, 10 aggregated, population 100, keep 50 %, mutation 0.1,
    GA every 10 rounds) on digits; generations 20 and μ=0.2 are the `ga` defaults (docs/algorithms.md). Two GA
    arms: `fitness: probe` (the paper's reading: feature cosine + the aggregate's cross-entropy on a probe set)
    and `fitness: reported_loss` (parameter cosine + reported train losses). The probe set is `probe_size`
    samples (stratified) taken out of the training split before it is partitioned, in every arm, so it is
    no worker's data and not the test set. E=2 (not 5) keeps 50 trainings per round in the time budget; FedAvg
    local training only, 30 rounds (GA in rounds 10, 20, 30) and the two Dirichlet splits, to fit ~10 min
    on 2 shared cores. Each worker holds at least 2 samples (Dir(0.1) over 50 workers of digits leaves some
    with only a handful)."""

    dataset: str = "digits"
    workers: int = 50
    m: int = 10
    partitions: tuple[tuple[str, float], ...] = (("dirichlet", 0.1), ("dirichlet", 0.5))
    seeds: tuple[int, ...] = (0, 1, 2)
    rounds: int = 30
    ga_gap: int = 10
    population: int = 100
    generations: int = 20
    mu: float = 0.2
    fitnesses: tuple[str, ...] = ("probe", "reported_loss")
    probe_size: int = 100
    hidden: int = 32
    lr: float = 0.1
    batch_size: int = 10
    epochs: int = 2
    frameworks: Mapping[str, float] = field(default_factory=lambda: {"FedAvg": 0.0})
    targets: tuple[float, ...] = (0.8, 0.9)
    tail: int = 10
    min_size: int = 2  # samples per worker at least; Dir(0.1) over 50 workers cannot give every one 10


def quick_protocols() -> tuple[DWFedProtocol, GAProtocol]:
    return (DWFedProtocol(classes_per_client=(2,), clients_per_round=(10,), seeds=(0,), rounds=5, tail=3,
                          iid_reference=False),
            GAProtocol(partitions=(("dirichlet", 0.5),), seeds=(0,), rounds=6, ga_gap=3, population=20,
                       generations=5, tail=3))


# ---------------------------------------------------------------- one run (in a pool process)

def mlp(hidden: int) -> dict[str, Any]:
    return {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": hidden}, {"type": "ReLU"},
        {"type": "Linear", "in_features": hidden, "out_features": 10}]}


@dataclass(frozen=True)
class Task:
    """One simulated federation: a partition, a seed and a job; `key` names its cell in the tables."""

    key: tuple[Any, ...]
    seed: int
    scheme: str
    workers: int
    alpha: float
    classes_per_client: int
    job: Mapping[str, Any]
    cost: float  # trainings, to start the longest runs first
    min_size: int | None = None  # None: the harness's default split
    probe_size: int = 0  # samples taken out of the training split for the service's probe set (0: none)


def _init_pool() -> None:
    import torch

    torch.set_num_threads(1)  # tiny models: one intra-op thread per process is fastest on 2 cores


def make_task_workers(task: Task) -> tuple[list[Any], Any]:
    """The task's virtual workers and test set (see `make_task_split`)."""
    workers, test, _ = make_task_split(task)
    return workers, test


def make_task_split(task: Task) -> tuple[list[Any], Any, Any]:
    """The task's virtual workers, test set and probe set (None unless `probe_size`): the harness's own
    split, except that `min_size` can be lowered and a probe set can be taken out of the training split.

    The harness asks every worker for at least 10 samples; no Dirichlet(0.1) draw over 50 workers (nor many
    Dirichlet(0.5) draws over 100) of digits' 1,437 training samples satisfies that, so the Dirichlet splits fix
    min_size=2 (same test split, same partitioner, same worker ids as `make_workers`).
    """
    from experiments.harness import VirtualWorker, make_workers
    from fedbroker.datasets import load_dataset, train_test_split
    from fedbroker.worker.partition import partition

    alpha = task.alpha or 0.5
    if task.min_size is None and not task.probe_size:
        workers, test = make_workers("digits", num_workers=task.workers, scheme=task.scheme, seed=task.seed,
                                     alpha=alpha, classes_per_client=task.classes_per_client)
        return workers, test, None
    train, test = train_test_split(load_dataset("digits"), test_fraction=0.2, seed=task.seed)
    probe = None
    if task.probe_size:
        train, probe = train_test_split(train, test_fraction=task.probe_size / len(train), seed=task.seed + 1)
    parts = partition(train.y, scheme=task.scheme, num_clients=task.workers, seed=task.seed, alpha=alpha,
                      classes_per_client=task.classes_per_client, min_size=task.min_size or 10)
    width = max(2, len(str(task.workers - 1)))
    return [VirtualWorker(f"w{i:0{width}d}", train.x[idx], train.y[idx], train.num_classes)
            for i, idx in enumerate(parts)], test, probe


def run_task(task: Task) -> dict[str, Any]:
    """Simulate one federation and keep every per-round number the tables and plots need."""
    try:
        return _run_task(task)
    except Exception as exc:  # some project errors do not survive pickling back from a pool process
        raise RuntimeError(f"run {task.key} seed {task.seed} failed: {type(exc).__name__}: {exc}") from None


def _run_task(task: Task) -> dict[str, Any]:
    from experiments.harness import simulate

    workers, test, probe = make_task_split(task)
    started = time.perf_counter()
    sim = simulate(dict(task.job), workers, test, progress=False, metrics=lambda model, data: {}, probe=probe)
    keep = ("selection_ga_ran", "selection_seconds", "selection_fitness", "selection_loss1", "selection_loss2",
            "selection_fallback", "weighting_fallback", "aggregated")
    return {
        "key": list(task.key), "seed": task.seed, "seconds": time.perf_counter() - started,
        "accuracy": [r.accuracy for r in sim.rounds], "loss": [r.loss for r in sim.rounds],
        "train_loss": [r.train_loss for r in sim.rounds],
        "stats": [{k: r.stats[k] for k in keep if k in r.stats} for r in sim.rounds],
    }


def run_all(tasks: Sequence[Task], *, jobs: int, progress: bool) -> list[dict[str, Any]]:
    from tqdm import tqdm

    ordered = sorted(tasks, key=lambda t: -t.cost)
    if jobs <= 1:
        _init_pool()
        return [run_task(t) for t in tqdm(ordered, desc="runs", disable=not progress)]
    out = []
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_init_pool) as pool:
        futures = [pool.submit(run_task, t) for t in ordered]
        for future in tqdm(as_completed(futures), total=len(futures), desc="runs", disable=not progress):
            out.append(future.result())
    return out


# ---------------------------------------------------------------- building the runs

def _job(name: str, seed: int, *, hidden: int, rounds: int, lr: float, batch_size: int, epochs: int,
         clients_per_round: int, aggregation: Mapping[str, Any], proximal_mu: float = 0.0) -> dict[str, Any]:
    return {
        "name": name, "category": "digits", "seed": seed, "model": mlp(hidden),
        "training": {"rounds": rounds, "local_epochs": epochs, "batch_size": batch_size, "lr": lr,
                     "proximal_mu": proximal_mu},
        "aggregation": dict(aggregation), "schedule": {"clients_per_round": clients_per_round},
    }


@dataclass(frozen=True)
class Split:
    """One data split of the DWFed protocol and the fractions it runs at."""

    name: str
    scheme: str
    alpha: float
    classes_per_client: int
    min_size: int | None
    clients_per_round: tuple[int, ...]
    methods: tuple[str, ...]


def dwfed_splits(p: DWFedProtocol) -> list[Split]:
    methods = tuple(p.methods)
    splits = [Split(f"{c}-class", "classes", 0.0, c, None, p.clients_per_round, methods) for c in p.classes_per_client]
    splits += [Split(f"Dir(α={a:g})", "dirichlet", a, 2, p.min_size, p.dirichlet_clients_per_round, methods)
               for a in p.dirichlet_alpha]
    if p.iid_reference:
        splits.append(Split("IID", "iid", 0.0, 2, None, p.clients_per_round, ("FedAvg",)))
    return splits


def dwfed_tasks(p: DWFedProtocol) -> list[Task]:
    tasks = []
    common = {"hidden": p.hidden, "rounds": p.rounds, "lr": p.lr, "batch_size": p.batch_size, "epochs": p.epochs}
    for split in dwfed_splits(p):
        for k in split.clients_per_round:
            for seed in p.seeds:
                for method in split.methods:
                    job = _job("dwfed", seed, clients_per_round=k, aggregation=p.methods[method], **common)
                    tasks.append(Task((split.name, k, method), seed, split.scheme, p.workers, split.alpha,
                                      split.classes_per_client, job, p.rounds * k, split.min_size))
    return tasks


def ga_arms(p: GAProtocol) -> list[str]:
    return ["random"] + [f"ga ({f})" for f in p.fitnesses]


def ga_tasks(p: GAProtocol) -> list[Task]:
    tasks = []
    for framework, mu in p.frameworks.items():
        for scheme, alpha in p.partitions:
            for seed in p.seeds:
                for arm in ga_arms(p):
                    params: dict[str, Any] = {"m": p.m}
                    selection = "random" if arm == "random" else "ga"
                    if selection == "ga":
                        fitness = arm[len("ga ("):-1]
                        params.update(ga_gap=p.ga_gap, population=p.population, generations=p.generations, mu=p.mu,
                                      fitness=fitness)
                        if fitness == "probe":
                            params.update(probe_dataset=p.dataset, probe_size=p.probe_size)
                    job = _job("ga", seed, hidden=p.hidden, rounds=p.rounds, lr=p.lr, batch_size=p.batch_size,
                               epochs=p.epochs, clients_per_round=0, proximal_mu=mu,
                               aggregation={"selection": selection, "selection_params": params})
                    tasks.append(Task((framework, _partition_name(scheme, alpha), arm), seed, scheme,
                                      p.workers, alpha, 2, job, p.rounds * p.workers, p.min_size, p.probe_size))
    return tasks


def _partition_name(scheme: str, alpha: float) -> str:
    return f"Dir(α={alpha:g})" if scheme == "dirichlet" else "IID"


def dwfed_weight_spread(p: DWFedProtocol) -> dict[str, dict[str, float]]:
    """How far DWFed's coefficients are from FedAvg's in the rounds actually sampled (no training needed).

    Under the `classes` split every worker's label distribution is about equally far from P, so ISH, and with
    it the DWFed weights, are nearly uniform; this puts a number on it (and on the Dirichlet split, where they
    are not): the mean total-variation distance
    between the two weight vectors per round, and DWFed's mean max/min weight ratio.
    """
    from fedbroker.aggregators.weighting import DWFedWeighting, UpdateMeta
    from fedbroker.coordinator.participants import sample_participants
    from fedbroker.label_stats import emd, label_distribution, population_distribution

    out: dict[str, dict[str, float]] = {}
    for split in dwfed_splits(p):
        if split.name == "IID":
            continue
        for k in split.clients_per_round:
            tv, ratio, dists = [], [], []
            for seed in p.seeds:
                workers, _ = make_task_workers(Task((), seed, split.scheme, p.workers, split.alpha,
                                                    split.classes_per_client, {}, 0.0, split.min_size))
                by_id = {w.worker_id: w for w in workers}
                population = population_distribution([w.histogram for w in workers])
                distance = {w.worker_id: emd(label_distribution(w.histogram), population) for w in workers}
                dists += list(distance.values())
                dwfed = DWFedWeighting(ish_form="ratio")
                for r in range(1, p.rounds + 1):
                    chosen = sample_participants(list(by_id), k, seed=seed, round_number=r)
                    n = np.array([len(by_id[w].y) for w in chosen], dtype=np.float64)
                    raw = [dwfed.raw_weight(UpdateMeta(w, len(by_id[w].y), ish=dwfed.ish_for(distance[w], k)))
                           for w in chosen]
                    a_dw, _ = dwfed.normalise(np.array(raw))
                    tv.append(0.5 * float(np.abs(a_dw - n / n.sum()).sum()))
                    ratio.append(float(a_dw.max() / a_dw.min()))
            out[f"{split.name} C={k / p.workers:g}"] = {
                "emd_min": float(np.min(dists)), "emd_max": float(np.max(dists)),
                "tv_dwfed_vs_fedavg": float(np.mean(tv)), "dwfed_max_min_ratio": float(np.mean(ratio)),
            }
    return out


# ---------------------------------------------------------------- summaries

def rounds_to(acc: Sequence[float], target: float) -> float:
    """First round (1-based) whose test accuracy reaches `target`; NaN when it never does."""
    hits = np.flatnonzero(np.asarray(acc) >= target)
    return float(hits[0] + 1) if hits.size else math.nan


def run_summary(run: Mapping[str, Any], targets: Sequence[float], tail: int) -> dict[str, float]:
    acc = np.asarray(run["accuracy"], dtype=np.float64)
    last = acc[-tail:]
    out = {"final": float(acc[-1]), "best": float(acc.max()), f"mean_last{tail}": float(last.mean()),
           "fluct_std": float(last.std()), "fluct_absdiff": float(np.abs(np.diff(last)).mean()) if last.size > 1 else 0.0,
           "seconds": float(run["seconds"])}
    for t in targets:
        out[f"rounds_to_{t:g}"] = rounds_to(acc, t)
    ga = [s["selection_seconds"] for s in run["stats"] if s.get("selection_ga_ran", 0.0) > 0]
    out["ga_calls"] = float(len(ga))
    out["ga_seconds_mean"] = float(np.mean(ga)) if ga else math.nan
    ga_rounds = [i for i, s in enumerate(run["stats"]) if s.get("selection_ga_ran", 0.0) > 0]
    out["ga_loss1_mean"] = float(np.mean([run["stats"][i]["selection_loss1"] for i in ga_rounds])) if ga else math.nan
    out["ga_loss2_mean"] = float(np.mean([run["stats"][i].get("selection_loss2", math.nan) for i in ga_rounds])) \
        if ga else math.nan
    out["ga_all_loss_mean"] = float(np.mean([run["train_loss"][i] for i in ga_rounds])) if ga else math.nan
    return out


def _group(runs: Sequence[Mapping[str, Any]]) -> dict[tuple[Any, ...], list[Mapping[str, Any]]]:
    cells: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for run in runs:
        cells.setdefault(tuple(run["key"]), []).append(run)
    for cell in cells.values():
        cell.sort(key=lambda r: r["seed"])
    return cells


def _pm(values: Sequence[float], digits: int = 3) -> str:
    arr = np.asarray(values, dtype=np.float64)
    if arr.size == 0 or np.all(np.isnan(arr)):
        return "—"
    return f"{np.nanmean(arr):.{digits}f} ± {np.nanstd(arr):.{digits}f}"


def _rounds_cell(values: Sequence[float], horizon: int) -> str:
    """Mean ± std over the seeds that reached the target, and how many did (`>R` when none did)."""
    arr = np.asarray(values, dtype=np.float64)
    hit = arr[~np.isnan(arr)]
    if hit.size == 0:
        return f">{horizon} (0/{arr.size})"
    return f"{hit.mean():.1f} ± {hit.std():.1f} ({hit.size}/{arr.size})"


def _ga_round_dip(cells: Mapping[tuple[Any, ...], list[Mapping[str, Any]]], key: tuple[Any, ...],
                 base: tuple[Any, ...]) -> str:
    """Test accuracy right after each GA round minus the random run's in the same round, mean ± std over seeds."""
    if key == base or base not in cells:
        return "—"
    b = {r["seed"]: r for r in cells[base]}
    per_seed = []
    for run in cells[key]:
        rounds = [i for i, st in enumerate(run["stats"]) if st.get("selection_ga_ran", 0.0) > 0]
        if run["seed"] in b and rounds:
            per_seed.append(np.mean([run["accuracy"][i] - b[run["seed"]]["accuracy"][i] for i in rounds]))
    return _pm(per_seed) if per_seed else "—"


def _paired(cells: Mapping[tuple[Any, ...], list[Mapping[str, Any]]], key: tuple[Any, ...], base: tuple[Any, ...],
            metric: str, targets: Sequence[float], tail: int) -> str:
    """Mean ± std of the per-seed difference key − base in `metric`, with wins/seeds (paired by seed)."""
    if key == base or base not in cells:
        return "—"
    a = {r["seed"]: run_summary(r, targets, tail)[metric] for r in cells[key]}
    b = {r["seed"]: run_summary(r, targets, tail)[metric] for r in cells[base]}
    d = np.array([a[s] - b[s] for s in sorted(set(a) & set(b))])
    return f"{d.mean():+.3f} ± {d.std():.3f} ({int((d > 0).sum())}/{d.size} higher)"


def dwfed_table(result: Mapping[str, Any]) -> str:
    p = result["protocol"]
    targets, tail, horizon = p["targets"], p["tail"], p["rounds"]
    cells = _group(result["runs"])
    head = ["partition", "C", "method", "final acc", f"mean acc last {tail}"] + \
        [f"rounds to {t:g}" for t in targets] + [f"fluct. std last {tail}", "fluct. mean abs Δ", "Δ final vs FedAvg (paired)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    split_order = {s.name: i for i, s in enumerate(dwfed_splits(DWFedProtocol(**_protocol_args(p))))}
    for key in sorted(cells, key=lambda k: (split_order[k[0]], k[1], list(p["methods"]).index(k[2]))):
        part, k, method = key
        s = [run_summary(r, targets, tail) for r in cells[key]]
        row = [part, f"{k / p['workers']:g}", method, _pm([x["final"] for x in s]), _pm([x[f"mean_last{tail}"] for x in s])]
        row += [_rounds_cell([x[f"rounds_to_{t:g}"] for x in s], horizon) for t in targets]
        row += [_pm([x["fluct_std"] for x in s]), _pm([x["fluct_absdiff"] for x in s]),
                _paired(cells, key, (part, k, "FedAvg"), "final", targets, tail) if part != "IID" else "—"]
        lines.append("| " + " | ".join(row) + " |")
    caption = (f"DWFed protocol on {p['dataset']}: {p['workers']} workers, `classes` split (1 or 2 classes each; "
               f"the paper's) and Dirichlet α={list(p['dirichlet_alpha'])} (ours, at C="
               f"{[k / p['workers'] for k in p['dirichlet_clients_per_round']]}, ≥{p['min_size']} samples per worker), "
               f"C·{p['workers']} workers per round, all aggregated; MLP 64-{p['hidden']}-10, SGD lr {p['lr']}, "
               f"B={p['batch_size']}, E={p['epochs']}, {p['rounds']} rounds; mean ± std over seeds {list(p['seeds'])}; "
               f"targets {list(targets)} fixed in advance; 'rounds to' averages the seeds that reached it "
               f"(reached/seeds). Fluctuation: std and mean |round-to-round change| of test accuracy over the last "
               f"{tail} rounds. IID = FedAvg on an IID split (the paper's reference).")
    spread = result.get("weight_spread", {})
    lines2 = ["", "How different the weights are (DWFed ratio vs FedAvg, over the rounds actually sampled):", "",
              "| split | EMD D_k range | mean TV distance DWFed↔FedAvg weights | DWFed mean max/min weight |",
              "|---|---|---|---|"]
    for name, v in spread.items():
        lines2.append(f"| {name} | {v['emd_min']:.3f} – {v['emd_max']:.3f} | {v['tv_dwfed_vs_fedavg']:.4f} | "
                      f"{v['dwfed_max_min_ratio']:.3f} |")
    return f"*{caption}*\n\n" + "\n".join(lines) + "\n" + "\n".join(lines2) + "\n"


def ga_table(result: Mapping[str, Any]) -> str:
    p = result["protocol"]
    targets, tail, horizon = p["targets"], p["tail"], p["rounds"]
    cells = _group(result["runs"])
    head = ["framework", "partition", "selection", "final acc", f"mean acc last {tail}"] + \
        [f"rounds to {t:g}" for t in targets] + \
        ["Δ final vs random (paired)", f"Δ mean last {tail} vs random (paired)", "Δ acc in GA rounds (paired)",
         "GA s/call", "GA calls/run",
         "Loss1 of chosen (GA rounds)", "Loss2 of chosen (GA rounds)",
         f"mean reported train loss of all {p['workers']} (GA rounds)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    order = {name: i for i, name in enumerate(_partition_name(s, a) for s, a in p["partitions"])}
    arms = ["random"] + [f"ga ({f})" for f in p.get("fitnesses", ("reported_loss",))]
    for key in sorted(cells, key=lambda k: (list(p["frameworks"]).index(k[0]), order[k[1]], arms.index(k[2]))):
        framework, part, selection = key
        s = [run_summary(r, targets, tail) for r in cells[key]]
        base = (framework, part, "random")
        row = [framework, part, selection, _pm([x["final"] for x in s]), _pm([x[f"mean_last{tail}"] for x in s])]
        row += [_rounds_cell([x[f"rounds_to_{t:g}"] for x in s], horizon) for t in targets]
        row += [_paired(cells, key, base, "final", targets, tail), _paired(cells, key, base, f"mean_last{tail}", targets, tail),
                _ga_round_dip(cells, key, base)]
        if selection != "random":
            row += [_pm([x["ga_seconds_mean"] for x in s]), f"{np.mean([x['ga_calls'] for x in s]):g}",
                    _pm([x["ga_loss1_mean"] for x in s], 4), _pm([x["ga_loss2_mean"] for x in s]),
                    f"{np.mean([x['ga_all_loss_mean'] for x in s]):.3f}"]
        else:
            row += ["—", "0", "—", "—", "—"]
        lines.append("| " + " | ".join(row) + " |")
    caption = (f"Base-model protocol on {p['dataset']}: {p['workers']} workers (≥{p['min_size']} samples each) all train every round, {p['m']} "
               f"aggregated (FedAvg weights) — chosen by the GA every {p['ga_gap']} rounds (random otherwise) or at "
               f"random every round; GA population {p['population']}, {p['generations']} generations, keep 50 %, "
               f"mutation 0.1, μ={p['mu']}; `ga (probe)`: Loss1 = mean cosine between the penultimate features of "
               f"the global and each chosen model on a {p.get('probe_size', 0)}-sample probe set (taken out of the "
               f"training split before partitioning, in every arm), Loss2 = the probe cross-entropy of the chosen "
               f"updates' FedAvg aggregate; `ga (reported_loss)`: Loss1 = mean cosine of the chosen parameter "
               f"vectors to the global one, Loss2 = their size-weighted reported train loss; "
               f"MLP 64-{p['hidden']}-10, SGD lr {p['lr']}, "
               f"B={p['batch_size']}, E={p['epochs']}, {p['rounds']} rounds; FedProx = proximal μ "
               f"{dict(p['frameworks']).get('FedProx', '—')}; mean ± std over seeds {list(p['seeds'])}; targets "
               f"{list(targets)} fixed in advance. GA s/call = `selection_seconds` from the round stats (seconds per "
               f"GA call). Within a seed every arm sees the same partition and draws the same random subsets, so "
               f"the curves coincide until round {p['ga_gap']}.")
    return f"*{caption}*\n\n" + "\n".join(lines) + "\n"


def _protocol_args(p: Mapping[str, Any]) -> dict[str, Any]:
    """A protocol dict (as stored in the JSON) back to DWFedProtocol keyword arguments."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in p.items()}


# ---------------------------------------------------------------- plots

def _curves(ax: Any, runs: Sequence[Mapping[str, Any]], label: str, **style: Any) -> None:
    acc = np.array([r["accuracy"] for r in runs], dtype=np.float64)
    x = np.arange(1, acc.shape[1] + 1)
    mean, std = acc.mean(axis=0), acc.std(axis=0)
    line, = ax.plot(x, mean, label=label, lw=1.2, **style)
    ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.15, lw=0)


def plot_dwfed(result: Mapping[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = result["protocol"]
    cells = _group(result["runs"])
    parts = [s.name for s in dwfed_splits(DWFedProtocol(**_protocol_args(p))) if s.name != "IID"]
    ks = p["clients_per_round"]
    fig, axes = plt.subplots(len(parts), len(ks), figsize=(5.5 * len(ks), 3.6 * len(parts)), squeeze=False)
    for i, part in enumerate(parts):
        for j, k in enumerate(ks):
            ax = axes[i, j]
            if not any(key[0] == part and key[1] == k for key in cells):
                ax.axis("off")
                continue
            for method in p["methods"]:
                if (part, k, method) in cells:
                    _curves(ax, cells[(part, k, method)], method)
            if ("IID", k, "FedAvg") in cells:
                _curves(ax, cells[("IID", k, "FedAvg")], "FedAvg, IID split", ls="--", color="grey")
            ax.set_title(f"{part} non-IID, C={k / p['workers']:g}", fontsize=10)
            ax.set_xlabel("round")
            ax.set_ylabel("test accuracy")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"DWFed vs FedAvg, {p['workers']} workers on {p['dataset']}, mean ± std over "
                 f"{len(p['seeds'])} seeds", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_ga(result: Mapping[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = result["protocol"]
    cells = _group(result["runs"])
    frameworks = list(p["frameworks"])
    parts = [_partition_name(s, a) for s, a in p["partitions"]]
    fig, axes = plt.subplots(len(frameworks), len(parts), figsize=(4.8 * len(parts), 3.5 * len(frameworks)),
                             squeeze=False)
    for i, framework in enumerate(frameworks):
        for j, part in enumerate(parts):
            ax = axes[i, j]
            for arm in ["random"] + [f"ga ({f})" for f in p.get("fitnesses", ("reported_loss",))]:
                if (framework, part, arm) in cells:
                    _curves(ax, cells[(framework, part, arm)], "random m" if arm == "random" else f"{arm} every gap")
            for r in range(p["ga_gap"], p["rounds"] + 1, p["ga_gap"]):
                ax.axvline(r, color="k", lw=0.5, ls=":", alpha=0.5)
            ax.set_title(f"{framework}, {part}", fontsize=10)
            ax.set_xlabel("round (dotted: GA rounds)")
            ax.set_ylabel("test accuracy")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"GA base-model selection vs random, {p['workers']} workers, m={p['m']}, mean ± std over "
                 f"{len(p['seeds'])} seeds", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- driver

def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def run(out: str, *, quick: bool = False, progress: bool = True, jobs: int | None = None,
        only_ga: bool = False) -> dict[str, Any]:
    """Run both protocols (or, `only_ga`, the GA protocol, keeping the DWFed results already in `out`) and write
    tables (.md), plots (.png) and every raw number (.json) into `out`."""
    os.makedirs(out, exist_ok=True)
    dwfed_p, ga_p = quick_protocols() if quick else (DWFedProtocol(), GAProtocol())
    jobs = jobs or max(1, min(2, os.cpu_count() or 1))
    started = time.perf_counter()
    saved: dict[str, Any] = {}
    if only_ga:
        with open(os.path.join(out, f"{PREFIX}.json")) as fh:
            saved = json.load(fh)
    d_tasks, g_tasks = ([] if only_ga else dwfed_tasks(dwfed_p)), ga_tasks(ga_p)
    runs = run_all(d_tasks + g_tasks, jobs=jobs, progress=progress)
    d_keys = {t.key for t in d_tasks}
    dwfed = saved["dwfed"] if only_ga else {
        "protocol": asdict(dwfed_p), "runs": [r for r in runs if tuple(r["key"]) in d_keys],
        "weight_spread": dwfed_weight_spread(dwfed_p)}
    ga = {"protocol": asdict(ga_p), "runs": [r for r in runs if tuple(r["key"]) not in d_keys]}
    total = time.perf_counter() - started
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "processes": jobs,
           "cpus": os.cpu_count(), "quick": quick, "total_seconds": total,
           "run_seconds_dwfed": saved["environment"]["run_seconds_dwfed"] if only_ga
           else sum(r["seconds"] for r in dwfed["runs"]),
           "run_seconds_ga": sum(r["seconds"] for r in ga["runs"])}
    if only_ga:
        env["dwfed_from"] = "an earlier run (--only-ga)"
        env["total_seconds_dwfed_run"] = saved["environment"].get("total_seconds_dwfed_run",
                                                                  saved["environment"]["total_seconds"])
    with open(os.path.join(out, f"{PREFIX}.json"), "w") as fh:
        json.dump(_jsonable({"environment": env, "dwfed": dwfed, "ga": ga}), fh, indent=1)
    write_reports(out, env, dwfed, ga)
    return {"environment": env, "dwfed": dwfed, "ga": ga}


def write_reports(out: str, env: Mapping[str, Any], dwfed: Mapping[str, Any], ga: Mapping[str, Any]) -> None:
    """Tables and plots from the raw numbers (also `--tables-only`, which rereads the JSON)."""
    total, jobs = env["total_seconds"], env["processes"]
    footer = (f"\n\nWall time of the whole script {{:.0f}} s ({jobs} processes on {env['cpus']} CPU cores); "
              f"simulation time of these runs {{:.0f}} s (sum over runs).\n")
    with open(os.path.join(out, f"{PREFIX}_dwfed.md"), "w") as fh:
        fh.write("# DWFed vs FedAvg (DWFed paper §4 protocol)\n\n" + dwfed_table(dwfed)
                 + footer.format(env.get("total_seconds_dwfed_run", total), env["run_seconds_dwfed"]))
    with open(os.path.join(out, f"{PREFIX}_ga.md"), "w") as fh:
        fh.write("# GA base-model selection vs random selection (base-model paper §5 protocol)\n\n" + ga_table(ga)
                 + footer.format(total, env["run_seconds_ga"]))
    plot_dwfed(dwfed, os.path.join(out, f"{PREFIX}_dwfed.png"))
    plot_ga(ga, os.path.join(out, f"{PREFIX}_ga.png"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of about a minute (one seed, few rounds)")
    parser.add_argument("--out", help=f"output folder (default {RESULTS}; a temporary folder with --quick)")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: min(2, CPUs))")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--only-ga", action="store_true",
                        help=f"run only the GA protocol; the DWFed results are kept from OUT/{PREFIX}.json")
    parser.add_argument("--tables-only", action="store_true",
                        help=f"rebuild the tables and plots from OUT/{PREFIX}.json without simulating")
    args = parser.parse_args(argv)
    if args.tables_only:
        out = args.out or RESULTS
        with open(os.path.join(out, f"{PREFIX}.json")) as fh:
            saved = json.load(fh)
        write_reports(out, saved["environment"], saved["dwfed"], saved["ga"])
        print(f"rewrote the tables and plots in {out}", file=sys.stderr)
        return 0
    out = args.out or (tempfile.mkdtemp(prefix=f"{PREFIX}-quick-") if args.quick else RESULTS)
    result = run(out, quick=args.quick, progress=not args.no_progress, jobs=args.jobs, only_ga=args.only_ga)
    print(f"wrote {out} in {result['environment']['total_seconds']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
