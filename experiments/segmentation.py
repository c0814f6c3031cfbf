"""The seed NAFI paper's U-Net experiment (Table 4), shrunk to a shared 2-core machine, on a *synthetic* lesion set.

    python -m experiments.segmentation            # full run → experiments/results/segmentation.{json,md,png}
    python -m experiments.segmentation --quick    # plumbing smoke run into a temporary folder unless --out

Protocol (fixed before any run; nothing below is tuned per method, and nothing was tuned on these results):
- Data: `experiments.lesions` (synthetic CT-like 24×24 slices with lesions; the recipe is in its docstring).
  Per seed, `train_total` = 256 training slices split over J sites with Dirichlet(α = 0.5) sizes (each ≥ 8; the
  paper's partition with K = 1, where only the sizes differ) and a scanner/contrast/lesion-size style per site;
  a test set of 160 slices from the population. J ∈ {8, 16}; seeds 0, 1, 2.
- Model: a 2-level U-Net, channels 8-16-32, BatchNorm after every 3×3 conv (`experiments.segmentation_net`),
  13 weighted layers, so 13 communication rounds for every method (the paper: the original 4-level U-Net,
  19 rounds, "equal to the number of layers").
- Local training through `fedbroker.worker.training.train_local` (the workers' code), task `segmentation`
  (per-pixel cross-entropy + soft Dice, dice_weight 1), Adam, lr 0.01 (the paper: RMSprop, lr 0.01, batch 3,
  3 epochs; RMSprop is not one of our optimizers), batch 16, 1 local epoch per round (2 for the local models'
  first training before the layer-wise round 1, standing in for the paper's pre-trained local models).
- FedAvg and FedProx (μ = 0.01; the paper gives none): every site starts from one shared initialisation (as the
  paper's FedAvg/FedProx), trains, the server averages every tensor (BatchNorm statistics included) by sample
  count; 13 rounds.
- PFNM and NAFI, layer-wise (NAFI Appendix D, Algorithm 2) through `fedbroker.aggregators.alignment.concat`: local
  models from independent initialisations (fusing pre-trained models, PFNM's setting) train 2 epochs; round r
  folds each site's BatchNorm of layer r−1 into its conv (Appendix E), matches that layer across sites (the
  matching engine of `pfnm`/`nafi`, with the NAFI authors' σ² = 1, σ0² = 0.5, γ0 = 10; NAFI λ = 0.01, our default,
  where the paper took the best λ of a grid on its test results), sets it to the mean of the units placed on each
  global unit, moves every reader's input channels (the decoder conv behind a skip included), freezes it, and the
  sites train the layers above for an epoch; the output layer (round 13) is the per-class average by each site's
  pixel share of each class (Algorithm 2, line 7). A matched layer may grow to at most 2× its site width (a
  compute bound; the paper states none). The global network after round r (the matched layers, then the mean
  of the sites' layers above) is evaluated for the per-round plot.
- FedAvg under DP: the same FedAvg with GroupNorm in place of BatchNorm (Opacus cannot train BatchNorm: per-sample
  gradients through batch statistics are not defined), DP-SGD through train_local (Opacus), clip norm 1.0,
  δ = 1e-5, one noise multiplier for every site, the least (to 0.01) that keeps the smallest site's ε after the 13
  rounds at ≤ 8 (Opacus's RDP accountant; larger sites sample a smaller fraction per step and spend less).
- Score: foreground (lesion) Dice in percent pooled over every test pixel, after every round. Reported: the final
  round's Dice (our headline), the best round's Dice (what the paper's Table 4 reports: "the best result during
  all 19 communication rounds", an optimistic, test-set-picked number; labelled so), and the local models' mean
  Dice before any aggregation ("Local NN").

What was shrunk relative to the paper and why (≤ ~25 min on 2 shared cores): 2-level U-Net with 8-16-32 channels
(13 layers, 13 rounds) in place of the original U-Net (19 rounds); 24×24 synthetic slices in place of CIMC's car
photographs; 256 training slices (a timing run of FedAvg at J = 16 with 32×32 slices and 384 training slices took
108 s on the loaded machine, which put the whole study near an hour); 1 local epoch per round; 3 seeds in place of 5; no OT-fusion column.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from experiments.harness import training_seed
from experiments.lesions import make_population, make_site, site_sizes, site_styles
from experiments.segmentation_net import (
    GRAPH,
    N_LAYERS,
    OUT,
    Client,
    UNet,
    average_states,
    client_of,
    dice,
    frozen_names,
    mean_client,
    model_of,
    widths_for,
)
from fedbroker.aggregators.alignment.concat import class_average, match_graph_layer, with_width_cap
from fedbroker.algorithms.params import MatchingParams
from fedbroker.config import DPPolicy
from fedbroker.job.spec import TrainingConfig
from fedbroker.job.task import TaskConfig
from fedbroker.privacy import dp_sample_rate, planned_steps, project_epsilon
from fedbroker.worker.training import train_local

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
METHODS = ("FedAvg", "FedProx", "PFNM", "NAFI", "FedAvg + DP")
PAPER = {  # NAFI Table 4, test Dice of U-Net on CIMC (best of 19 rounds), mean ± SD over 5 trials
    8: {"Local NN": "67.60 ± 9.38", "FedAvg": "53.28 ± 10.63", "FedProx": "41.53 ± 0.82", "PFNM": "90.31 ± 2.90",
        "NAFI": "96.47 ± 0.76"},
    16: {"Local NN": "27.84 ± 12.16", "FedAvg": "42.62 ± 0.87", "FedProx": "48.50 ± 9.52", "PFNM": "75.47 ± 3.54",
         "NAFI": "83.46 ± 3.41"},
}


@dataclass(frozen=True)
class Protocol:
    """The settings above, as numbers."""

    sizes: tuple[int, ...] = (8, 16)
    seeds: tuple[int, ...] = (0, 1, 2)
    methods: tuple[str, ...] = METHODS
    image: int = 24
    train_total: int = 256
    test: int = 160
    alpha: float = 0.5
    min_site: int = 8
    channels: tuple[int, int, int] = (8, 16, 32)
    lr: float = 0.01
    batch_size: int = 16
    local_epochs: int = 1
    pretrain_epochs: int = 2
    proximal_mu: float = 0.01
    sigma2: float = 1.0
    sigma0_2: float = 0.5
    gamma0: float = 10.0
    nafi_lambda: float = 0.01
    width_cap: float = 2.0
    dp_epsilon: float = 8.0
    dp_delta: float = 1e-5
    dp_clip: float = 1.0

    @property
    def rounds(self) -> int:
        """One round per weighted layer, for every method."""
        return N_LAYERS


QUICK = Protocol(sizes=(3,), seeds=(0,), image=16, train_total=36, test=12, min_site=8, channels=(2, 4, 4),
                 batch_size=8, pretrain_epochs=1)
TASK = TaskConfig(type="segmentation", classes=2, dice_weight=1.0)


@dataclass(frozen=True)
class Federation:
    """One seed's sites and test set."""

    xs: list[np.ndarray]
    ys: list[np.ndarray]
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def counts(self) -> np.ndarray:
        return np.array([len(y) for y in self.ys], dtype=np.float64)

    def class_shares(self) -> np.ndarray:
        """(sites × 2) pixel counts of background and lesion."""
        return np.array([[np.sum(y == 0), np.sum(y == 1)] for y in self.ys], dtype=np.float64)


