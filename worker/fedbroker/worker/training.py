"""Local training on a worker, with Opacus DP-SGD under the data owner's own policy: the entry point
(`train_local`), which checks a task and prices it before any step, then runs one of the loops.

The job chooses the model and the optimisation settings (`fedbroker.job.spec.TrainingConfig`); the data
owner chooses the privacy (`fedbroker.config.DPPolicy`) and nothing in a job can override it. The ε
arithmetic (sampling rule, planned steps, projection, history) is `fedbroker.privacy`; the step loops
are `fedbroker.worker.training_loops`, the clipping modes `fedbroker.worker.clipping` and the
noise-average step `fedbroker.worker.dp_optimizer`.

Opacus is the DP engine: its DPOptimizers' mechanism (noise, averaging) and its RDP accountant, and
in two of the three clipping modes its per-sample gradients or norms. Its `PrivacyEngine.make_private`
is not used, for what it costs around them. Measured on
CPU (1 torch thread, digits, batch 32, SGD, same process; slowdown against no DP; two bench runs on
2026-11-25, 2 cores shared with other work), make_private → this design: MLP 64-64-10 5.4–6.6× →
1.63–1.68×; small CNN with GroupNorm 3.1–3.5× → 1.83–1.85× (tensor sampling and ε computed once, the
flat DP optimizers, then "ew" instead of "hooks", then "bk"). `python -m bench --only dp_training`
has the table.
- Threads: torch defaults to one intra-op thread per core. A second thread gained nothing with DP
  (MLP 41.4k against 40.8k samples/s, CNN 9.2k against 9.6k), and on a loaded machine 2 threads
  have run 10–100× slower, with and without DP (OpenMP threads waiting for each other for whole
  time slices). The count is the process's, so the worker process should set it
  (`torch.set_num_threads(1)`), not this function, which several workers of one demo process
  call at once.
- Training runs on a deep copy of the caller's module, so a module is never wrapped twice; the
  copy's parameter names carry no `_module.` prefix (it is stripped defensively all the same).
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.datasets.stream import FileSamples, check_memory, sample_bytes
from fedbroker.errors import BudgetExceeded, ConfigError
from fedbroker.evaluation import as_tensors
from fedbroker.job.spec import TrainingConfig
from fedbroker.job.task import TaskConfig
from fedbroker.privacy import (
    HistoryEntry,
    check_int,
    dp_sample_rate,
    epsilon_of,
    merge_steps,
    normalise_history,
    steps_per_epoch,
)
from fedbroker.tasks.losses import label_tensor, per_sample_loss, task_tensors
from fedbroker.worker.batches import Batches
from fedbroker.worker.clipping import CLIPPING_MODES, check_supported, clipping_mode
from fedbroker.worker.training_loops import LocalRun, train_dp, train_plain

if TYPE_CHECKING:
    from fedbroker.job.pipeline import DataPipeline

_PREFIX = "_module."
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    """What one local training produced.

    `state` has the keys and order of `model.state_dict()` (buffers included). `train_loss` is the
    sample-weighted mean loss of the last epoch's batches (before each step; no proximal term).
    `epsilon` is the job's total ε on this worker after this training (None without DP) and
    `history` the job's full accountant history to store for the next round. `clipping` is how the
    per-sample gradients were clipped ("bk", "ghost" or "ew", see `clipping_mode`; None without DP).
    """

    state: dict[str, np.ndarray]
    num_samples: int
    train_loss: float
    steps: int
    seconds: float
    samples_per_second: float
    epsilon: float | None
    history: list[HistoryEntry]
    clipping: str | None = None
    epsilon_local_floor: float | None = None  # distributed DP: the job's ε from this site's own noise share alone


@dataclass(frozen=True)
class _DPPlan:
    """What a DP training will do and cost, settled before any step: the policy, the clipping mode, the
    sampling rate, the job's accountant history after it, and the ε of that history."""

    policy: DPPolicy
    clipping: str
    sample_rate: float
    planned: list[HistoryEntry]
    epsilon: float


