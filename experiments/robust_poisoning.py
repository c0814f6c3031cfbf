"""Poisoning experiment: which aggregation rule keeps the global model when some sites send crafted updates.

    make experiment-robust                              # full run → experiments/results/robust_*
    python -m experiments.robust_poisoning --quick      # smoke run (~1 min) into a temporary folder unless --out
    python -m experiments.robust_poisoning --jobs 16    # as many pool processes as cores

Protocol (fixed in `Protocol` below before any run; nothing was tuned per rule or per attack):
20 workers on digits, Dirichlet α = 0.5, every worker in every round, 20 rounds, DP-SGD on every site (the
same policy everywhere), 0 / 2 / 4 / 6 attackers, 3 seeds. Within a seed every rule sees the same partition,
initial weights, batch orders and attackers (the 2 attackers are among the 4, the 4 among the 6), so a
difference between two cells of one row comes from the rule alone.

Attacks (each attacker first trains honestly on its own data, then sends):
- `sign_flip`: x_g − c·Δ_own, its own update reversed and scaled by c;
- `noise`: x_g + N(0, σ²) per coordinate, an update of pure noise;
- `label_flip`: data poisoning, labels y → 9 − y on the attacker's own data, trained as an honest worker would;
- `alie` ("a little is enough", Baruch et al., NeurIPS 2019): x_g + μ_j + z·σ_j per coordinate j, with μ, σ
  over the round's honest updates and z = Φ⁻¹((n − s)/n), s = ⌊n/2 + 1⌋ − f: the largest shift that keeps
  every attacker inside the honest spread, built to pass median and trimmed mean.

Rules: FedAvg; FedAvg with `max_share` (no update weighs more than 2/n); and each robust rule of the service
with the parameters below. Every run goes through `experiments.harness.simulate`, i.e. the service's own
RoundBook, combine and robust rules, and the worker's own DP training.

Two grids share this protocol (`--grid`). `original`: the eight rules above (robust.json, robust_poisoning.*).
`adaptive` (the default; robust_adaptive.*), for the newer rules and secure + robust groups, fixed before its
first run with every parameter at its author's recommendation and nothing tuned per cell:
- `cc`: centered clipping with momentum (Karimireddy, He, Jaggi, ICML 2021), one clipping iteration as in the
  paper, centred at the last round's aggregate; τ is the service rule's default (1 × the round's median
  distance to the centre), since the paper's fixed τ is in units of its gradients, not of our DP-noised deltas;
- `bucketing_cc`: buckets of s = 2 (Karimireddy, He, Jaggi, ICLR 2022), then `cc`;
- `nnm_cc`: nearest-neighbour mixing (Allouah et al., AISTATS 2023) with f = 4, the number of attackers the
  rule is told to tolerate, fixed once for n = 20 (so 6 attackers are beyond what it was told), then `cc`;
- `history_check`: the FLDetector-style check (Zhang, Cao, Jia, Gong, KDD 2022) at the rule's defaults, the
  sites it keeps averaged as FedAvg does (inner rule `none`), so the column measures the check alone;
- `groups_median`, `groups_cc`, `groups_bucketing_cc`: secure + robust groups, SIMULATED
  (experiments/robust_groups.py): each round the 20 sites are split at random (seeded) into G = 4 groups of
  g = 5, each group yields only its members' weighted mean (the secure path's quantiser and ring; masks cancel
  exactly), and the rule runs over the 4 group means. The trimmed mean over 4 means with β = 0.3 trims one per
  side, i.e. it IS the median of 4, so it is not run again;
- `fedavg` again, so that every goal below compares cells of one run (the code changed since the original
  grid: its robust cells do not reproduce bit for bit; its FedAvg cells do), then `median` and `trimmed_mean`
  last, as time allows.
The default robust configuration, named before the run: `nnm_cc` (NNM is the pre-mix the ALIE results of
Allouah et al. favour under heterogeneous data, and with no attack it averages 16 of 20 updates: little to lose).
Goals (reported, not tuned for): with 4 of 20 attackers the default within 3 points of clean FedAvg under each
attack and within 1 point of it with no attack; groups with 4 ALIE attackers within 5 points of clean FedAvg.
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
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from typing import Any

import numpy as np

from fedbroker.close_report import Verdict

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PREFIX = "robust"
CLEAN = "none"
GROUPS = "groups_"   # a configuration named groups_<rule>: <rule> over the secure groups' means
SERVICE_NAMES = {"cc": "centered_clipping", "bucketing_cc": "centered_clipping", "nnm_cc": "centered_clipping"}
ADAPTIVE_RULES = ("nnm_cc", "groups_median", "groups_cc", "bucketing_cc", "cc", "groups_bucketing_cc",
                  "history_check", "fedavg", "median", "trimmed_mean")  # in the order they run: what matters first


@dataclass(frozen=True)
class Protocol:
    """The experiment as the issue fixes it, and every hyper-parameter chosen before the first run."""

    workers: int = 20
    alpha: float = 0.5
    rounds: int = 20
    seeds: tuple[int, ...] = (0, 1, 2)
    attackers: tuple[int, ...] = (0, 2, 4, 6)
    attacks: tuple[str, ...] = ("sign_flip", "noise", "label_flip", "alie")
    rules: tuple[str, ...] = ("fedavg", "max_share", "median", "trimmed_mean", "multi_krum", "geometric_median",
                              "norm_bound", "fltrust")
    # the demo's model and local training (fedbroker demo), at a batch that gives ~4 steps an epoch on a shard
    hidden: int = 64
    lr: float = 0.5
    batch_size: int = 16
    epochs: int = 3
    # DP-SGD on every site (one policy for all; the budget only keeps 20 rounds from being refused)
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    delta: float = 1e-5
    sign_flip_scale: float = 10.0      # c
    noise_std: float = 1.0             # σ of the noise attack, per coordinate
    max_share: float = 0.1             # 2 / n
    trimmed_beta: float = 0.3          # ≥ the largest attacker fraction, 6 / 20 (Yin et al.'s condition β ≥ f/n)
    krum_f: int = 6                    # the largest number of attackers of the protocol
    root_size: int = 100               # FLTrust's root (probe) set, taken out of the training split
    tail: int = 3                      # accuracy reported = the mean over the last `tail` rounds
    name: str = PREFIX                 # the results' file prefix
    bucket_size: int = 2               # bucketing's s (Karimireddy, He, Jaggi, ICLR 2022)
    nnm_f: int = 4                     # NNM's f: the attackers the rule is told to tolerate, fixed once for n = 20
    group_size: int = 5                # g of secure + robust groups: G = workers / g group means a round
    default_rule: str = "nnm_cc"       # the default robust configuration, named before the run

    def norm_bound(self) -> float:
        """Norm bounding's M, computed rather than tuned: the expected norm of the DP noise alone in one honest
        update (lr · σ · C / batch per coordinate and step, over P coordinates and a mean shard's steps)."""
        parameters = 64 * self.hidden + self.hidden + self.hidden * 10 + 10
        shard = (1797 * 0.8 - self.root_size) / self.workers
        steps = self.epochs * math.ceil(shard / self.batch_size)
        return self.lr * self.noise_multiplier * self.max_grad_norm / self.batch_size * math.sqrt(parameters * steps)

    def mlp(self) -> dict[str, Any]:
        return {"input_shape": [1, 8, 8], "layers": [
            {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": self.hidden},
            {"type": "ReLU"}, {"type": "Linear", "in_features": self.hidden, "out_features": 10}]}

    def aggregation(self, rule: str) -> dict[str, Any]:
        """The job's aggregation section for `rule` (the service's names and parameters). A grouped rule's job
        is FedAvg: the grouped round happens in the tamper hook (`group_rule` is what it runs)."""
        if rule == "fedavg" or rule.startswith(GROUPS):
            return {"weighting": "fedavg"}
        if rule == "max_share":
            return {"weighting": "fedavg", "weighting_params": {"max_share": self.max_share}}
        params: dict[str, Any] = {
            "median": {},
            "trimmed_mean": {"beta": self.trimmed_beta},
            "multi_krum": {"f": self.krum_f, "m": self.workers - self.krum_f},
            "geometric_median": {},
            "norm_bound": {"max_norm": round(self.norm_bound(), 3)},
            # the service trains g_0 on its root set as the sites train (FLTrust §4: same local procedure), no DP
            "fltrust": {"probe_dataset": "digits", "probe_size": self.root_size, "epochs": self.epochs,
                        "lr": self.lr, "batch_size": self.batch_size},
            "cc": {},
            "bucketing_cc": {"premix": "bucketing", "bucket_size": self.bucket_size},
            "nnm_cc": {"premix": "nnm", "nnm_f": self.nnm_f},
            "history_check": {"inner": "none"},
        }[rule]
        return {"weighting": "fedavg", "robust": SERVICE_NAMES.get(rule, rule), "robust_params": params}

    def group_rule(self, rule: str) -> dict[str, Any]:
        """The aggregation section of the rule a grouped configuration runs over the group means."""
        return self.aggregation(rule.removeprefix(GROUPS))

    def job(self, rule: str, seed: int) -> dict[str, Any]:
        return {"name": f"robust-{rule}", "category": "digits", "seed": seed, "model": self.mlp(), "aggregation": self.aggregation(rule),
                "training": {"rounds": self.rounds, "local_epochs": self.epochs, "batch_size": self.batch_size,
                             "lr": self.lr}}


def adaptive_protocol() -> Protocol:
    """The grid of the newer rules and of secure + robust groups (same seeds, partitions and attackers)."""
    return Protocol(rules=ADAPTIVE_RULES, name=f"{PREFIX}_adaptive")


def quick_protocol(grid: str = "adaptive") -> Protocol:
    rules = ("fedavg", "nnm_cc", "groups_median") if grid == "adaptive" else ("fedavg", "median")
    return Protocol(workers=8, rounds=3, seeds=(0,), attackers=(0, 2), attacks=("sign_flip", "alie"),
                    rules=rules, krum_f=2, nnm_f=2, group_size=2, name=f"{PREFIX}_quick")


@dataclass(frozen=True)
class Task:
    """One federation: a rule, an attack, a number of attackers and a seed."""

    protocol: Protocol
    rule: str
    attack: str
    attackers: int
    seed: int
    key: tuple[Any, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.attack, self.attackers, self.rule))


def tasks(protocol: Protocol) -> list[Task]:
    """Every federation of the grid, in the order that answers the goals first, so that a run cut short leaves
    whole cells: the rows of the goals (no attack, and each attack with 4 attackers), then ALIE's other rows,
    then the rest; within each, a rule's all together in the order of `rules`, a seed's within a rule."""
    rows = [(CLEAN, 0)] + [(a, f) for f in protocol.attackers if f for a in protocol.attacks]
    first = [r for r in rows if r[1] in (0, DETECTION_ATTACKERS)]
    alie = [r for r in rows if r[0] == "alie" and r not in first]
    tiers = (first, alie, [r for r in rows if r not in first and r not in alie])
    return [Task(protocol, rule, attack, f, seed) for tier in tiers
            for rule in protocol.rules for seed in protocol.seeds for attack, f in tier]


# ---------------------------------------------------------------- the attacks

def alie_z(n: int, f: int) -> float:
    """Baruch et al.'s z: the largest number of standard deviations that still leaves the attackers inside
    the spread a majority-based rule accepts."""
    from scipy.stats import norm

    s = math.floor(n / 2 + 1) - f
    return float(norm.ppf((n - s) / n))


def attackers_of(protocol: Protocol, seed: int, f: int, ids: Sequence[str]) -> list[str]:
    """The seed's first f of one fixed random order of the workers: nested across f."""
    order = np.random.default_rng([seed, 777]).permutation(len(ids))
    return [ids[i] for i in order[:f]]


def flip_labels(y: np.ndarray, classes: int) -> np.ndarray:
    return (classes - 1 - y).astype(y.dtype)


class Attack:
    """The round's tampering: replaces the attackers' trained states with what the attack sends."""

    def __init__(self, protocol: Protocol, kind: str, attackers: Sequence[str], n: int, seed: int) -> None:
        self.protocol, self.kind, self.attackers = protocol, kind, set(attackers)
        self.z = alie_z(n, len(attackers)) if attackers else 0.0
        self.rng = np.random.default_rng([seed, 4242])

    def __call__(self, round_number: int, global_state: dict[str, np.ndarray],
                 trained: dict[str, Any]) -> dict[str, Any]:
        if self.kind in (CLEAN, "label_flip") or not self.attackers:
            return trained
        honest = [w for w in trained if w not in self.attackers]
        out = dict(trained)
        for worker_id in sorted(self.attackers & set(trained)):
            result = trained[worker_id]
            state = {}
            for name, base in global_state.items():
                if not np.issubdtype(base.dtype, np.floating):
                    state[name] = result.state[name]
                    continue
                own = result.state[name] - base
                if self.kind == "sign_flip":
                    delta = -self.protocol.sign_flip_scale * own
                elif self.kind == "noise":
                    delta = self.rng.normal(0.0, self.protocol.noise_std, size=base.shape)
                elif self.kind == "alie":
                    deltas = np.stack([trained[w].state[name] - base for w in honest])
                    delta = deltas.mean(axis=0) + self.z * deltas.std(axis=0)
                else:
                    raise ValueError(f"unknown attack {self.kind!r}")
                state[name] = (base + delta).astype(base.dtype)
            out[worker_id] = replace(result, state=state)
        return out


# ---------------------------------------------------------------- one run (in a pool process)

def _init_pool() -> None:
    import torch

    torch.set_num_threads(1)


def run_task(task: Task) -> dict[str, Any]:
    try:
        return _run_task(task)
    except Exception as exc:  # some project errors do not survive pickling back from a pool process
        raise RuntimeError(f"run {task.key} seed {task.seed} failed: {type(exc).__name__}: {exc}") from None


def _run_task(task: Task) -> dict[str, Any]:
    from experiments.harness import VirtualWorker, simulate
    from fedbroker.config import DPPolicy
    from fedbroker.datasets import load_dataset, train_test_split
    from fedbroker.worker.partition import partition

    p = task.protocol
    train, test = train_test_split(load_dataset("digits"), test_fraction=0.2, seed=task.seed)
    train, root = train_test_split(train, test_fraction=p.root_size / len(train), seed=task.seed + 1)
    parts = partition(train.y, scheme="dirichlet", num_clients=p.workers, seed=task.seed, alpha=p.alpha,
                      min_size=2)
    ids = [f"w{i:02d}" for i in range(p.workers)]
    bad = attackers_of(p, task.seed, task.attackers, ids)
    workers = []
    for worker_id, idx in zip(ids, parts):
        y = train.y[idx]
        if task.attack == "label_flip" and worker_id in bad:
            y = flip_labels(y, train.num_classes)
        workers.append(VirtualWorker(worker_id, train.x[idx], y, train.num_classes))
    dp = DPPolicy(noise_multiplier=p.noise_multiplier, max_grad_norm=p.max_grad_norm, delta=p.delta,
                  epsilon_budget=1e6)
    started = time.perf_counter()
    tamper: Any = Attack(p, task.attack, bad, p.workers, task.seed)
    if task.rule.startswith(GROUPS):
        from experiments.robust_groups import Grouped, build_rule

        tamper = Grouped(tamper, build_rule(p.group_rule(task.rule)), group_size=p.group_size, seed=task.seed)
    sim = simulate(p.job(task.rule, task.seed), workers, test, dp=dp, progress=False,
                   metrics=lambda model, data: {}, probe=root, tamper=tamper)
    return {"key": list(task.key), "seed": task.seed, "seconds": time.perf_counter() - started,
            "attackers": bad, "accuracy": [r.accuracy for r in sim.rounds],
            "discarded": [discarded(r.verdicts, bad) for r in sim.rounds]}


DETECTION_ATTACKERS = 4


def discarded(verdicts: Sequence[Verdict], attackers: Sequence[str]) -> dict[str, int]:
    """How many attackers' and honest workers' updates the round's rule discarded (the service's own verdict:
    an update kept under a tenth of its plain-mean share, or one a history check flagged), and how many of
    those were flagged."""
    out = {"attackers": 0, "honest": 0, "flagged": 0}
    for verdict in verdicts:
        if verdict.judgement in ("discarded", "flagged"):
            out["attackers" if verdict.worker_id in attackers else "honest"] += 1
            out["flagged"] += verdict.judgement == "flagged"
    return out


# ---------------------------------------------------------------- tables and plot

def final_accuracy(run: Mapping[str, Any], tail: int) -> float:
    acc = run["accuracy"]
    return float(np.mean(acc[-tail:])) if acc else math.nan


def cells(protocol: Protocol, runs: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int, str], list[float]]:
    out: dict[tuple[str, int, str], list[float]] = {}
    for run in runs:
        attack, f, rule = run["key"]
        out.setdefault((attack, int(f), rule), []).append(final_accuracy(run, protocol.tail))
    return out