def federation(p: Protocol, n_sites: int, seed: int) -> Federation:
    """The seed's synthetic sites (sizes, styles) and population test set (see `experiments.lesions`)."""
    rng = np.random.default_rng([seed, n_sites, 7])
    styles = site_styles(n_sites, p.image, rng)
    sizes = site_sizes(p.train_total, n_sites, p.alpha, p.min_site, rng)
    xs, ys = zip(*(make_site(n, p.image, s, rng) for n, s in zip(sizes, styles)))
    x_test, y_test = make_population(p.test, p.image, np.random.default_rng([seed, 99]))
    return Federation(list(xs), list(ys), x_test, y_test)


def _config(p: Protocol, epochs: int, mu: float = 0.0) -> TrainingConfig:
    return TrainingConfig(rounds=p.rounds, local_epochs=epochs, batch_size=p.batch_size, optimizer="adam", lr=p.lr,
                          proximal_mu=mu)


def _init(widths: list[int], norm: str, seed: int) -> UNet:
    torch.manual_seed(seed)
    return UNet(widths, [norm] * N_LAYERS)


# ---------------------------------------------------------------- FedAvg, FedProx, FedAvg + DP


def noise_for(n: int, config: TrainingConfig, rounds: int, *, epsilon: float, delta: float,
              tol: float = 0.01) -> float:
    """The smallest noise multiplier (to `tol`) whose ε after `rounds` rounds of `config` on n samples is ≤ ε."""
    q, steps = dp_sample_rate(n, config), rounds * planned_steps(n, config)
    lo, hi = 0.3, 20.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if project_epsilon([], noise_multiplier=mid, sample_rate=q, steps=steps, delta=delta) <= epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def run_fedavg(p: Protocol, fed: Federation, seed: int, method: str, tick: Callable[[], None]) -> dict[str, Any]:
    """FedAvg / FedProx / FedAvg + DP: `p.rounds` rounds from one shared initialisation."""
    dp = method == "FedAvg + DP"
    widths = widths_for(p.channels)
    global_model = _init(widths, "gn" if dp else "bn", seed)
    config = _config(p, p.local_epochs, p.proximal_mu if method == "FedProx" else 0.0)
    sigma = noise_for(min(len(y) for y in fed.ys), config, p.rounds, epsilon=p.dp_epsilon, delta=p.dp_delta) \
        if dp else 0.0
    policies = [DPPolicy(noise_multiplier=sigma, max_grad_norm=p.dp_clip, delta=p.dp_delta,
                         epsilon_budget=p.dp_epsilon) if dp else None for _ in fed.ys]
    histories: list[Sequence[Sequence[float]]] = [[] for _ in fed.ys]
    eps = [0.0] * len(fed.ys)
    per_round = []
    for r in range(1, p.rounds + 1):
        states = []
        for k, (x, y) in enumerate(zip(fed.xs, fed.ys)):
            local = _init(widths, "gn" if dp else "bn", seed)
            local.load_state_dict(global_model.state_dict())
            res = train_local(local, x, y, config=config, dp=policies[k], history=histories[k],
                              seed=training_seed(seed, r, k), task=TASK)
            histories[k], eps[k] = res.history, res.epsilon or 0.0
            states.append(res.state)
        global_model.load_state_dict(average_states(states, fed.counts))
        per_round.append(dice(global_model, fed.x_test, fed.y_test))
        tick()
    out: dict[str, Any] = {"dice": per_round}
    if dp:
        out["epsilon_max"] = max(eps)
        out["epsilon_per_site"] = list(eps)
        out["noise_multiplier"] = sigma
    return out


