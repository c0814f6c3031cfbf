"""Benchmark 6: local training speed with and without Opacus DP-SGD on the worker's real training path.

`worker.training.train_local` on the digits data set (1,797 samples, SGD), for the demo MLP (64-64-10)
and a small CNN (two 3×3 conv + GroupNorm + max-pool blocks, then a linear layer). Samples/s is the
trainer's own `samples_per_second` (samples seen ÷ seconds of its training loop, Opacus's wrapping
included). The goal is checked at the worker's configuration, batch 32, with the trainer's pinned
grad-sample mode; its other modes are run by switching `worker.training.GRAD_SAMPLE_MODE`. Two kinds
of rows only inform: the previous trainer design (Opacus's `PrivacyEngine.make_private`: DPDataLoader,
stock DPOptimizer, hooks, ε computed after training; not the worker's path any more), kept to show
the change in the same run, and the worker's path at batches 128 and 512, to show how the cost
scales. Every variant of a row group runs once per repeat, interleaved, so load from other work on
the machine hits them alike.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bench.harness import Goal, Section, Stat

if TYPE_CHECKING:
    from fedbroker.config import DPPolicy
    from fedbroker.spec import TrainingConfig

MODES = ("ew", "hooks", "functorch")  # grad-sample modes whose per-sample gradients the trainer clips
LARGE_BATCHES = (128, 512)
MODELS: dict[str, dict[str, Any]] = {
    "MLP 64-64-10": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 64}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 64, "out_features": 10}]},
    "small CNN": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Conv2d", "in_channels": 1, "out_channels": 16, "kernel_size": 3, "padding": 1},
        {"type": "GroupNorm", "num_groups": 4, "num_channels": 16}, {"type": "ReLU"},
        {"type": "MaxPool2d", "kernel_size": 2},
        {"type": "Conv2d", "in_channels": 16, "out_channels": 32, "kernel_size": 3, "padding": 1},
        {"type": "GroupNorm", "num_groups": 4, "num_channels": 32}, {"type": "ReLU"},
        {"type": "MaxPool2d", "kernel_size": 2},
        {"type": "Flatten"}, {"type": "Linear", "in_features": 128, "out_features": 10}]},
}


def run(*, quick: bool) -> Section:
    import torch

    from fedbroker.config import DPPolicy
    from fedbroker.model import build_model
    from fedbroker.spec import TrainingConfig, parse_model
    from fedbroker.worker import training
    from fedbroker.worker.accounting import dp_sample_rate, planned_steps, project_epsilon
    from fedbroker.worker.data import load_dataset
    from fedbroker.worker.training import train_local

    started = time.perf_counter()
    section = Section(
        "dp_training", "6. DP training cost",
        "Worker training throughput (samples/s) on digits with SGD, without DP and with Opacus DP-SGD "
        "(noise 1.0, clip 1.0, Poisson sampling); slowdown = samples/s without DP ÷ with DP in the same row group.",
    )
    data = load_dataset("digits")
    x, y = data.x, data.y
    epochs = 1 if quick else 2
    repeats = 2 if quick else 4
    policy = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=1e9)
    pinned = training.GRAD_SAMPLE_MODE
    default_threads = torch.get_num_threads()
    thread_counts = [1] if quick else sorted({default_threads, 1})  # 1 first: the others are checked against it
    section.notes.append(
        f"torch {torch.__version__} (default {default_threads} intra-op threads), {epochs} epoch(s) of {len(y)} "
        f"samples per run, {repeats} runs per cell after one warm-up; the worker trains with torch's default "
        "thread count" + (", so both counts are shown." if len(thread_counts) > 1 else " (quick mode: 1 thread only)."))

    def rate(model: Any, config: TrainingConfig, dp: DPPolicy | None, mode: str, seed: int) -> float:
        training.GRAD_SAMPLE_MODE = mode
        try:
            return train_local(model, x, y, config=config, dp=dp, seed=seed).samples_per_second
        finally:
            training.GRAD_SAMPLE_MODE = pinned

    def measure(variants: dict[str, Callable[[int], float]]) -> dict[str, Stat]:
        values: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(repeats + 1):  # the first round warms up torch and Opacus
            for name, fn in variants.items():
                value = fn(i)
                if i:
                    values[name].append(value)
        return {name: Stat.of(v, "samples/s") for name, v in values.items()}

    def add_rows(model_name: str, batch: int, threads: int, stats: dict[str, Stat]) -> tuple[float, dict[str, float]]:
        plain = stats.pop("no DP")
        section.rows.append({"model": model_name, "batch": batch, "torch threads": threads, "training": "no DP",
                             "samples/s": plain, "slowdown ×": 1.0})
        slowdowns = {}
        for name, stat in stats.items():
            slowdowns[name] = plain.median / stat.median
            section.rows.append({"model": model_name, "batch": batch, "torch threads": threads, "training": name,
                                 "samples/s": stat, "slowdown ×": round(slowdowns[name], 2)})
        return plain.median, slowdowns

    pinned_label = f"DP ({pinned}, pinned)"
    try:
        for model_name, spec in MODELS.items():
            model = build_model(parse_model(spec), seed=0)
            config = TrainingConfig(local_epochs=epochs, batch_size=32, lr=0.05)
            one_thread_plain = one_thread_slowdown = 0.0
            for threads in thread_counts:
                torch.set_num_threads(threads)
                variants: dict[str, Callable[[int], float]] = {
                    "no DP": lambda i: rate(model, config, None, pinned, i),
                    pinned_label: lambda i: rate(model, config, policy, pinned, i),
                }
                if not quick:
                    if threads == 1:
                        for mode in MODES:
                            if mode != pinned:
                                variants[f"DP ({mode})"] = lambda i, m=mode: rate(model, config, policy, m, i)
                    variants["DP, previous design (make_private, hooks)"] = (
                        lambda i: _make_private_rate(model, x, y, config=config, dp=policy, seed=i))
                plain, slowdowns = add_rows(model_name, 32, threads, measure(variants))
                slowdown = slowdowns[pinned_label]
                if threads == 1:
                    one_thread_plain, one_thread_slowdown = plain, slowdown
                # With other work on the cores, torch's OpenMP threads can wait on each other for whole time
                # slices; a baseline slowed that way says nothing about DP, so its goal is not judged.
                collapsed = plain < 0.5 * one_thread_plain
                section.goals.append(Goal(
                    f"{model_name}, batch 32, {threads} torch thread(s): DP slowdown ({pinned})",
                    round(slowdown, 2), "≤ 2×", None if collapsed else slowdown <= 2.0,
                    f"not judged: no DP ran at {plain / one_thread_plain:.0%} of its 1-thread speed (CPU contention)"
                    if collapsed else ""))
                previous = slowdowns.get("DP, previous design (make_private, hooks)")
                if previous is not None:
                    section.notes.append(f"{model_name}, {threads} thread(s): DP slowdown {previous:.2f}× with the "
                                         f"previous design, {slowdown:.2f}× now.")
            if not quick:
                torch.set_num_threads(1)
                by_batch = [f"{one_thread_slowdown:.2f}× at 32"]
                for batch in LARGE_BATCHES:
                    big = TrainingConfig(local_epochs=epochs, batch_size=batch, lr=0.05)
                    _, large = add_rows(model_name, batch, 1, measure({
                        "no DP": lambda i, c=big: rate(model, c, None, pinned, i),
                        pinned_label: lambda i, c=big: rate(model, c, policy, pinned, i),
                    }))
                    by_batch.append(f"{large[pinned_label]:.2f}× at {batch}")
                section.notes.append(
                    f"{model_name}, 1 thread, DP slowdown by batch size: {', '.join(by_batch)}. A larger batch spreads "
                    "the per-step overhead for both paths, but DP still forms, measures and clips one gradient per "
                    "sample (batch × parameters floats per step) where no DP forms one per batch.")
    finally:
        torch.set_num_threads(default_threads)
        training.GRAD_SAMPLE_MODE = pinned

    config = TrainingConfig(local_epochs=epochs, batch_size=32)
    t0 = time.perf_counter()
    project_epsilon([], noise_multiplier=policy.noise_multiplier, sample_rate=dp_sample_rate(len(y), config),
                    steps=planned_steps(len(y), config), delta=policy.delta)
    section.notes.append(
        f"Not in samples/s: the ε projection each DP round makes before training (Opacus's RDP accountant, "
        f"{1e3 * (time.perf_counter() - t0):.0f} ms here); the trainer reports that projection as the round's ε "
        "when the accountant recorded exactly the planned steps, instead of computing it a second time.")
    section.notes.append(
        "Opacus's \"ghost\" mode (fast gradient clipping) is not a trainer mode, so it has no row: it never forms "
        "per-sample gradients (it clips by a second backward pass through a wrapped criterion); the docstring of "
        "fedbroker.worker.training records how it compared.")
    section.seconds = time.perf_counter() - started
    return section


def _make_private_rate(model: Any, x: Any, y: Any, *, config: TrainingConfig, dp: DPPolicy, seed: int) -> float:
    """Samples/s of the previous trainer design, timed as that trainer timed itself.

    Opacus's `PrivacyEngine.make_private` (Poisson DPDataLoader over a TensorDataset, stock
    DPOptimizer, hooks), its accountant's ε computed after training; a reference, not the worker's path.
    """
    import torch
    from opacus import PrivacyEngine
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(seed)
    work = copy.deepcopy(model)
    work.train()
    optimizer = torch.optim.SGD(work.parameters(), lr=config.lr)
    x_t, y_t = torch.as_tensor(x, dtype=torch.float32), torch.as_tensor(y, dtype=torch.int64)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its reminder that secure_mode is off
        engine = PrivacyEngine(accountant="rdp")
    loader = DataLoader(TensorDataset(x_t, y_t), batch_size=config.batch_size,
                        generator=torch.Generator().manual_seed(seed))
    wrapped, dp_optimizer, dp_loader = engine.make_private(
        module=work, optimizer=optimizer, data_loader=loader, noise_multiplier=dp.noise_multiplier,
        max_grad_norm=dp.max_grad_norm, poisson_sampling=True, grad_sample_mode="hooks",
        noise_generator=torch.Generator().manual_seed(seed + 1))
    seen = 0
    for _ in range(config.local_epochs):
        for xb, yb in dp_loader:
            dp_optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(wrapped(xb), yb)
            loss.backward()
            dp_optimizer.step()
            float(loss.detach())
            seen += len(yb)
    wrapped.cleanup()
    engine.accountant.get_epsilon(delta=dp.delta)
    return seen / (time.perf_counter() - start)