def train_local(
    model: nn.Module,
    x: np.ndarray | FileSamples,
    y: np.ndarray | FileSamples,
    *,
    config: TrainingConfig,
    dp: DPPolicy | None,
    history: Sequence[Sequence[float]] = (),
    device: str = "cpu",
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    clipping: str = "auto",
    physical_batch_size: int | None = None,
    frozen: Collection[str] = (),
    task: TaskConfig | None = None,
    pipeline: DataPipeline | None = None,
    memory_mib: int | None = None,
    cache: str = "",
) -> TrainResult:
    """Train `model` on (x, y) for `config.local_epochs`; with an enabled `dp`, as DP-SGD under the owner's policy.

    The caller's module is never wrapped: training runs on a deep copy and the trained weights are
    copied back into `model` at the end (so `fedbroker.evaluation.evaluate(model, ...)` sees them). With DP,
    a task whose projected ε exceeds `dp.epsilon_budget` raises BudgetExceeded before any step, and a
    module Opacus cannot train (BatchNorm, ...) raises ConfigError listing every problem. A policy
    with `enabled` false is the owner's choice of no DP, the same as None.

    `seed` fixes the batch sampling, the DP noise and any dropout, so one seed gives one result on
    CPU. With DP the seed must stay the worker's secret (never taken from a job): whoever knows it
    can regenerate and subtract the noise. Production workers should draw it from os.urandom.

    `clipping` picks how DP clips ("auto": `clipping_mode` at the expected batch size). `physical_batch_size` bounds
    one pass: a larger Poisson batch trains in chunks whose clipped gradients are summed and noised once (the
    same update and ε). `frozen` names parameters that do not train: no gradient, noise or step, so they come back
    bit for bit (the layer-wise mode's matched layers). `task` (default classification) chooses the loss and how
    `y` is read (`fedbroker.tasks.losses`); every loss is a mean of per-sample losses.

    `x` (`y`: masks) may be on files (`FileSamples`: `fedbroker.worker.batches`, within `memory_mib`, through the
    `cache` folder); `pipeline` (the job's data section) prepares every raw sample and augments training batches.
    """
    _check_arguments(model, seed=seed, clipping=clipping, physical_batch_size=physical_batch_size)
    task = task or TaskConfig()
    (x_in, y_in), n = _inputs(task, x, y), len(x)
    check_batch_memory(x, y, config=config, pipeline=pipeline, memory_mib=memory_mib,
                       dp=dp is not None and dp.enabled, physical_batch_size=physical_batch_size)
    entries = normalise_history(history)
    plan = _plan_dp(model, dp, entries, num_samples=n, config=config, clipping=clipping) \
        if dp is not None and dp.enabled else None
    work, run, (loss, seen, epsilon, out_history), seconds = _train_copy(
        model, x_in, y_in, num_samples=n, config=config, plan=plan, entries=entries, dev=torch.device(device),
        seed=seed, frozen=frozen, task=task, pipeline=pipeline, cache=cache, progress=progress,
        physical_batch_size=physical_batch_size)
    state = {_strip(k): v.detach().cpu().numpy().copy() for k, v in work.state_dict().items()}
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    return TrainResult(
        state=state, num_samples=n, train_loss=loss, steps=run.config.local_epochs * run.steps_per_epoch,
        seconds=seconds, samples_per_second=seen / seconds if seconds > 0 else float("inf"), epsilon=epsilon,
        history=out_history, clipping=plan.clipping if plan is not None else None,
    )