# ---------------------------------------------------------------- PFNM, NAFI (layer-wise, BatchNorm folded)


def _train_client(client: Client, x: np.ndarray, y: np.ndarray, config: TrainingConfig, frozen_upto: int,
                  seed: int) -> Client:
    model = model_of(client)
    train_local(model, x, y, config=config, dp=None, seed=seed, task=TASK,
                frozen=frozen_names(frozen_upto) if frozen_upto >= 0 else ())
    return client_of_frozen(model, client, frozen_upto)


def client_of_frozen(model: UNet, before: Client, frozen_upto: int) -> Client:
    """The trained model as a Client, its folded layers 0..frozen_upto keeping no BatchNorm."""
    after = client_of(model)
    for i in range(frozen_upto + 1):
        after.bns[i] = None
    for i, bn in enumerate(before.bns):
        if bn is None:
            after.bns[i] = None
    return after


def run_matching(p: Protocol, fed: Federation, seed: int, method: str, tick: Callable[[], None]) -> dict[str, Any]:
    """Layer-wise PFNM or NAFI on the U-Net's concat graph (see the module's docstring)."""
    widths = widths_for(p.channels)
    params = MatchingParams(sigma2=p.sigma2, sigma0_2=p.sigma0_2, gamma0=p.gamma0,
                            lam=p.nafi_lambda if method == "NAFI" else 0.0)
    pre, config = _config(p, p.pretrain_epochs), _config(p, p.local_epochs)
    clients = []
    for k, (x, y) in enumerate(zip(fed.xs, fed.ys)):
        clients.append(_train_client(client_of(_init(widths, "bn", seed * 1000 + k + 1)), x, y, pre, -1,
                                     training_seed(seed, 0, k)))
    local_dice = [dice(model_of(c), fed.x_test, fed.y_test) for c in clients]
    per_round, global_widths = [], []
    for ell in range(N_LAYERS):
        if ell == OUT:
            out = class_average([c.layers[OUT] for c in clients], fed.class_shares())
            final = Client(clients[0].layers[:OUT] + [out], clients[0].bns)
            per_round.append(dice(model_of(final), fed.x_test, fed.y_test))
            tick()
            break
        folded = [c.folded(ell) for c in clients]
        capped = with_width_cap(params, int(np.ceil(p.width_cap * widths[ell])))
        nets, match = match_graph_layer(GRAPH, [c.layers for c in folded], ell, weights=fed.counts, params=capped,
                                        rng=np.random.default_rng([seed, len(clients), ell]))
        clients = [Client(net, c.bns) for net, c in zip(nets, folded)]
        global_widths.append(match.width)
        per_round.append(dice(model_of(mean_client(clients, fed.counts)), fed.x_test, fed.y_test))
        if ell + 1 < OUT:
            clients = [_train_client(c, x, y, config, ell, training_seed(seed, ell + 1, k))
                       for k, (c, x, y) in enumerate(zip(clients, fed.xs, fed.ys))]
        tick()
    return {"dice": per_round, "local_dice": local_dice, "global_widths": global_widths}


