"""Local training on a worker, with Opacus DP-SGD under the data owner's own policy.

The job chooses the model and the optimisation settings (`TrainConfig`); the data owner chooses the
privacy (`DPPolicy`) and nothing in a job can override it. The ε of a job composes across rounds:
the job's accountant history (noise multiplier, sample rate, steps) is restored into a fresh RDP
accountant before each round's training, so ε after round t is the RDP composition of all rounds.

Opacus is the DP engine: its per-sample gradients (`prepare_module`, mode `GRAD_SAMPLE_MODE`), its
DPOptimizer's mechanism and its RDP accountant. Its `PrivacyEngine.make_private` is not used, for
what it costs around them. Measured on CPU (1 torch thread, digits, batch 32, SGD, same process;
samples/s with DP, slowdown against no DP in brackets), make_private → this design:
MLP 64-64-10 22.8k (5.0×) → 40.8k (2.8×); small CNN with GroupNorm 7.0k (3.3×) → 10.5k (2.2×).
Step by step (MLP, CNN; CPU time): tensor sampling and ε computed once 5.9× → 4.1×, 3.3× → 3.1×;
`FlatDPOptimizer` → 3.6×, 2.9×; "ew" instead of "hooks" → 2.9×, 2.3×. `python -m bench --only
dp_training` has the table.
- Poisson sampling: Opacus's DPDataLoader fetches and collates each sample on its own, 10–14% of
  a DP step. `poisson_batches` draws the same mask as its sampler (rand(N) < q per step) and
  gathers a batch in one indexing operation. An empty batch still takes a step, noise only and
  without a forward pass: the accountant counts every step, and skipping one would reveal the draw.
- With Poisson sampling Opacus samples at q = 1/ceil(N/B) and takes int(1/q) steps per epoch,
  which is one step short of ceil(N/B) for some N/B (93, 99, 105, ...); its accountant then
  records 1/(steps per epoch), slightly above the true rate (conservative), and its optimizer
  averages by int(N·that rate). `dp_sample_rate` and `planned_steps` copy those rules, and
  training asks Opacus's own loader for them before any step and refuses if they differ, so a
  task admitted on a projected ε spends exactly that ε. The accountant records each step through
  Opacus's optimizer hook; when its history is the planned one (always, unless a rule changed),
  the projection is the round's ε instead of a second 20 ms RDP computation.
- `GRAD_SAMPLE_MODE = "ew"` (torch's ExpandedWeights through Opacus): MLP 2.8×, "hooks" 3.4×,
  "functorch" 7.0×; CNN 2.2×, 2.7×, 4.9×. All three give the same per-sample gradients (a test
  trains the same weights with each). "ew" cannot run an empty batch, which it is never given.
  "ghost" (fast gradient clipping) is not a mode of this loop: it forms no per-sample gradients
  and clips through a second backward pass. With the same batches it was slower at batch 32 (MLP
  5.0×, CNN 3.5×) and faster only for the MLP at batch 512 (3.6× against "ew"'s 8–14×): the
  mode to add if jobs train dense models on large batches.
- The ≤2× goal is not met at batch 32. What remains per step is torch's and Opacus's own Python
  work per layer (ExpandedWeights' functional_call and autograd functions), the per-sample norms
  and the noise. Larger batches do not bring it under 2×: the CNN stays at 2.2–2.4× (batch 128,
  512) and the MLP's slowdown grows (3.3–5.2×, 8–10×), as DP forms batch × parameters floats per
  step where no DP forms one gradient.
- Threads: torch defaults to one intra-op thread per core. A second thread gained nothing with DP
  (MLP 41.4k against 40.8k samples/s, CNN 9.2k against 9.6k), and on a loaded machine 2 threads
  have run 10–100× slower, with and without DP (OpenMP threads waiting for each other for whole
  time slices). The count is the process's, so the worker process should set it
  (`torch.set_num_threads(1)`), not this function, which several workers of one demo process
  call at once.
- FedProx under DP: the proximal gradient mu·(w − w_global) is added after Opacus has clipped and
  noised the data gradient (it touches no sample, so it is free post-processing); inside the loss
  it would never reach Opacus's per-sample gradients and would silently vanish.
- Training runs on a deep copy of the caller's module, so a module is never wrapped twice; the
  copy's parameter names carry no `_module.` prefix (it is stripped defensively all the same).
"""

