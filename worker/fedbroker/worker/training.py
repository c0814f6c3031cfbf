"""Local training on a worker, with Opacus DP-SGD under the data owner's own policy.

The job chooses the model and the optimisation settings (`fedbroker.spec.TrainingConfig`); the data
owner chooses the privacy (`fedbroker.config.DPPolicy`) and nothing in a job can override it. The ε
arithmetic (sampling rule, planned steps, projection, history) is `fedbroker.privacy`; the
noise-average step is `fedbroker.worker.dp_optimizer`.

Opacus is the DP engine: its DPOptimizers' mechanism (noise, averaging) and its RDP accountant, and
in two of the three clipping modes its per-sample gradients or norms. Its `PrivacyEngine.make_private`
is not used, for what it costs around them. Measured on
CPU (1 torch thread, digits, batch 32, SGD, same process; slowdown against no DP; two bench runs on
2026-11-25, 2 cores shared with other work), make_private → this design: MLP 64-64-10 5.4–6.6× →
1.63–1.68×; small CNN with GroupNorm 3.1–3.5× → 1.83–1.85× (tensor sampling and ε computed once, the
flat DP optimizers, then "ew" instead of "hooks", then "bk"). `python -m bench --only dp_training`
has the table.
- Poisson sampling: Opacus's DPDataLoader fetches and collates each sample on its own, 10–14% of
  a DP step. `poisson_batches` draws the same mask as its sampler (rand(N) < q per step) and
  gathers a batch in one indexing operation. An empty batch still takes a step, noise only and
  without a forward pass: the accountant counts every step, and skipping one would reveal the draw.
  The rate and step count are Opacus's (see `fedbroker.privacy`), checked against its own loader before any step.
  Several steps' masks are drawn at once (one rand(steps, N), the same stream as per-step draws).
- Three clipping modes, one mechanism (`clipping_mode` picks per model and expected batch, logged and
  reported as `TrainResult.clipping`). "bk" (book-keeping, `fedbroker.worker.bookkeeping`, ours): one
  forward and one backward pass with the parameters' requires_grad off, so autograd forms no weight
  gradient; hooks keep each layer's input a and output gradient g, from which come the per-sample norms
  (Linear: ‖g_i‖·‖a_i‖; Conv2d: ghost norm or per-sample gradient, whichever is cheaper per layer;
  GroupNorm/LayerNorm: per-sample gradients) and then the clipped sum, one product per layer;
  `FlatSumDPOptimizer` noises it. "ew" forms every per-sample gradient (torch's ExpandedWeights
  through Opacus, `GRAD_SAMPLE_MODE`; "hooks" and "functorch" give the same gradients, slower) and
  `FlatDPOptimizer` clips them. "ghost" is Opacus's fast gradient clipping
  (`GradSampleModuleFastGradientClipping` + `DPLossFastGradientClipping`): per-sample norms from a
  first backward pass, Linear layers' without forming their per-sample gradients, then a second
  backward pass of Σ_i c_i·loss_i with c_i = min(1, C/(‖g_i‖+1e-6)), which leaves the clipped sum
  in .grad. All three then add the same N(0, (σC)²) noise and divide by the expected batch: the
  released update is the same function of the batch (tests check each against Opacus's materialised
  per-sample clipping with the noise off; "bk" on five models with residual connections,
  shared and frozen layers and in-place activations), so the accountant's ε is the same. "bk" is
  chosen wherever it runs: two bench runs of this code (2026-11-25, 2 shared cores, 1 torch thread),
  batch 32: MLP 64-64-10 1.63–1.68× (ew 2.5–4.1×), small CNN 1.83–1.85× (ew 2.0–2.1×), ResNet-style
  CNN 1.37–1.50× (ew 2.2–2.4×); ResNet at 256 1.26–1.34× (ew 1.8–1.9×). Before it, "ghost" paid only
  where "ew" would form many per-sample floats: MLP 64-64-10 ghost 4.5× against ew 3.3× at batch
  32, 2.3× against 3.3× at 256; a 784-256-10 MLP 4.7× against 9.5× at 32. Opacus has no norm
  sampler for Conv2d, so for CNNs "ghost" forms the per-sample gradients layer by layer and adds
  a backward pass (ResNet-style CNN 4.6–5.1× against ew's 2.7×).
- "ew" backpropagates the summed loss: ExpandedWeights' per-sample gradients of a mean loss are
  rescaled by the batch size, one more pass over batch × parameters floats (ResNet-style CNN, batch
  64: 4.2× → 2.7×). It also trains a batch in virtual steps of at most `EW_MAX_FLOATS` per-sample
  gradient floats, which then stay in cache (the same ResNet at batch 256: 2.4× → 1.6–1.8×).
- Virtual steps (`physical_batch_size`): a Poisson batch larger than memory allows is trained in
  chunks; each chunk's clipped sum is accumulated (Opacus's skip step) and the batch is noised
  once, so the update and the one accountant step are those of a single pass.
- "bk" trains a batch in virtual steps of at most `BK_MAX_FLOATS` samples × parameters (ResNet-style
  CNN at 256: 1.46–1.62× in one pass, 1.29–1.32× in passes of 64–128 samples, measured while developing).
- What remains per step at batch 32, measured with a profiler: the per-sample norms and clipped sums
  (MLP: about 20 small tensor operations, 75 µs of a 400 µs step against 235 µs without DP; small
  CNN: unfolding the convolutions' inputs and the ghost layer's weight gradient, ~40% of its step),
  the noise (20 µs for the MLP's 4,810 parameters) and Opacus's step around it. The MLP's slowdown no
  longer grows with the batch (1.55× at 512 in both runs).
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
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedbroker.config import DPPolicy
from fedbroker.errors import BudgetExceeded, ConfigError
from fedbroker.privacy import (
    HistoryEntry,
    check_int,
    dp_sample_rate,
    epsilon_of,
    merge_steps,
    normalise_history,
    steps_per_epoch,
)
from fedbroker.spec import TrainingConfig
from fedbroker.worker import bookkeeping

GRAD_SAMPLE_MODE = "ew"
CLIPPING_MODES = ("auto", "bk", "ghost", "ew")
# "ghost" (for models "bk" cannot clip): layers Opacus's fast gradient clipping handles with its own samplers (norms of Linear's per-sample
# gradients without forming them; Conv2d's and GroupNorm's formed one layer at a time and dropped).
GHOST_LAYERS = (nn.Linear, nn.Conv2d, nn.GroupNorm)
# "ghost" pays once "ew" would form this many per-sample gradient floats of Linear layers per step
# (expected batch × Linear parameters); below it, its second backward pass and hooks cost more.
GHOST_MIN_FLOATS = 1 << 20
# "ew" trains a Poisson batch in chunks of at most this many per-sample gradient floats (256 MiB):
# beyond it the per-sample gradients fall out of cache and the pass slows (ResNet-style CNN, 1.2 M
# parameters, batch 256 on CPU: 2.4× in one pass, 1.6× in chunks of 32–64).
EW_MAX_FLOATS = 1 << 26
# "bk" trains a Poisson batch in passes of at most this many samples × parameters, a proxy for its
# activations and unfolded inputs (ResNet-style CNN at batch 256: 1.46–1.62× in one pass, 1.29–1.32× in
# passes of 64–128 samples; the MLP and the small CNN are never split).
BK_MAX_FLOATS = 1 << 27
POISSON_BLOCK_FLOATS = 1 << 20
_PREFIX = "_module."
log = logging.getLogger(__name__)

# Opacus's per-sample hooks (mode "hooks") make torch warn once per process that inputs need no
# gradient; that is expected here and says nothing to a data owner. Only this module's instance is silenced.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed", category=UserWarning)


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


def train_local(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    config: TrainingConfig,
    dp: DPPolicy | None,
    history: Sequence[Sequence[float]] = (),
    device: str = "cpu",
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    clipping: str = "auto",
    physical_batch_size: int | None = None,
) -> TrainResult:
    """Train `model` on (x, y) for `config.local_epochs`; with an enabled `dp`, as DP-SGD under the owner's policy.

    The caller's module is never wrapped: training runs on a deep copy and the trained weights are
    copied back into `model` at the end (so `evaluate(model, ...)` sees them). With DP, a task
    whose projected ε exceeds `dp.epsilon_budget` raises BudgetExceeded before any step, and a
    module Opacus cannot train (BatchNorm, ...) raises ConfigError listing every problem. A policy
    with `enabled` false is the owner's choice of no DP, the same as None.

    `seed` fixes the batch sampling, the DP noise and any dropout, so one seed gives one result on
    CPU. With DP the seed must stay the worker's secret (never taken from a job): whoever knows it
    can regenerate and subtract the noise. Production workers should draw it from os.urandom.

    `clipping` picks how DP clips ("auto": `clipping_mode` at the expected batch size). `physical_batch_size` bounds the
    samples of one forward/backward pass: a larger Poisson batch is trained in chunks (Opacus's
    virtual steps) whose clipped gradients are summed and noised once, the same update and the same ε
    as one pass, for a batch that does not fit in memory. Neither changes training without DP.
    """
    if dp is not None and not dp.enabled:
        dp = None
    _refuse_wrapped(model)
    check_int("seed", seed, low=0)
    if physical_batch_size is not None:
        check_int("physical_batch_size", physical_batch_size, low=1)
    if clipping not in CLIPPING_MODES:
        raise ConfigError("clipping", f"must be one of {', '.join(CLIPPING_MODES)}, got {clipping!r}")
    x_t, y_t = _as_tensors(x, y)
    n = len(y_t)
    entries = normalise_history(history)
    sample_rate = dp_sample_rate(n, config)
    per_epoch = steps_per_epoch(n, config)
    total_steps = config.local_epochs * per_epoch
    mode = None
    if dp is not None:
        _validate_for_dp(model)
        mode = clipping if clipping != "auto" else clipping_mode(model, expected_batch_size=int(n * sample_rate))
        if mode == "bk" and not bookkeeping.supported(model):
            raise ConfigError("clipping", "bk clipping needs a model whose parameters all sit in unshared "
                              f"{', '.join(t.__name__ for t in bookkeeping.LAYERS)} layers (Conv2d: ungrouped, "
                              "zero-padded)")
        if mode == "ghost" and not ghost_supported(model):
            raise ConfigError("clipping", "ghost clipping needs a model whose parameters all sit in unshared "
                              f"{', '.join(t.__name__ for t in GHOST_LAYERS)} layers")
        planned = merge_steps(entries, noise_multiplier=dp.noise_multiplier, sample_rate=sample_rate,
                              steps=total_steps)
        projected = epsilon_of(planned, delta=dp.delta)
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
                work, optimizer, x_t, y_t, config=config, steps_per_epoch=per_epoch, generator=data_gen,
                device=dev, anchor=anchor, progress=progress,
            )
            epsilon, out_history = None, entries
        else:
            assert mode is not None
            log.info("DP training with %s clipping (%s)", mode,
                     "chosen for the model and batch size" if clipping == "auto" else "asked for")
            loss, seen, out_history = _train_dp(
                work, optimizer, x_t, y_t, config=config, dp=dp, history=entries, sample_rate=sample_rate,
                steps_per_epoch=per_epoch, data_gen=data_gen,
                noise_gen=torch.Generator(device=dev).manual_seed(noise_seed), device=dev, anchor=anchor,
                progress=progress, clipping=mode, physical_batch_size=physical_batch_size,
            )
            # The projection already ran a fresh RDP accountant on exactly this history; only a history
            # that differs from the plan (which training never produces) is worth a second computation.
            epsilon = projected if out_history == planned else epsilon_of(out_history, delta=dp.delta)
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
        clipping=mode,
    )


def evaluate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, *, device: str = "cpu", batch_size: int = 512
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of `model` on (x, y); moves `model` to `device`, restores its mode."""
    check_int("batch_size", batch_size, low=1)
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