# ---------------------------------------------------------------- the study


def study(p: Protocol, *, progress: bool = True) -> dict[str, Any]:
    """Every (J, seed, method) run; Dice per round."""
    total = len(p.sizes) * len(p.seeds) * len(p.methods) * p.rounds
    bar = tqdm(total=total, desc="segmentation rounds", disable=not progress, mininterval=5.0)
    runs: list[dict[str, Any]] = []
    try:
        for n_sites in p.sizes:
            for seed in p.seeds:
                fed = federation(p, n_sites, seed)
                for method in p.methods:
                    started = time.perf_counter()
                    runner = run_matching if method in ("PFNM", "NAFI") else run_fedavg
                    result = runner(p, fed, seed, method, bar.update)
                    result.update(J=n_sites, seed=seed, method=method, seconds=time.perf_counter() - started,
                                  site_sizes=[len(y) for y in fed.ys])
                    runs.append(result)
    finally:
        bar.close()
    return {"protocol": asdict(p), "runs": runs}


def cell(runs: Sequence[dict[str, Any]], n_sites: int, method: str, key: str) -> list[float]:
    """One number per seed: `final` (last round), `best` (best round) or `local` (local models' mean)."""
    chosen = [r for r in runs if r["J"] == n_sites and r["method"] == method]
    if key == "final":
        return [r["dice"][-1] for r in chosen]
    if key == "best":
        return [max(r["dice"]) for r in chosen]
    return [float(np.mean(r["local_dice"])) for r in chosen if "local_dice" in r]


def _pm(values: Sequence[float]) -> str:
    if not values:
        return "—"
    return f"{np.mean(values):.2f} ± {np.std(values, ddof=1) if len(values) > 1 else 0.0:.2f}"


def table(result: dict[str, Any]) -> str:
    """The markdown table: Dice (final, best round) mean ± SD over seeds, the paper's number beside."""
    p, runs = result["protocol"], result["runs"]
    lines = [f"Test Dice (%) of the U-Net on the **synthetic** lesion set, mean ± SD over seeds {p['seeds']}; "
             f"{len(p['seeds'])} runs per cell. Paper: NAFI Table 4 (CIMC, best of 19 rounds, 5 trials).", "",
             "| J | method | final round (ours, synthetic) | best round (ours, synthetic) | paper (CIMC, best round) |",
             "|---|---|---|---|---|"]
    for n_sites in p["sizes"]:
        local = cell(runs, n_sites, "PFNM", "local") + cell(runs, n_sites, "NAFI", "local")
        paper = PAPER.get(n_sites, {})
        lines.append(f"| {n_sites} | Local NN (mean of the local models) | {_pm(local)} | — | "
                     f"{paper.get('Local NN', '—')} |")
        for method in p["methods"]:
            lines.append(f"| {n_sites} | {method} | {_pm(cell(runs, n_sites, method, 'final'))} | "
                         f"{_pm(cell(runs, n_sites, method, 'best'))} | {paper.get(method, '—')} |")
    gaps = []
    for n_sites in p["sizes"]:
        d = np.subtract(cell(runs, n_sites, "NAFI", "final"), cell(runs, n_sites, "PFNM", "final"))
        if d.size:
            gaps.append(f"J = {n_sites}: NAFI − PFNM (final) per seed {', '.join(f'{v:+.2f}' for v in d)}")
    dp = [r["epsilon_max"] for r in runs if "epsilon_max" in r]
    notes = [""] + [f"- {g}" for g in gaps]
    if dp:
        notes.append(f"- FedAvg + DP: GroupNorm U-Net, clip {p['dp_clip']}, δ = {p['dp_delta']:g}; largest site ε "
                     f"after {N_LAYERS} rounds {max(dp):.2f} (target {p['dp_epsilon']:g}).")
    return "\n".join(lines + notes) + "\n"