from __future__ import annotations

import copy
import functools
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedbroker.errors import BudgetExceeded, ConfigError

GRAD_SAMPLE_MODE = "ew"
OPTIMIZERS = ("sgd", "adam")
_PREFIX = "_module."

HistoryEntry = tuple[float, float, int]

# Opacus's per-sample hooks (mode "hooks") make torch warn once per process that inputs need no
# gradient; that is expected here and says nothing to a data owner. Only this module's instance is silenced.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed", category=UserWarning)


@dataclass(frozen=True)
class DPPolicy:
    """The data owner's privacy policy; a job can never override it.

    `train_local` refuses a task whose projected ε for its job would exceed `epsilon_budget` (at
    this `delta`); a caller holding the ledger may also count the other jobs' ε against it.
    """

    noise_multiplier: float
    max_grad_norm: float
    delta: float
    epsilon_budget: float

    def __post_init__(self) -> None:
        _check_positive("dp.noise_multiplier", self.noise_multiplier)
        _check_positive("dp.max_grad_norm", self.max_grad_norm)
        if not (isinstance(self.delta, (int, float)) and 0.0 < self.delta < 1.0):
            raise ConfigError("dp.delta", f"must lie strictly between 0 and 1, got {self.delta!r}")
        if not (isinstance(self.epsilon_budget, (int, float)) and self.epsilon_budget > 0):
            raise ConfigError("dp.epsilon_budget", f"must be > 0, got {self.epsilon_budget!r}")


@dataclass(frozen=True)
class TrainConfig:
    """The job's local training settings. `proximal_mu` > 0 turns FedAvg local training into FedProx."""

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.1
    optimizer: str = "sgd"
    momentum: float = 0.0
    proximal_mu: float = 0.0

    def __post_init__(self) -> None:
        _check_int("training.epochs", self.epochs, low=1)
        _check_int("training.batch_size", self.batch_size, low=1)
        _check_positive("training.lr", self.lr, allow_inf=False)
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("training.optimizer", f"unknown optimizer {self.optimizer!r}; known: {', '.join(OPTIMIZERS)}")
        if not (isinstance(self.momentum, (int, float)) and 0.0 <= self.momentum < 1.0):
            raise ConfigError("training.momentum", f"must lie in [0, 1), got {self.momentum!r}")
        if self.momentum and self.optimizer != "sgd":
            raise ConfigError("training.momentum", f"applies to sgd only, not {self.optimizer}")
        if not (isinstance(self.proximal_mu, (int, float)) and 0.0 <= self.proximal_mu < math.inf):
            raise ConfigError("training.proximal_mu", f"must be a finite number >= 0, got {self.proximal_mu!r}")


@dataclass(frozen=True)
class TrainResult:
    """What one local training produced.

    `state` has the keys and order of `model.state_dict()` (buffers included). `train_loss` is the
    sample-weighted mean loss of the last epoch's batches (before each step; no proximal term).
    `epsilon` is the job's total ε on this worker after this training (None without DP) and
    `history` the job's full accountant history to store for the next round.
    """

    state: dict[str, np.ndarray]
    num_samples: int
    train_loss: float
    steps: int
    seconds: float
    samples_per_second: float
    epsilon: float | None
    history: list[HistoryEntry]


def dp_sample_rate(num_samples: int, config: TrainConfig) -> float:
    """Sample rate Opacus's RDP accountant records for a loader of `config.batch_size`.

    That is 1/(steps per epoch): 1/ceil(N/B) except where float rounding makes Opacus take one step
    fewer, then a hair above the rate it samples at. Pass it to `project_epsilon`.
    """
    return 1.0 / _steps_per_epoch(num_samples, config)


def planned_steps(num_samples: int, config: TrainConfig) -> int:
    """Optimizer steps `train_local` takes, with or without DP: epochs · int(1/(1/ceil(N/B)))."""
    return config.epochs * _steps_per_epoch(num_samples, config)


def _steps_per_epoch(num_samples: int, config: TrainConfig) -> int:
    _check_int("num_samples", num_samples, low=1)
    return int(1.0 / (1.0 / math.ceil(num_samples / config.batch_size)))  # Opacus's DPDataLoader rule