def table(protocol: Protocol, runs: Sequence[Mapping[str, Any]]) -> str:
    by_cell = cells(protocol, runs)
    head = "| attack | attackers | " + " | ".join(protocol.rules) + " |"
    lines = [head, "|" + "---|" * (len(protocol.rules) + 2)]
    rows = [(CLEAN, 0)] + [(a, f) for a in protocol.attacks for f in protocol.attackers if f]
    for attack, f in rows:
        values = []
        for rule in protocol.rules:
            acc = by_cell.get((attack, f, rule), [])
            values.append(f"{np.mean(acc):.3f} ± {np.std(acc):.3f}" if acc else "—")
        lines.append(f"| {attack} | {f} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def detection_table(protocol: Protocol, runs: Sequence[Mapping[str, Any]], attackers: int) -> str:
    """Per attack and rule: the share of the attackers' updates and of the honest ones the rule discarded."""
    counts: dict[tuple[str, str], list[int]] = {}
    for run in runs:
        attack, f, rule = run["key"]
        if int(f) != attackers:
            continue
        c = counts.setdefault((attack, rule), [0, 0, 0, 0])
        for round_ in run["discarded"]:
            c[0] += round_["attackers"]
            c[1] += attackers
            c[2] += round_["honest"]
            c[3] += protocol.workers - attackers
    # a grouped rule judges group means, not sites; a history check's runs from before "flagged" was counted
    # (no "flagged" key) under-count what it excluded
    rules = [r for r in protocol.rules if not r.startswith(GROUPS) and (r != "history_check" or all(
        "flagged" in d for run in runs if run["key"][2] == r for d in run["discarded"]))]
    lines = ["| attack | " + " | ".join(rules) + " |", "|" + "---|" * (len(rules) + 1)]
    for attack in protocol.attacks:
        cells_ = []
        for rule in rules:
            c = counts.get((attack, rule))
            cells_.append(f"{c[0] / c[1]:.2f} / {c[2] / c[3]:.2f}" if c and c[1] and c[3] else "—")
        lines.append(f"| {attack} | " + " | ".join(cells_) + " |")
    return "\n".join(lines)


def plot(protocol: Protocol, runs: Sequence[Mapping[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_cell = cells(protocol, runs)
    fig, axes = plt.subplots(1, len(protocol.attacks), figsize=(4.2 * len(protocol.attacks), 3.8), sharey=True)
    for ax, attack in zip(np.atleast_1d(axes), protocol.attacks):
        for rule in protocol.rules:
            xs, ys, es = [], [], []
            for f in protocol.attackers:
                acc = by_cell.get(((CLEAN if f == 0 else attack), f, rule), [])
                if acc:
                    xs.append(f)
                    ys.append(np.mean(acc))
                    es.append(np.std(acc))
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=2, label=rule)
        ax.set_title(attack)
        ax.set_xlabel(f"attackers of {protocol.workers}")
        ax.set_xticks(list(protocol.attackers))
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel(f"test accuracy (mean of last {protocol.tail} rounds)")
    np.atleast_1d(axes)[-1].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"Poisoning on digits: {protocol.workers} workers, Dirichlet α={protocol.alpha}, "
                 f"{protocol.rounds} rounds, DP on, {len(protocol.seeds)} seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def goals(protocol: Protocol, runs: Sequence[Mapping[str, Any]]) -> str:
    """Each rule's distance below clean FedAvg in points (positive: worse), with no attack and under each attack
    with 4 attackers (the most the grid has, if fewer), and whether it meets its goal (docstring); empty
    without a FedAvg column."""
    attackers = DETECTION_ATTACKERS if DETECTION_ATTACKERS in protocol.attackers else max(protocol.attackers)
    by_cell = cells(protocol, runs)
    clean = by_cell.get((CLEAN, 0, "fedavg"))
    if not clean:
        return ""
    reference = float(np.mean(clean))
    lines = [f"Points below clean FedAvg ({reference:.3f}), {attackers} of {protocol.workers} attackers:\n",
             "| rule | no attack | " + " | ".join(protocol.attacks) + " | goal |",
             "|" + "---|" * (len(protocol.attacks) + 3)]
    for rule in protocol.rules:
        gaps = [by_cell.get((CLEAN, 0, rule))] + [by_cell.get((a, attackers, rule)) for a in protocol.attacks]
        points = [100 * (reference - float(np.mean(g))) if g else math.nan for g in gaps]
        if rule.startswith(GROUPS) and "alie" in protocol.attacks:
            gap = points[1 + protocol.attacks.index("alie")]
            verdict = "—" if math.isnan(gap) else f"ALIE ≤ 5: {'met' if gap <= 5 else 'not met'}"
        elif rule != "fedavg":
            verdict = ("—" if any(map(math.isnan, points)) else
                       f"≤ 1 / ≤ 3: {'met' if points[0] <= 1 and max(points[1:]) <= 3 else 'not met'}")
        else:
            verdict = "reference"
        name = f"{rule} (default)" if rule == protocol.default_rule else rule
        lines.append(f"| {name} | " + " | ".join("—" if math.isnan(x) else f"{x:+.1f}" for x in points)
                     + f" | {verdict} |")
    return "\n".join(lines)


def paths(protocol: Protocol, out: str) -> tuple[str, str, str]:
    """(json, table, plot) of the grid; the original grid keeps its files' old names."""
    stem = os.path.join(out, protocol.name)
    if protocol.name == PREFIX:
        return f"{stem}.json", f"{stem}_poisoning.md", f"{stem}_poisoning.png"
    return f"{stem}.json", f"{stem}.md", f"{stem}.png"


def write_results(protocol: Protocol, runs: Sequence[Mapping[str, Any]], out: str, seconds: float,
                  machine: str | None = None) -> str:
    os.makedirs(out, exist_ok=True)
    machine = machine or f"{platform.machine()} {os.cpu_count()} cores, python {sys.version.split()[0]}"
    data, md_path, png = paths(protocol, out)
    with open(data, "w") as fh:
        json.dump({"protocol": asdict(protocol), "runs": list(runs), "seconds": seconds, "machine": machine}, fh,
                  separators=(",", ":"))
    total = len(tasks(protocol))
    done = f"{len(runs)} runs" if len(runs) >= total else f"PARTIAL: {len(runs)} of {total} runs"
    reused = sorted({r["key"][2] for r in runs if r.get("reused")})
    if reused:
        done += (f" ({', '.join(reused)}: taken from {next(r['reused'] for r in runs if r.get('reused'))}, "
                 f"the original grid's run, not re-run)")
    md = (f"# Poisoning: final test accuracy (mean ± std over {len(protocol.seeds)} seeds)\n\n"
          f"Protocol, fixed before any run: {json.dumps(asdict(protocol))}\n\n"
          f"ALIE's z: " + ", ".join(f"f={f}: {alie_z(protocol.workers, f):.3f}" for f in protocol.attackers if f)
          + f"\n\n{table(protocol, runs)}\n\n{goals(protocol, runs)}\n\n"
          f"## Updates discarded with {DETECTION_ATTACKERS} attackers (attackers' share / honest share, all rounds)\n\n"
          f"A rule discards an update it keeps under a tenth of its plain-mean share. Median, trimmed mean and "
          f"norm bounding act per coordinate or by scaling, so they seldom discard a whole update; a grouped "
          f"configuration judges group means, never a site, so it has no column here.\n\n"
          f"{detection_table(protocol, runs, DETECTION_ATTACKERS)}\n\n{done}, {seconds / 60:.1f} min "
          f"({machine}).\n")
    with open(md_path, "w") as fh:
        fh.write(md)
    plot(protocol, runs, png)
    return md


def load(path: str) -> tuple[Protocol, list[dict[str, Any]], float, str]:
    with open(path) as fh:
        saved = json.load(fh)
    protocol = Protocol(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved["protocol"].items()})
    return protocol, saved["runs"], float(saved["seconds"]), str(saved["machine"])


def run(protocol: Protocol, out: str, jobs: int, *, resume: bool = False, reuse: Sequence[str] = (),
        every: int = 2) -> str:
    """Run the grid's federations not already in --out's results (with `resume`) nor taken from the original
    grid's (the rules in `reuse`, whose code path is unchanged), rewriting the results every `every` runs so
    that a run cut short leaves its finished cells on disk."""
    runs: list[dict[str, Any]] = []
    before = 0.0
    if resume and os.path.exists(paths(protocol, out)[0]):
        _, runs, before, _ = load(paths(protocol, out)[0])
    have = {(tuple(r["key"]), r["seed"]) for r in runs}
    if reuse:
        _, original, _, _ = load(paths(Protocol(), out)[0])
        runs += [{**r, "reused": os.path.basename(paths(Protocol(), out)[0])} for r in original
                 if r["key"][2] in reuse and r["key"][2] in protocol.rules and (tuple(r["key"]), r["seed"]) not in have]
        have = {(tuple(r["key"]), r["seed"]) for r in runs}
    todo = [t for t in tasks(protocol) if (t.key, t.seed) not in have]
    started = time.perf_counter()
    from tqdm import tqdm

    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn"), initializer=_init_pool) as pool:
        futures = [pool.submit(run_task, t) for t in todo]
        for i, fut in enumerate(tqdm(as_completed(futures), total=len(futures), desc="poisoning runs",
                                     file=sys.stdout)):
            runs.append(fut.result())
            if (i + 1) % every == 0:
                runs.sort(key=lambda r: (r["key"], r["seed"]))
                write_results(protocol, runs, out, before + time.perf_counter() - started)
    runs.sort(key=lambda r: (r["key"], r["seed"]))
    return write_results(protocol, runs, out, before + time.perf_counter() - started)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of a few minutes")
    parser.add_argument("--grid", choices=("adaptive", "original"), default="adaptive",
                        help="the newer rules and secure + robust groups, or the original eight rules")
    parser.add_argument("--rules", help="comma-separated: run only these of the grid's rules")
    parser.add_argument("--out", help="results folder (default experiments/results, or a temporary one with --quick)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="pool processes")
    parser.add_argument("--resume", action="store_true", help="keep --out's finished runs and run the rest")
    parser.add_argument("--reuse", default="", help="comma-separated rules whose runs are taken from robust.json")
    parser.add_argument("--report", action="store_true", help="rewrite the grid's table and plot from its json")
    args = parser.parse_args(argv)
    protocol = adaptive_protocol() if args.grid == "adaptive" else Protocol()
    if args.quick:
        protocol = quick_protocol(args.grid)
    out = args.out or (tempfile.mkdtemp(prefix="robust-") if args.quick else RESULTS)
    if args.report:
        saved, runs, seconds, machine = load(paths(protocol, out)[0])
        print(write_results(saved, runs, out, seconds, machine))
        return 0
    if args.rules:
        unknown = set(args.rules.split(",")) - set(protocol.rules)
        if unknown:
            parser.error(f"not rules of the {args.grid} grid: {sorted(unknown)}")
        protocol = replace(protocol, rules=tuple(r for r in protocol.rules if r in args.rules.split(",")))
    print(run(protocol, out, args.jobs, resume=args.resume, reuse=[r for r in args.reuse.split(",") if r]))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