def plot(result: dict[str, Any], path: str) -> None:
    """Dice per round, mean ± SD over seeds, one panel per J."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p, runs = result["protocol"], result["runs"]
    fig, axes = plt.subplots(1, len(p["sizes"]), figsize=(5.5 * len(p["sizes"]), 4), squeeze=False)
    for ax, n_sites in zip(axes[0], p["sizes"]):
        for method in p["methods"]:
            curves = np.array([r["dice"] for r in runs if r["J"] == n_sites and r["method"] == method])
            if curves.size == 0:
                continue
            x = np.arange(1, curves.shape[1] + 1)
            mean, sd = curves.mean(axis=0), curves.std(axis=0)
            ax.plot(x, mean, marker="o", ms=3, label=method)
            ax.fill_between(x, mean - sd, mean + sd, alpha=0.15)
        ax.set_title(f"J = {n_sites} sites (synthetic lesions)")
        ax.set_xlabel("round (layer-wise: layer matched)")
        ax.set_ylabel("test Dice (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out: str, protocol: Protocol, *, progress: bool = True) -> dict[str, Any]:
    """The study, written to OUT/segmentation.{json,md,png}."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one intra-op thread beats two on 2 shared cores
    started = time.perf_counter()
    try:
        result = study(protocol, progress=progress)
    finally:
        torch.set_num_threads(threads)
    result["seconds"] = time.perf_counter() - started
    write(out, result)
    return result


def write(out: str, result: dict[str, Any]) -> None:
    """OUT/segmentation.json, the table (.md) and the plot (.png)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "segmentation.json"), "w") as fh:
        json.dump(result, fh, indent=1, default=float)
    with open(os.path.join(out, "segmentation.md"), "w") as fh:
        fh.write("# NAFI Table 4 protocol: U-Net, layer-wise matching, Dice (synthetic lesions)\n\n" + table(result)
                 + f"\nRuntime {result['seconds']:.0f} s of wall time on {os.cpu_count()} CPU cores shared with other "
                 f"work (summed over the parts run side by side: {result.get('parts', 1)}).\n")
    plot(result, os.path.join(out, "segmentation.png"))


def merge(parts: Sequence[str], out: str) -> dict[str, Any]:
    """The results of runs over disjoint J (`--sizes`), each in its own folder, as one study in OUT."""
    loaded = []
    for folder in parts:
        with open(os.path.join(folder, "segmentation.json")) as fh:
            loaded.append(json.load(fh))
    protocol = dict(loaded[0]["protocol"])
    protocol["sizes"] = [n for part in loaded for n in part["protocol"]["sizes"]]
    for part in loaded[1:]:
        if {k: v for k, v in part["protocol"].items() if k != "sizes"} != \
                {k: v for k, v in loaded[0]["protocol"].items() if k != "sizes"}:
            raise SystemExit(f"the parts {list(parts)} ran different protocols")
    result = {"protocol": protocol, "runs": [r for part in loaded for r in part["runs"]],
              "seconds": sum(part["seconds"] for part in loaded), "parts": len(loaded)}
    write(out, result)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny plumbing run (one J, one seed, 16×16)")
    parser.add_argument("--out", help=f"output folder (default {RESULTS}; a temporary folder with --quick)")
    parser.add_argument("--sizes", type=int, nargs="+", help="only these J (to run parts side by side, then --merge)")
    parser.add_argument("--merge", nargs="+", metavar="FOLDER", help="merge the parts' folders into --out")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    out = args.out or (tempfile.mkdtemp(prefix="segmentation-quick-") if args.quick else RESULTS)
    if args.merge:
        merge(args.merge, out)
        print(f"wrote {out}", file=sys.stderr)
        return 0
    protocol = QUICK if args.quick else Protocol()
    if args.sizes:
        protocol = replace(protocol, sizes=tuple(args.sizes))
    result = run(out, protocol, progress=not args.no_progress)
    print(f"wrote {out} in {result['seconds']:.0f} s", file=sys.stderr)
    return 0


__all__ = ["Protocol", "federation", "main", "noise_for", "run", "study", "table"]

if __name__ == "__main__":
    raise SystemExit(main())