def project_epsilon(
    history: Sequence[Sequence[float]], *, noise_multiplier: float, sample_rate: float, steps: int, delta: float
) -> float:
    """ε a job would have spent after `steps` more DP-SGD steps; used to refuse a task *before* training.

    The new steps are merged into the history exactly as Opacus's RDP accountant merges them, so
    the projection equals the ε the accountant reports after training those steps.
    """
    _check_positive("noise_multiplier", noise_multiplier)
    if not (isinstance(sample_rate, (int, float)) and 0.0 < sample_rate <= 1.0):
        raise ConfigError("sample_rate", f"must lie in (0, 1], got {sample_rate!r}")
    _check_int("steps", steps, low=0)
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ConfigError("delta", f"must lie strictly between 0 and 1, got {delta!r}")
    return _epsilon(_merge_steps(_normalise_history(history), noise_multiplier, sample_rate, steps), delta)


def _merge_steps(
    entries: list[HistoryEntry], noise_multiplier: float, sample_rate: float, steps: int
) -> list[HistoryEntry]:
    """`entries` plus `steps` DP-SGD steps, merged as Opacus's RDP accountant merges its step records."""
    out = list(entries)
    if steps:
        if out and out[-1][0] == noise_multiplier and out[-1][1] == sample_rate:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + steps)
        else:
            out.append((float(noise_multiplier), float(sample_rate), int(steps)))
    return out


def _epsilon(history: list[HistoryEntry], delta: float) -> float:
    """ε of `history` from a fresh Opacus RDP accountant."""
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = list(history)
    return float(accountant.get_epsilon(delta))


