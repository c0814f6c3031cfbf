"""Privacy experiment: what local, distributed (secure) and central DP cost in accuracy at the same ε.

    make experiment-privacy                           # full run → experiments/results/privacy_*
    python -m experiments.privacy_dp --quick          # smoke run (seconds) into a temporary folder unless --out
    python -m experiments.privacy_dp --jobs 2         # pool processes
    python -m experiments.privacy_dp --pilot          # the non-private learning-rate pilot the protocol was fixed by

Protocol (fixed in `Protocol` below before any private run; nothing is tuned per cell, mode or ε):
ε ∈ {1, 3, 8} at δ = 1e-5, N ∈ {5, 10, 20} sites, 3 seeds, two tasks: digits (scikit-learn's bundled set, 64
pixels) and the synthetic tissue set of experiments/imaging_data.py (9 H&E texture classes, 4,000 images a seed,
each 3×28×28 averaged 4×4 down to 3×7×7 and mapped by the fixed (x − 0.6)·3; no statistic of the data is
computed, it would itself need privacy). A 20 % stratified hold-out is the test set, the rest is split over the
N sites by Dirichlet(α = 0.5) (`worker.partition.partition`). Model: MLP with 32 ReLU units.

Every mode is record-level DP and runs the same federated DP-SGD: each round each site draws a Poisson sample
(rate q) of its records, clips every record's gradient to L2 norm C and sums them; the sum over the sites gets
the mode's noise; x ← x − lr·(sum + noise)/(q·Σn). T = 400 rounds, q = 0.05, C = 1; lr = 2.0 (the best of
{0.2, 0.5, 1, 2} for the mean of the two tasks' NON-private accuracy in the `--pilot` run, seed 99, which is
none of the experiment's seeds). The modes differ only in the noise:
- central (trusted curator): one Gaussian N(0, (z_c C)²) on the total; z_c is the smallest multiplier for which
  the sampled-Gaussian RDP accountant (fedbroker/privacy.py, the workers' own) gives ε after T rounds.
- distributed: each site scales its sum by γ, rounds stochastically to integers, adds a Skellam share of
  variance μ/N (N = the quorum, here every site: no site drops out in the simulation), the shares are summed in
  the ring mod 2^bits, read back as signed and divided by γ. μ = (γ z C)² and z is calibrated with the
  Skellam accounting of fedbroker/secagg/skellam.py (`distributed_epsilon`) to the same ε; γ and the ring come
  from the same module. Secure aggregation's masks cancel exactly mod 2^bits, so the simulation does not mask:
  the integer sum the server unmasks is the same.
- local: the same quantiser and mechanism, but every site adds the whole dose μ itself (each site's own share
  gives it ε alone), so the sum carries N× the variance.
A reference without noise ("none", clipping and sampling as above) is run too, and a diagnostic
(`distributed_cz`): the distributed mechanism at central's z, whose Skellam-accounted ε is then above the target.
It was added after the calibration (and a 60-round smoke run) showed the Skellam z far above central's at ε = 1,
before the full run; it changes no other cell.
Within a seed every mode, ε and N share the initial weights and the per-round Poisson samples' generator, and
within (seed, N) the partition; so the modes of one cell differ by their noise alone.
Reported: test accuracy of the final model (round T), mean ± SD over the seeds.

Goals (issue 34), measured and reported, not tuned for: distributed within 1 point of central in every cell;
distributed ≥ 5 points above local at ε = 1, N = 20.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from typing import Any

import numpy as np

from experiments import privacy_accounting as acct
from experiments.privacy_sim import MODES, NON_PRIVATE, Noise, RunSpec, federated_dp_sgd

CHECKPOINT = 10  # runs between the pool's saves of privacy.json
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PREFIX = "privacy"
DATASETS = ("digits", "tissue")
CENTRAL_Z = acct.DIAGNOSTIC  # the distributed mechanism at central's z (its Skellam-accounted ε is higher)


@dataclass(frozen=True)
class Protocol:
    """The experiment as issue 34 fixes it, and every hyper-parameter chosen before the first private run."""

    datasets: tuple[str, ...] = DATASETS
    epsilons: tuple[float, ...] = (1.0, 3.0, 8.0)
    sites: tuple[int, ...] = (5, 10, 20)
    modes: tuple[str, ...] = MODES
    seeds: tuple[int, ...] = (0, 1, 2)
    delta: float = 1e-5
    alpha: float = 0.5
    rounds: int = 400
    sample_rate: float = 0.05
    clip: float = 1.0
    lr: float = 2.0
    hidden: int = 32
    eval_every: int = 50
    test_fraction: float = 0.2
    tissue_images: int = 4000
    tissue_pool: int = 4
    min_site: int = 10
    diagnostic: bool = True  # also run `distributed_cz`: separates the mechanism's cost from its accounting's

    def shown(self) -> tuple[str, ...]:
        """The columns: the three modes, and the diagnostic if run."""
        return self.modes + ((CENTRAL_Z,) if self.diagnostic else ())

    def spec(self) -> RunSpec:
        return RunSpec(rounds=self.rounds, sample_rate=self.sample_rate, clip=self.clip, lr=self.lr,
                       hidden=self.hidden, eval_every=self.eval_every)


def quick_protocol() -> Protocol:
    return Protocol(datasets=("digits",), epsilons=(1.0,), sites=(20,), seeds=(0,), rounds=60, eval_every=20,
                    diagnostic=False)


@dataclass(frozen=True)
class Task:
    """One federation: a task, a seed, N sites and a mode (with its calibrated noise, or none)."""

    dataset: str
    seed: int
    sites: int
    mode: str
    epsilon: float | None
    noise: Noise


# ---------------------------------------------------------------- data

def load(name: str, *, seed: int, protocol: Protocol) -> tuple[np.ndarray, np.ndarray, int]:
    """Features (rows), labels and the class count of a task; tissue is drawn from its recipe per seed."""
    if name == "digits":
        from fedbroker.datasets import load_dataset

        ds = load_dataset("digits")
        return ds.x.reshape(len(ds.y), -1).astype(np.float64), ds.y, ds.num_classes
    if name == "tissue":
        from experiments.imaging_data import TISSUE_CLASSES, tissue

        x, y = tissue(protocol.tissue_images, seed)
        k = protocol.tissue_pool
        n, c, h, w = x.shape
        pooled = x.reshape(n, c, h // k, k, w // k, k).mean(axis=(3, 5)).reshape(n, -1).astype(np.float64)
        return (pooled - 0.6) * 3.0, y.astype(np.int64), len(TISSUE_CLASSES)
    raise ValueError(f"unknown task {name!r}")


def cache_data(protocol: Protocol, folder: str) -> None:
    """Draw every (task, seed) once in the parent (tissue takes seconds) and store it for the pool (no pickle)."""
    for name in protocol.datasets:
        for seed in protocol.seeds:
            x, y, classes = load(name, seed=seed, protocol=protocol)
            np.savez(os.path.join(folder, f"{name}-{seed}.npz"), x=x, y=y, classes=np.int64(classes))


@functools.lru_cache(maxsize=8)
def _cached(folder: str, *, name: str, seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    with np.load(os.path.join(folder, f"{name}-{seed}.npz"), allow_pickle=False) as f:
        return f["x"], f["y"], int(f["classes"])


def federation(protocol: Protocol, *, folder: str, name: str, seed: int, n_sites: int) -> dict[str, Any]:
    """The hold-out test set and the N sites' shards (Dirichlet, the repo's partition)."""
    from fedbroker.datasets import Dataset, train_test_split
    from fedbroker.worker.partition import partition

    x, y, classes = _cached(folder, name=name, seed=seed)
    train, test = train_test_split(Dataset(x=x.astype(np.float32), y=y, num_classes=classes, name=name),
                                   test_fraction=protocol.test_fraction, seed=seed)
    parts = partition(train.y, scheme="dirichlet", num_clients=n_sites, seed=seed, alpha=protocol.alpha,
                      min_size=protocol.min_site)
    features = train.x.astype(np.float64)
    return {"sites": [(features[idx], train.y[idx]) for idx in parts], "test": (test.x.astype(np.float64), test.y),
            "classes": classes, "train": len(train.y)}


# ---------------------------------------------------------------- tasks and one run (in a pool process)

def tasks(protocol: Protocol, calibration: Mapping[str, Any]) -> list[Task]:
    """Seed by seed (a stopped run still has whole seeds), the diagnostic runs after all the others."""
    out, later = [], []
    for seed in protocol.seeds:
        for name in protocol.datasets:
            for n in protocol.sites:
                out.append(Task(name, seed, n, NON_PRIVATE, None, Noise(NON_PRIVATE)))
                for eps in protocol.epsilons:
                    for mode in protocol.shown():
                        noise = acct.noise_for(calibration, name=name, sites=n, mode=mode, epsilon=eps)
                        (later if mode == CENTRAL_Z else out).append(Task(name, seed, n, mode, eps, noise))
    return out + later


def _init_pool() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_task(task: Task, *, protocol: Protocol, folder: str) -> dict[str, Any]:
    fed = federation(protocol, folder=folder, name=task.dataset, seed=task.seed, n_sites=task.sites)
    started = time.perf_counter()
    out = federated_dp_sgd(spec=protocol.spec(), noise=task.noise, sites=fed["sites"], test=fed["test"],
                           classes=fed["classes"], seed=task.seed)
    return {"dataset": task.dataset, "seed": task.seed, "sites": task.sites, "mode": task.mode,
            "epsilon": task.epsilon, "noise": asdict(task.noise), "accuracy": out["accuracy"],
            "curve": out["curve"], "dim": out["dim"], "train": fed["train"],
            "site_sizes": [len(y) for _, y in fed["sites"]], "seconds": time.perf_counter() - started}


# ---------------------------------------------------------------- tables and plot

Cell = tuple[str, int, str, "float | None"]


def by_seed(runs: Sequence[Mapping[str, Any]]) -> dict[Cell, dict[int, float]]:
    """Accuracy per cell (task, N, mode, ε), by seed: gaps between modes are paired by seed."""
    out: dict[Cell, dict[int, float]] = {}
    for r in runs:
        out.setdefault((r["dataset"], int(r["sites"]), r["mode"], r["epsilon"]), {})[int(r["seed"])] = float(
            r["accuracy"])
    return out


def cells(runs: Sequence[Mapping[str, Any]]) -> dict[Cell, list[float]]:
    """Accuracy per cell, over its seeds in seed order."""
    return {k: [v[s] for s in sorted(v)] for k, v in by_seed(runs).items()}


def _cell(values: Sequence[float]) -> str:
    return f"{100 * np.mean(values):.1f} ± {100 * np.std(values):.1f}" if values else "—"


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> list[float]:
    """a − b in points, seed by seed, over the seeds both have."""
    return [100 * (a[s] - b[s]) for s in sorted(set(a) & set(b))]


def _gap(a: Mapping[int, float], b: Mapping[int, float]) -> str:
    d = paired(a, b)
    return f"{np.mean(d):+.1f} ± {np.std(d):.1f}" if d else "—"


def table(protocol: Protocol, runs: Sequence[Mapping[str, Any]]) -> str:
    """One row per (task, N, ε): accuracy in % of each mode, and the two gaps the goals are about."""
    by, seeds = cells(runs), by_seed(runs)
    shown = protocol.shown()
    head = ("| task | N | ε | " + " | ".join(shown) + " | no noise | distributed − central | "
            "distributed − local |")
    lines = [head, "|" + "---|" * (len(shown) + 6)]
    for name in protocol.datasets:
        for n in protocol.sites:
            ref = by.get((name, n, NON_PRIVATE, None), [])
            for eps in protocol.epsilons:
                acc = {m: seeds.get((name, n, m, eps), {}) for m in shown}
                lines.append(f"| {name} | {n} | {eps:g} | " + " | ".join(_cell(list(acc[m].values())) for m in shown)
                             + f" | {_cell(ref)} | {_gap(acc.get('distributed', {}), acc.get('central', {}))}"
                             f" | {_gap(acc.get('distributed', {}), acc.get('local', {}))} |")
    return "\n".join(lines)


def goals(protocol: Protocol, runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The issue's two goals, on the seed-paired mean gaps (points)."""
    seeds = by_seed(runs)
    out = []
    gaps = []
    for name in protocol.datasets:
        for n in protocol.sites:
            for eps in protocol.epsilons:
                d = paired(seeds.get((name, n, "distributed", eps), {}), seeds.get((name, n, "central", eps), {}))
                if d:
                    gaps.append((name, n, eps, float(np.mean(d))))
    if gaps:
        worst = min(gaps, key=lambda g: g[3])
        met = sum(g[3] >= -1.0 for g in gaps)
        out.append(f"distributed no more than 1 point below central: {met} of {len(gaps)} cells; largest "
                   f"shortfall {worst[3]:+.1f} points ({worst[0]}, N = {worst[1]}, ε = {worst[2]:g}); cells below: "
                   + (", ".join(f"{g[0]} N={g[1]} ε={g[2]:g} ({g[3]:+.1f})" for g in gaps if g[3] < -1.0) or "none"))
    for name in protocol.datasets:
        d = paired(seeds.get((name, 20, "distributed", 1.0), {}), seeds.get((name, 20, "local", 1.0), {}))
        if d:
            out.append(f"{name}, ε = 1, N = 20: distributed − local = {np.mean(d):+.1f} ± {np.std(d):.1f} points "
                       f"({'met' if np.mean(d) >= 5 else 'NOT met'}: goal ≥ +5)")
    return out