def _train_copy(model: nn.Module, x_in: torch.Tensor | FileSamples, y_in: torch.Tensor | FileSamples, *,
                num_samples: int, config: TrainingConfig, plan: _DPPlan | None, entries: list[HistoryEntry],
                dev: torch.device, seed: int, frozen: Collection[str], task: TaskConfig, pipeline: DataPipeline | None,
                cache: str, progress: Callable[[int, int], None] | None, physical_batch_size: int | None,
                ) -> tuple[nn.Module, LocalRun, tuple[float, int, float | None, list[HistoryEntry]], float]:
    """Train a throw-away copy of `model` (the caller's module is never wrapped): (the copy, its run, (loss, samples
    seen, ε after, history after), seconds of training)."""
    n = num_samples
    data_seed, noise_seed, torch_seed, augment_seed = _seeds(seed)
    fork_devices = [] if dev.type != "cuda" else [dev.index if dev.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(torch_seed)
        work = copy.deepcopy(model).to(dev)
        _freeze(work, frozen)
        work.train()
        anchor = [p.detach().clone() for p in work.parameters()] if config.proximal_mu > 0 else None
        start = time.perf_counter()
        batches = Batches(x_in, y_in, pipeline=pipeline, device=dev, cache=cache,
                          generator=torch.Generator().manual_seed(augment_seed))
        run = LocalRun(work=work, optimizer=_make_optimizer(work, config), fetch=batches.fetch, num_samples=n,
                       config=config, steps_per_epoch=steps_per_epoch(n, config), device=dev, anchor=anchor,
                       data_gen=torch.Generator().manual_seed(data_seed), progress=progress,
                       loss=functools.partial(per_sample_loss, task), prefetch=batches.prefetch)
        try:
            loss, seen, epsilon, out_history = _loops(run, plan, entries, physical_batch_size=physical_batch_size,
                                                      noise_gen=torch.Generator(device=dev).manual_seed(noise_seed))
        finally:
            batches.close()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - start
    return work, run, (loss, seen, epsilon, out_history), seconds


def _seeds(seed: int) -> tuple[int, int, int, int]:
    """Independent streams (batches, noise, torch's global RNG for dropout, augmentation) from one seed; the fourth
    leaves the first three as they were before it (SeedSequence's words do not depend on how many are asked)."""
    a, b, c, d = (int(s) >> 1 for s in np.random.SeedSequence(seed).generate_state(4, np.uint64))
    return a, b, c, d


def _loops(run: LocalRun, plan: _DPPlan | None, entries: list[HistoryEntry], *, physical_batch_size: int | None,
           noise_gen: torch.Generator) -> tuple[float, int, float | None, list[HistoryEntry]]:
    """(loss, samples seen, ε after, the job's history after) of the plain loop or, with a plan, the DP loop."""
    if plan is None:
        loss, seen = train_plain(run)
        return loss, seen, None, entries
    loss, seen, out_history = train_dp(run, dp=plan.policy, history=entries, sample_rate=plan.sample_rate,
                                       noise_gen=noise_gen, clipping=plan.clipping,
                                       physical_batch_size=physical_batch_size)
    # The projection already ran a fresh RDP accountant on exactly this history; only a history that differs
    # from the plan (which training never produces) is worth a second computation.
    epsilon = plan.epsilon if out_history == plan.planned else epsilon_of(out_history, delta=plan.policy.delta)
    return loss, seen, epsilon, out_history


def _inputs(task: TaskConfig, x: np.ndarray | FileSamples,
            y: np.ndarray | FileSamples) -> tuple[torch.Tensor | FileSamples, torch.Tensor | FileSamples]:
    """The features and labels as training takes them: in-memory arrays as tensors (checked as always), samples on
    files as they are (their labels as a tensor), so nothing is decoded here."""
    if not isinstance(x, FileSamples) and not isinstance(y, FileSamples):
        return as_tensors(x, y) if task.type == "classification" else task_tensors(task, x, y)
    if len(x) == 0:
        raise ConfigError("x", "no samples")
    if len(y) != len(x):
        raise ConfigError("y", f"needs one label per sample: {len(y)} for {len(x)} samples")
    x_in = x if isinstance(x, FileSamples) else torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    if isinstance(y, FileSamples):
        return x_in, y
    if task.type == "classification":
        y_arr = np.asarray(y)
        if y_arr.ndim != 1 or not np.issubdtype(y_arr.dtype, np.integer):
            raise ConfigError("y", f"labels must be integers, one per sample: got {y_arr.dtype} {y_arr.shape}")
    return x_in, label_tensor(task, np.asarray(y))


prepared_inputs = _inputs  # a distributed-DP step reads the data as training does (worker/distributed_step.py)


def check_batch_memory(x: np.ndarray | FileSamples, y: np.ndarray | FileSamples, *, config: TrainingConfig,
                       pipeline: DataPipeline | None, memory_mib: int | None, dp: bool,
                       physical_batch_size: int | None) -> None:
    """Refuse (ConfigError naming worker.data.memory_mib) a training whose streamed batches cannot fit the owner's
    budget; in-memory arrays were loaded whole already and are not charged again. A DP pass is at most
    `physical_batch_size`, else a Poisson batch, counted at its mean plus four standard deviations."""
    streamed = [s for s in (x, y) if isinstance(s, FileSamples)]
    if not streamed or memory_mib is None:   # None: no budget given (a library call)
        return
    per_sample = 0
    for s in streamed:
        mask = s is y
        prepared = s.sample_shape if pipeline is None or mask else tuple(pipeline.output_shape(s.sample_shape))
        per_sample += sample_bytes(s.sample_shape, s.dtype) + sample_bytes(prepared, s.dtype)
    batch = min(config.batch_size, len(x))
    if dp:
        batch = min(len(x), math.ceil(batch + 4 * math.sqrt(batch)))
    if physical_batch_size:
        batch = min(batch, physical_batch_size)
    check_memory(memory_mib=memory_mib, pass_samples=batch, per_sample=per_sample, streamed=True)


def pick_device() -> str:
    """'cuda' when a GPU is usable, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_arguments(model: nn.Module, *, seed: int, clipping: str, physical_batch_size: int | None) -> None:
    """Refuse, before any work, a module Opacus already wrapped and arguments out of range."""
    _refuse_wrapped(model)
    check_int("seed", seed, low=0)
    if physical_batch_size is not None:
        check_int("physical_batch_size", physical_batch_size, low=1)
    if clipping not in CLIPPING_MODES:
        raise ConfigError("clipping", f"must be one of {', '.join(CLIPPING_MODES)}, got {clipping!r}")


def _plan_dp(model: nn.Module, dp: DPPolicy, history: list[HistoryEntry], *, num_samples: int,
             config: TrainingConfig, clipping: str) -> _DPPlan:
    """Settle the clipping and price the training; a model Opacus cannot train, a clipping mode that cannot
    clip it or an ε over the owner's budget is refused here, before any step spends privacy."""
    _validate_for_dp(model)
    sample_rate = dp_sample_rate(num_samples, config)
    mode = clipping if clipping != "auto" else clipping_mode(model, expected_batch_size=int(num_samples * sample_rate))
    check_supported(model, mode)
    total_steps = config.local_epochs * steps_per_epoch(num_samples, config)
    planned = merge_steps(history, noise_multiplier=dp.noise_multiplier, sample_rate=sample_rate, steps=total_steps)
    projected = epsilon_of(planned, delta=dp.delta)
    if projected > dp.epsilon_budget:
        raise BudgetExceeded(
            f"training {total_steps} steps would raise this job's epsilon to {projected:.4g} "
            f"(delta={dp.delta:g}), over the data owner's budget of {dp.epsilon_budget:g}"
        )
    log.info("DP training with %s clipping (%s)", mode,
             "chosen for the model and batch size" if clipping == "auto" else "asked for")
    return _DPPlan(policy=dp, clipping=mode, sample_rate=sample_rate, planned=planned, epsilon=projected)


def _freeze(work: nn.Module, frozen: Collection[str]) -> None:
    """Turn off the gradient of every named parameter; a name the model lacks, or freezing every parameter,
    is refused before any step."""
    params = dict(work.named_parameters())
    unknown = sorted(set(frozen) - set(params))
    if unknown:
        raise ConfigError("frozen", f"names parameters the model does not have: {', '.join(unknown[:5])}")
    if params and set(frozen) >= set(params):
        raise ConfigError("frozen", "freezes every parameter of the model: there is nothing to train")
    for name in frozen:
        params[name].requires_grad_(False)


def _make_optimizer(work: nn.Module, config: TrainingConfig) -> torch.optim.Optimizer:
    """Over the parameters that train only: a frozen one (model.freeze, an adapter's base) is never stepped,
    clipped or noised (Opacus's optimizers and our clipping read the optimizer's parameters)."""
    params = [p for p in work.parameters() if p.requires_grad]
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum)


def _validate_for_dp(model: nn.Module) -> None:
    from opacus.validators import ModuleValidator

    problems = ModuleValidator.validate(model, strict=False)
    if problems:
        raise ConfigError(
            "model",
            "cannot be trained with differential privacy (Opacus): "
            + "; ".join(str(p) for p in problems)
            + ". Replace BatchNorm with GroupNorm (or LayerNorm) in the model spec; "
            "per-sample gradients cannot mix samples of a batch",
        )


def _strip(name: str) -> str:
    while name.startswith(_PREFIX):
        name = name[len(_PREFIX) :]
    return name


def _refuse_wrapped(model: nn.Module) -> None:
    """Refuse a module Opacus already wrapped or hooked: copying it would copy the hooks too."""
    from opacus.grad_sample import AbstractGradSampleModule

    if isinstance(model, AbstractGradSampleModule) or any(
        hasattr(m, "autograd_grad_sample_hooks") for m in model.modules()
    ):
        raise ConfigError(
            "model",
            "is already wrapped by Opacus; pass the plain module (the trainer wraps its own copy, never twice)",
        )