def train_local(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    config: TrainConfig,
    dp: DPPolicy | None,
    history: Sequence[Sequence[float]] = (),
    device: str = "cpu",
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
) -> TrainResult:
    """Train `model` on (x, y) for `config.epochs`; with `dp`, as DP-SGD under the owner's policy.

    The caller's module is never wrapped: training runs on a deep copy and the trained weights are
    copied back into `model` at the end (so `evaluate(model, ...)` sees them). With DP, a task
    whose projected ε exceeds `dp.epsilon_budget` raises BudgetExceeded before any step, and a
    module Opacus cannot train (BatchNorm, ...) raises ConfigError listing every problem.

    `seed` fixes the batch sampling, the DP noise and any dropout, so one seed gives one result on
    CPU. With DP the seed must stay the worker's secret (never taken from a job): whoever knows it
    can regenerate and subtract the noise. Production workers should draw it from os.urandom.
    """
    _refuse_wrapped(model)
    _check_int("seed", seed, low=0)
    x_t, y_t = _as_tensors(x, y)
    n = len(y_t)
    entries = _normalise_history(history)
    sample_rate = dp_sample_rate(n, config)
    steps_per_epoch = _steps_per_epoch(n, config)
    total_steps = config.epochs * steps_per_epoch
    if dp is not None:
        _validate_for_dp(model)
        planned = _merge_steps(entries, dp.noise_multiplier, sample_rate, total_steps)
        projected = _epsilon(planned, dp.delta)
        if projected > dp.epsilon_budget:
            raise BudgetExceeded(
                f"training {total_steps} steps would raise this job's epsilon to {projected:.4g} "
                f"(delta={dp.delta:g}), over the data owner's budget of {dp.epsilon_budget:g}"
            )

    dev = torch.device(device)
    # Three independent streams (batches, noise, torch's global RNG for dropout) from one seed.
    data_seed, noise_seed, torch_seed = (int(s) >> 1 for s in np.random.SeedSequence(seed).generate_state(3, np.uint64))
    fork_devices = [] if dev.type != "cuda" else [dev.index if dev.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(torch_seed)
        work = copy.deepcopy(model).to(dev)
        work.train()
        anchor = [p.detach().clone() for p in work.parameters()] if config.proximal_mu > 0 else None
        optimizer = _make_optimizer(work, config)
        data_gen = torch.Generator().manual_seed(data_seed)
        start = time.perf_counter()
        if dp is None:
            loss, seen = _train_plain(
                work, optimizer, x_t, y_t, config=config, steps_per_epoch=steps_per_epoch, generator=data_gen,
                device=dev, anchor=anchor, progress=progress,
            )
            epsilon, out_history = None, entries
        else:
            loss, seen, out_history = _train_dp(
                work, optimizer, x_t, y_t, config=config, dp=dp, history=entries, sample_rate=sample_rate,
                steps_per_epoch=steps_per_epoch, data_gen=data_gen,
                noise_gen=torch.Generator(device=dev).manual_seed(noise_seed), device=dev, anchor=anchor,
                progress=progress,
            )
            # The projection already ran a fresh RDP accountant on exactly this history; only a history
            # that differs from the plan (which training never produces) is worth a second computation.
            epsilon = projected if out_history == planned else _epsilon(out_history, dp.delta)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - start

    state = {_strip(k): v.detach().cpu().numpy().copy() for k, v in work.state_dict().items()}
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    return TrainResult(
        state=state,
        num_samples=n,
        train_loss=loss,
        steps=total_steps,
        seconds=seconds,
        samples_per_second=seen / seconds if seconds > 0 else float("inf"),
        epsilon=epsilon,
        history=out_history,
    )


def evaluate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, *, device: str = "cpu", batch_size: int = 512
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of `model` on (x, y); moves `model` to `device`, restores its mode."""
    _check_int("batch_size", batch_size, low=1)
    x_t, y_t = _as_tensors(x, y)
    dev = torch.device(device)
    was_training = model.training
    model.to(dev).eval()
    correct, loss_sum = 0, 0.0
    try:
        with torch.no_grad():
            for i in range(0, len(y_t), batch_size):
                xb, yb = x_t[i : i + batch_size].to(dev), y_t[i : i + batch_size].to(dev)
                logits = model(xb)
                loss_sum += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
                correct += int((logits.argmax(dim=1) == yb).sum())
    finally:
        model.train(was_training)
    return correct / len(y_t), loss_sum / len(y_t)


def pick_device() -> str:
    """'cuda' when a GPU is usable, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _train_plain(
    work: nn.Module,
    optimizer: torch.optim.Optimizer,
    x_t: torch.Tensor,
    y_t: torch.Tensor,
    *,
    config: TrainConfig,
    steps_per_epoch: int,
    generator: torch.Generator,
    device: torch.device,
    anchor: list[torch.Tensor] | None,
    progress: Callable[[int, int], None] | None,
) -> tuple[float, int]:
    # Shuffled batches of B; the last step of an epoch takes the remainder, so every sample is seen
    # once per epoch in exactly int(1/q) steps, the same count as the DP path.
    x_d, y_d = x_t.to(device), y_t.to(device)
    total, done, seen = config.epochs * steps_per_epoch, 0, 0
    loss_sum, loss_n = 0.0, 0
    bs = config.batch_size
    for _ in range(config.epochs):
        perm = torch.randperm(len(y_t), generator=generator).to(device)
        loss_sum, loss_n = 0.0, 0
        for s in range(steps_per_epoch):
            idx = perm[s * bs : (s + 1) * bs] if s < steps_per_epoch - 1 else perm[s * bs :]
            xb, yb = x_d[idx], y_d[idx]
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(work(xb), yb)
            loss.backward()
            _add_proximal_grad(work, anchor, config.proximal_mu)
            optimizer.step()
            loss_sum += float(loss.detach()) * len(yb)
            loss_n += len(yb)
            seen += len(yb)
            done += 1
            if progress is not None:
                progress(done, total)
    return loss_sum / max(loss_n, 1), seen


def _train_dp(
    work: nn.Module,
    optimizer: torch.optim.Optimizer,
    x_t: torch.Tensor,
    y_t: torch.Tensor,
    *,
    config: TrainConfig,
    dp: DPPolicy,
    history: list[HistoryEntry],
    sample_rate: float,
    steps_per_epoch: int,
    data_gen: torch.Generator,
    noise_gen: torch.Generator,
    device: torch.device,
    anchor: list[torch.Tensor] | None,
    progress: Callable[[int, int], None] | None,
) -> tuple[float, int, list[HistoryEntry]]:
    from opacus.accountants import RDPAccountant
    from opacus.grad_sample import prepare_module

    poisson_rate, expected_batch_size = _opacus_poisson_rule(len(y_t), config, steps_per_epoch, sample_rate)
    wrapped = prepare_module(work, grad_sample_mode=GRAD_SAMPLE_MODE, batch_first=True, loss_reduction="mean")
    wrapped.forbid_grad_accumulation()
    dp_optimizer = flat_dp_optimizer_class()(
        optimizer, noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.max_grad_norm,
        expected_batch_size=expected_batch_size, generator=noise_gen,
    )
    accountant = RDPAccountant()
    accountant.history = list(history)
    dp_optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    params = dp_optimizer.params
    x_d, y_d = x_t.to(device), y_t.to(device)
    total, done, seen = config.epochs * steps_per_epoch, 0, 0
    loss_sum, loss_n = 0.0, 0
    try:
        for _ in range(config.epochs):
            loss_sum, loss_n = 0.0, 0
            for idx in poisson_batches(len(y_t), sample_rate=poisson_rate, steps=steps_per_epoch, generator=data_gen):
                dp_optimizer.zero_grad(set_to_none=True)
                if len(idx):
                    idx = idx.to(device, non_blocking=True)
                    xb, yb = x_d[idx], y_d[idx]
                    loss = nn.functional.cross_entropy(wrapped(xb), yb)
                    loss.backward()
                    loss_sum += float(loss.detach()) * len(yb)
                    loss_n += len(yb)
                else:
                    # An empty Poisson batch has no per-sample gradient: the step adds noise only (skipping it
                    # would reveal the empty draw, and "ew" cannot run a forward pass on zero samples).
                    for p in params:
                        p.grad_sample = p.new_zeros((0, *p.shape))
                if anchor is None:
                    dp_optimizer.step()
                # The proximal gradient mu·(w − w_global) depends on no training sample, so it is
                # added after clipping and noising (post-processing, free in privacy); put into the
                # loss it would never reach Opacus's per-sample gradients and would be lost.
                elif dp_optimizer.pre_step():
                    _add_proximal_grad(work, anchor, config.proximal_mu)
                    dp_optimizer.original_optimizer.step()
                seen += len(idx)
                done += 1
                if progress is not None:
                    progress(done, total)
    finally:
        wrapped.cleanup()  # remove Opacus's hooks and per-sample attributes from the throw-away copy
    return loss_sum / max(loss_n, 1), seen, _normalise_history(accountant.history)


@functools.cache
def flat_dp_optimizer_class() -> type:
    """`FlatDPOptimizer`, defined on first use: importing Opacus takes seconds, so the trainer imports it lazily."""
    from opacus.optimizers import DPOptimizer

    class FlatDPOptimizer(DPOptimizer):
        """Opacus's DPOptimizer with clipping, noising and averaging done on one flat vector.

        The mechanism is Opacus's, unchanged: each sample's gradient over all parameters is scaled by
        min(1, C / (‖g‖ + 1e-6)), the scaled gradients are summed, every coordinate gets N(0, (σ·C)²)
        noise and the result is divided by the expected batch size. Opacus's phases each loop over
        the parameters, rebuilding the parameter list several times and drawing noise per parameter,
        which for the small models workers train costs more than the arithmetic. Here each
        parameter costs one norm and one matrix-vector product (no copy of the n·P per-sample
        gradients), and noise and averaging are one operation each on a flat vector. Virtual steps
        (Opacus's BatchMemoryManager) are not supported: a Poisson batch is always one step.
        """

        def signal_skip_step(self, do_skip: bool = True) -> None:
            raise RuntimeError("FlatDPOptimizer takes every Poisson batch in one step; virtual steps "
                               "(Opacus's BatchMemoryManager) are not supported")

        @property
        def accumulated_iterations(self) -> int:
            return 1  # one whole Poisson batch per step, never accumulated

        def clip_and_accumulate(self) -> None:
            grad_samples = self.grad_samples
            for p in self.params:
                p.grad_sample = None  # consumed: stepping again without a new backward pass raises
            n = len(grad_samples[0])
            flat = [g.reshape(n, math.prod(g.shape[1:])) for g in grad_samples]  # views: no copy of n·P floats
            per_param = torch.stack([torch.linalg.vector_norm(f, dim=1) for f in flat], dim=1)
            norms = torch.linalg.vector_norm(per_param, dim=1)
            factor = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            self._flat_sum = torch.cat([factor @ f for f in flat])  # zeros for an empty batch

        def add_noise(self) -> None:
            summed = self._flat_sum
            noise = torch.normal(
                0.0, self.noise_multiplier * self.max_grad_norm, size=summed.shape, generator=self.generator,
                device=summed.device, dtype=summed.dtype,
            )
            self._flat_grad = summed + noise
            params = self.params
            for p, g in zip(params, self._flat_grad.split([p.numel() for p in params])):
                p.grad = g.view_as(p)

        def scale_grad(self) -> None:
            self._flat_grad /= self.expected_batch_size  # the parameters' .grad are views of it

    return FlatDPOptimizer


def poisson_batches(
    num_samples: int, *, sample_rate: float, steps: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Indices of `steps` Poisson batches: every sample joins every batch independently with `sample_rate`.

    The draw is Opacus's UniformWithReplacementSampler's (rand(N) < q per step, same generator, same
    indices), kept as a tensor so a batch is one gather: Opacus's DPDataLoader fetches and collates
    the samples one by one, which cost more than the forward pass of a small model.
    """
    for _ in range(steps):
        yield (torch.rand(num_samples, generator=generator) < sample_rate).nonzero().squeeze(1)


def _opacus_poisson_rule(
    num_samples: int, config: TrainConfig, steps_per_epoch: int, sample_rate: float
) -> tuple[float, int]:
    """(rate to sample at, expected batch size) exactly as `PrivacyEngine.make_private` derives them.

    Opacus's own loader is asked (it is built, never iterated) so that a change of its rules fails
    here, before any step, instead of spending a different ε than `project_epsilon` promised.
    """
    from opacus.data_loader import DPDataLoader

    dummy = TensorDataset(torch.empty(num_samples, 0))
    dp_loader = DPDataLoader.from_data_loader(DataLoader(dummy, batch_size=config.batch_size))
    if len(dp_loader) != steps_per_epoch or 1.0 / len(dp_loader) != sample_rate:
        raise RuntimeError(
            f"Opacus takes {len(dp_loader)} steps per epoch, the projection assumed {steps_per_epoch} "
            f"at q={sample_rate}; this Opacus version changed its sampling rule"
        )
    return float(dp_loader.sample_rate), int(num_samples * sample_rate)


def _add_proximal_grad(work: nn.Module, anchor: list[torch.Tensor] | None, mu: float) -> None:
    """Add the gradient of (mu/2)·||w − w_global||², i.e. mu·(w − w_global), to every parameter."""
    if anchor is None:
        return
    with torch.no_grad():
        for p, p0 in zip(work.parameters(), anchor):
            if p.grad is None:
                p.grad = mu * (p - p0)
            else:
                p.grad.add_(p - p0, alpha=mu)


def _make_optimizer(work: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    if config.optimizer == "adam":
        return torch.optim.Adam(work.parameters(), lr=config.lr)
    return torch.optim.SGD(work.parameters(), lr=config.lr, momentum=config.momentum)


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


def _as_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    x = np.asarray(x)
    y = np.asarray(y)
    if len(x) == 0:
        raise ConfigError("x", "no samples")
    if y.ndim != 1 or len(y) != len(x):
        raise ConfigError("y", f"needs one label per sample: shape {y.shape} for {len(x)} samples")
    if not np.issubdtype(y.dtype, np.integer):
        raise ConfigError("y", f"labels must be integers, got {y.dtype}")
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), torch.from_numpy(y.astype(np.int64))


def _normalise_history(history: Sequence[Sequence[float]]) -> list[HistoryEntry]:
    """Entries as (noise_multiplier, sample_rate, steps) tuples; accepts the lists JSON gives back."""
    out: list[HistoryEntry] = []
    for i, entry in enumerate(history):
        if len(entry) != 3:
            raise ConfigError(f"history[{i}]", f"must be (noise_multiplier, sample_rate, steps), got {entry!r}")
        nm, q, steps = entry
        try:
            valid = float(nm) > 0 and 0 < float(q) <= 1 and int(steps) == steps and int(steps) >= 0
        except (TypeError, ValueError):
            valid = False
        if not valid:
            raise ConfigError(f"history[{i}]", f"invalid accountant entry {entry!r}")
        out.append((float(nm), float(q), int(steps)))
    return out


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


def _check_int(field: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(field, f"must be an integer >= {low}, got {value!r}")


def _check_positive(field: str, value: object, *, allow_inf: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
    if not ok or (not allow_inf and not math.isfinite(float(value))):  # type: ignore[arg-type]
        raise ConfigError(field, f"must be a {'' if allow_inf else 'finite '}number > 0, got {value!r}")