def clipping_mode(model: nn.Module, *, expected_batch_size: int) -> str:
    """How DP training clips `model`'s per-sample gradients at `expected_batch_size`: "bk", "ghost" or "ew".

    "bk" (`fedbroker.worker.bookkeeping`) wherever it runs: every trained parameter in an unshared
    Linear, Conv2d (ungrouped, zero-padded), GroupNorm or LayerNorm layer; it is the fastest of the
    three on every model and batch the bench measures. Otherwise "ghost", Opacus's fast gradient
    clipping, where it runs and pays: every parameter in an unshared Linear, Conv2d or GroupNorm
    layer, and at least GHOST_MIN_FLOATS per-sample Linear gradient floats per step that "ew" would
    form; else "ew" (per-sample gradients formed by torch's ExpandedWeights through Opacus). All three
    give the same clipped sum.
    """
    if bookkeeping.supported(model):
        return "bk"
    if not ghost_supported(model):
        return "ew"
    linear = sum(p.numel() for m in model.modules() if type(m) is nn.Linear for p in m.parameters() if p.requires_grad)
    return "ghost" if expected_batch_size * linear >= GHOST_MIN_FLOATS else "ew"


def ghost_supported(model: nn.Module) -> bool:
    """True when every trainable parameter sits in an unshared Linear, Conv2d or GroupNorm layer
    (Opacus's fast gradient clipping refuses tied parameters and has no samplers for other layers)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if any(p.requires_grad for p in own) and type(module) not in GHOST_LAYERS:
            return False
        for p in own:
            owners[id(p)] = owners.get(id(p), 0) + 1
    return all(count == 1 for count in owners.values())


def pick_device() -> str:
    """'cuda' when a GPU is usable, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _train_plain(
    work: nn.Module,
    optimizer: torch.optim.Optimizer,
    x_t: torch.Tensor,
    y_t: torch.Tensor,
    *,
    config: TrainingConfig,
    steps_per_epoch: int,
    generator: torch.Generator,
    device: torch.device,
    anchor: list[torch.Tensor] | None,
    progress: Callable[[int, int], None] | None,
) -> tuple[float, int]:
    # Shuffled batches of B; the last step of an epoch takes the remainder, so every sample is seen
    # once per epoch in exactly int(1/q) steps, the same count as the DP path.
    x_d, y_d = x_t.to(device), y_t.to(device)
    total, done, seen = config.local_epochs * steps_per_epoch, 0, 0
    loss_sum, loss_n = 0.0, 0
    bs = config.batch_size
    for _ in range(config.local_epochs):
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
    config: TrainingConfig,
    dp: DPPolicy,
    history: list[HistoryEntry],
    sample_rate: float,
    steps_per_epoch: int,
    data_gen: torch.Generator,
    noise_gen: torch.Generator,
    device: torch.device,
    anchor: list[torch.Tensor] | None,
    progress: Callable[[int, int], None] | None,
    clipping: str,
    physical_batch_size: int | None,
) -> tuple[float, int, list[HistoryEntry]]:
    from opacus.accountants import RDPAccountant

    poisson_rate, expected_batch_size = _opacus_poisson_rule(len(y_t), config, steps_per_epoch, sample_rate)
    wrapped, dp_optimizer, backward = dp_engine(
        work, optimizer, clipping=clipping, noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.max_grad_norm,
        expected_batch_size=expected_batch_size, generator=noise_gen)
    pass_floats = {"ew": EW_MAX_FLOATS, "bk": BK_MAX_FLOATS}.get(clipping)
    if pass_floats is not None:  # virtual steps: the same update, in passes whose intermediates fit in cache
        per_pass = max(1, pass_floats // sum(p.numel() for p in dp_optimizer.params))
        physical_batch_size = per_pass if physical_batch_size is None else min(physical_batch_size, per_pass)
    accountant = RDPAccountant()
    accountant.history = list(history)
    dp_optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    params = dp_optimizer.params
    x_d, y_d = x_t.to(device), y_t.to(device)
    total, done, seen = config.local_epochs * steps_per_epoch, 0, 0
    loss_sum, loss_n = 0.0, 0
    try:
        for _ in range(config.local_epochs):
            loss_sum, loss_n = 0.0, 0
            for idx in poisson_batches(len(y_t), sample_rate=poisson_rate, steps=steps_per_epoch, generator=data_gen):
                dp_optimizer.zero_grad(set_to_none=True)
                if len(idx):
                    idx = idx.to(device, non_blocking=True)
                    chunks = idx.split(physical_batch_size) if physical_batch_size and len(idx) > physical_batch_size else (idx,)
                    for i, chunk in enumerate(chunks):
                        if i:
                            # Virtual step: the previous chunk's clipped sum is kept (Opacus's skip
                            # step), added to by this one, and the whole batch is noised once.
                            dp_optimizer.signal_skip_step(do_skip=True)
                            dp_optimizer.step()
                            dp_optimizer.zero_grad(set_to_none=True)
                        loss_sum += backward(x_d[chunk], y_d[chunk]) * len(chunk)
                        loss_n += len(chunk)
                elif clipping == "ew":
                    # An empty Poisson batch has no per-sample gradient: the step adds noise only (skipping it
                    # would reveal the empty draw, and "ew" cannot run a forward pass on zero samples).
                    for p in params:
                        p.grad_sample = p.new_zeros((0, *p.shape))
                # (ghost: no forward pass, no .grad, and FlatGhostDPOptimizer sums zeros: noise only.)
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
    return loss_sum / max(loss_n, 1), seen, normalise_history(accountant.history)


def dp_engine(
    work: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    clipping: str,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: int,
    generator: torch.Generator | None,
) -> tuple[Any, Any, Callable[[torch.Tensor, torch.Tensor], float]]:
    """The wrapping of `work` for `clipping` ("bk", "ghost" or "ew"): (wrapped module, DP optimizer, backward).

    `backward(x, y)` runs the forward and backward passes of one (physical) batch and returns its mean
    loss; afterwards the optimizer's `step` clips (ew), noises and averages. `wrapped.cleanup()` removes
    the hooks. What `train_local` runs,
    exposed so that tests can switch the noise off, which a DPPolicy never allows.
    """
    from opacus.grad_sample import GradSampleModuleFastGradientClipping, prepare_module
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    from fedbroker.worker.dp_optimizer import FlatDPOptimizer, FlatGhostDPOptimizer, FlatSumDPOptimizer

    noise = {"noise_multiplier": noise_multiplier, "max_grad_norm": max_grad_norm,
             "expected_batch_size": expected_batch_size, "generator": generator}
    if clipping == "bk":
        from fedbroker.worker.bookkeeping import BookkeepingClipper

        sum_optimizer = FlatSumDPOptimizer(optimizer, loss_reduction="mean", **noise)
        clipper = BookkeepingClipper(work, max_grad_norm=max_grad_norm, params=sum_optimizer.params)
        sum_optimizer.source = clipper.take_clipped_sum
        return clipper, sum_optimizer, clipper.backward
    if clipping == "ghost":
        wrapped = GradSampleModuleFastGradientClipping(work, batch_first=True, loss_reduction="mean",
                                                       max_grad_norm=max_grad_norm, use_ghost_clipping=True)
        dp_optimizer = FlatGhostDPOptimizer(optimizer, loss_reduction="mean", **noise)
        # Opacus's criterion: backward() takes the per-sample norms, then backpropagates each sample's
        # loss times its clip factor, leaving the sum of clipped per-sample gradients in .grad.
        criterion = DPLossFastGradientClipping(wrapped, dp_optimizer, nn.CrossEntropyLoss(), loss_reduction="mean")

        def backward(xb: torch.Tensor, yb: torch.Tensor) -> float:
            loss = criterion(wrapped(xb), yb)
            loss.backward()
            return float(loss.detach())
    elif clipping == "ew":
        if all(p.device.type == "cpu" for p in work.parameters()):
            _unfold_per_sample_conv()
        # The summed loss's per-sample gradients are the per-sample gradients themselves; the mean loss's
        # would be multiplied back by the batch size, one more pass over batch × parameters floats.
        # FlatDPOptimizer averages by the expected batch size either way.
        wrapped = prepare_module(work, grad_sample_mode=GRAD_SAMPLE_MODE, batch_first=True, loss_reduction="sum")
        wrapped.forbid_grad_accumulation()
        dp_optimizer = FlatDPOptimizer(optimizer, **noise)

        def backward(xb: torch.Tensor, yb: torch.Tensor) -> float:
            loss = nn.functional.cross_entropy(wrapped(xb), yb, reduction="sum")
            loss.backward()
            return float(loss.detach()) / len(yb)
    else:
        raise ConfigError("clipping", f"must be ghost or ew, got {clipping!r}")
    return wrapped, dp_optimizer, backward


def _unfold_per_sample_conv() -> None:
    """Make ExpandedWeights form Conv2d's per-sample gradients by unfold + batched matmul at every batch size.

    Below a batch of 32 (its private `THRESHOLD`) torch switches to one grouped convolution over the
    batch, which on CPU ran the ResNet-style CNN at batch 32 at 3.7× the time of training without DP
    against 2.3× (small CNN 2.0× against 1.8×): a Poisson batch of expected size 32 is below 32 about
    half the time. Both give the same gradients. Process-wide, set only when training on CPU (the GPU
    case is unmeasured); if torch renames the constant, nothing changes.
    """
    from torch.nn.utils._expanded_weights import conv_utils

    if isinstance(getattr(conv_utils, "THRESHOLD", None), int):
        conv_utils.THRESHOLD = 0


def poisson_batches(
    num_samples: int, *, sample_rate: float, steps: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Indices of `steps` Poisson batches: every sample joins every batch independently with `sample_rate`.

    The draw is Opacus's UniformWithReplacementSampler's (rand(N) < q per step, same generator, same
    indices), kept as a tensor so a batch is one gather: Opacus's DPDataLoader fetches and collates
    the samples one by one, which cost more than the forward pass of a small model.
    """
    # Several steps' draws at once (one rand(steps, N) is the same stream as steps × rand(N)), at most
    # POISSON_BLOCK_FLOATS at a time: per step, four small operations cost more than the draw itself.
    rows = max(1, POISSON_BLOCK_FLOATS // max(num_samples, 1))
    for first in range(0, steps, rows):
        mask = torch.rand(min(rows, steps - first), num_samples, generator=generator) < sample_rate
        yield from mask.nonzero()[:, 1].split(mask.sum(1).tolist())


def _opacus_poisson_rule(
    num_samples: int, config: TrainingConfig, steps_per_epoch: int, sample_rate: float
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


def _make_optimizer(work: nn.Module, config: TrainingConfig) -> torch.optim.Optimizer:
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