def plot(protocol: Protocol, runs: Sequence[Mapping[str, Any]], *, path: str) -> None:
    """Accuracy vs ε, one panel per (task, N), one line per mode; the no-noise reference dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = cells(runs)
    rows, cols = len(protocol.datasets), len(protocol.sites)
    fig, axes = plt.subplots(rows, cols, figsize=(4.0 * cols, 3.4 * rows), squeeze=False, sharex=True)
    for i, name in enumerate(protocol.datasets):
        for j, n in enumerate(protocol.sites):
            ax = axes[i][j]
            for mode in protocol.shown():
                xs = [e for e in protocol.epsilons if by.get((name, n, mode, e))]
                ys = [100 * np.mean(by[(name, n, mode, e)]) for e in xs]
                es = [100 * np.std(by[(name, n, mode, e)]) for e in xs]
                diagnostic = mode == CENTRAL_Z
                ax.errorbar(xs, ys, yerr=es, marker="x" if diagnostic else "o", capsize=2,
                            ls=":" if diagnostic else "-", label="distributed at central's z" if diagnostic else mode)
            ref = by.get((name, n, NON_PRIVATE, None))
            if ref:
                ax.axhline(100 * np.mean(ref), color="grey", ls="--", lw=1, label="no noise")
            ax.set_xscale("log")
            ax.minorticks_off()
            ax.set_xticks(list(protocol.epsilons), [f"{e:g}" for e in protocol.epsilons])
            ax.set_ylim(0, 100)
            ax.set_title(f"{name}, N = {n}", fontsize=10)
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("test accuracy (%)")
            if i == rows - 1:
                ax.set_xlabel(f"ε (δ = {protocol.delta:g})")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"Local vs distributed vs central DP: federated DP-SGD, T = {protocol.rounds}, "
                 f"q = {protocol.sample_rate}, C = {protocol.clip}, {len(protocol.seeds)} seeds", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_json(protocol: Protocol, *, calibration: Mapping[str, Any], runs: Sequence[Mapping[str, Any]], out: str,
              seconds: float, machine: str | None = None) -> str:
    os.makedirs(out, exist_ok=True)
    machine = machine or f"{platform.machine()} {os.cpu_count()} cores, python {sys.version.split()[0]}"
    with open(os.path.join(out, f"{PREFIX}.json"), "w") as fh:
        json.dump({"protocol": asdict(protocol), "calibration": calibration, "runs": list(runs),
                   "seconds": seconds, "machine": machine}, fh, separators=(",", ":"))
    return machine


def write_results(protocol: Protocol, *, calibration: Mapping[str, Any], runs: Sequence[Mapping[str, Any]],
                  out: str, seconds: float, machine: str | None = None) -> str:
    machine = save_json(protocol, calibration=calibration, runs=runs, out=out, seconds=seconds, machine=machine)
    md = (f"# Local vs distributed vs central DP: test accuracy in % (mean ± SD over {len(protocol.seeds)} seeds)\n\n"
          f"Protocol, fixed before any private run (experiments/privacy_dp.py docstring): "
          f"{json.dumps(asdict(protocol))}\n\n{table(protocol, runs)}\n\n"
          f"Gaps: mean ± SD over the seeds of the seed-paired differences, in points. `distributed_cz`: the "
          f"distributed mechanism at central's z (a diagnostic: its Skellam-accounted ε is above the target, see "
          f"below).\n\n## Goals\n\n"
          + "\n".join(f"- {g}" for g in goals(protocol, runs))
          + f"\n\n## Noise calibrated per cell\n\n{acct.calibration_table(calibration)}\n\n"
          f"{len(runs)} runs, {seconds / 60:.1f} min on {machine}.\n")
    with open(os.path.join(out, f"{PREFIX}.md"), "w") as fh:
        fh.write(md)
    plot(protocol, runs, path=os.path.join(out, f"{PREFIX}.png"))
    return md


def run(protocol: Protocol, *, out: str, jobs: int, progress: bool = True) -> str:
    from tqdm import tqdm

    started = time.perf_counter()
    records = {name: {"digits": 1797, "tissue": protocol.tissue_images}[name] for name in protocol.datasets}
    calibration = acct.calibrate(protocol, dims={name: dim_of(protocol, name) for name in protocol.datasets},
                                 records=records)  # every record of the task: a bound on any round's sample
    runs: list[dict[str, Any]] = []
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"  # inherited by the pool: one thread each, no oversubscription of 2 cores
    with tempfile.TemporaryDirectory(prefix="privacy-data-") as folder:
        cache_data(protocol, folder)
        todo = tasks(protocol, calibration)
        bar = tqdm(total=len(todo), desc="privacy runs", file=sys.stdout, disable=not progress)
        if jobs <= 1:  # in-process: no pool start-up (the smoke test)
            for t in todo:
                runs.append(run_task(t, protocol=protocol, folder=folder))
                bar.update()
        else:
            with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
                futures = [pool.submit(run_task, t, protocol=protocol, folder=folder) for t in todo]
                for fut in as_completed(futures):
                    runs.append(fut.result())
                    bar.update()
                    if len(runs) % CHECKPOINT == 0:  # a run stopped early keeps what finished (--report)
                        save_json(protocol, calibration=calibration, runs=runs, out=out,
                                  seconds=time.perf_counter() - started)
        bar.close()
    runs.sort(key=lambda r: (r["dataset"], r["sites"], r["mode"], r["epsilon"] or 0.0, r["seed"]))
    return write_results(protocol, calibration=calibration, runs=runs, out=out,
                         seconds=time.perf_counter() - started)


def dim_of(protocol: Protocol, name: str) -> int:
    """The model's parameter count d for a task (the Skellam accounting's rounding term needs it)."""
    inputs = {"digits": 64, "tissue": 3 * (28 // protocol.tissue_pool) ** 2}[name]
    classes = {"digits": 10, "tissue": 9}[name]
    return inputs * protocol.hidden + protocol.hidden + protocol.hidden * classes + classes


def pilot(protocol: Protocol, seed: int = 99) -> dict[str, dict[float, float]]:
    """The non-private runs lr was chosen by: one site holding all training data, no noise, seed 99."""
    from dataclasses import replace

    out: dict[str, dict[float, float]] = {}
    with tempfile.TemporaryDirectory(prefix="privacy-pilot-") as folder:
        p = replace(protocol, seeds=(seed,))
        cache_data(p, folder)
        for name in p.datasets:
            for lr in (0.2, 0.5, 1.0, 2.0):
                fed = federation(p, folder=folder, name=name, seed=seed, n_sites=1)
                res = federated_dp_sgd(spec=replace(p, lr=lr).spec(), noise=Noise(NON_PRIVATE), sites=fed["sites"],
                                       test=fed["test"], classes=fed["classes"], seed=seed)
                out.setdefault(name, {})[lr] = res["accuracy"]
                print(f"pilot {name} lr={lr}: {res['accuracy']:.3f}", flush=True)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run of seconds")
    parser.add_argument("--out", help="results folder (default experiments/results, or a temporary one with --quick)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="pool processes")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--pilot", action="store_true", help="print the non-private lr pilot and exit")
    parser.add_argument("--report", action="store_true", help="rewrite table and plot from --out's privacy.json")
    args = parser.parse_args(argv)
    if args.pilot:
        pilot(Protocol())
        return 0
    if args.report:
        out = args.out or RESULTS
        with open(os.path.join(out, f"{PREFIX}.json")) as fh:
            saved = json.load(fh)
        protocol = Protocol(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved["protocol"].items()})
        print(write_results(protocol, calibration=saved["calibration"], runs=saved["runs"], out=out,
                            seconds=saved["seconds"], machine=saved["machine"]))
        return 0
    protocol = quick_protocol() if args.quick else Protocol()
    out = args.out or (tempfile.mkdtemp(prefix="privacy-") if args.quick else RESULTS)
    print(run(protocol, out=out, jobs=args.jobs, progress=not args.no_progress))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
