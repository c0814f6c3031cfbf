"""The two step loops of local training, without DP and as DP-SGD, over one `LocalRun`.

- Poisson sampling: Opacus's DPDataLoader fetches and collates each sample on its own, 10–14% of
  a DP step. `poisson_batches` draws the same mask as its sampler (rand(N) < q per step) and
  gathers a batch in one indexing operation. An empty batch still takes a step, noise only and
  without a forward pass: the accountant counts every step, and skipping one would reveal the draw.
  The rate and step count are Opacus's (see `fedbroker.privacy`), checked against its own loader before
  any step. Several steps' masks are drawn at once (one rand(steps, N), the same stream as per-step draws).
- Virtual steps (`physical_batch_size`): a Poisson batch larger than memory allows is trained in
  chunks; each chunk's clipped sum is accumulated (Opacus's skip step) and the batch is noised
  once, so the update and the one accountant step are those of a single pass. "ew" also trains a batch
  in virtual steps of at most `EW_MAX_FLOATS` per-sample gradient floats, which then stay in cache
  (ResNet-style CNN at batch 256: 2.4× → 1.6–1.8×), and "bk" in passes of at most `BK_MAX_FLOATS`
  samples × parameters (the same CNN: 1.46–1.62× in one pass, 1.29–1.32× in passes of 64–128 samples,
  measured while developing).
- FedProx under DP: the proximal gradient mu·(w − w_global) is added after Opacus has clipped and
  noised the data gradient (it touches no sample, so it is free post-processing); inside the loss
  it would never reach Opacus's per-sample gradients and would silently vanish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedbroker.config import DPPolicy
from fedbroker.job.spec import TrainingConfig
from fedbroker.privacy import HistoryEntry, normalise_history
from fedbroker.worker.clipping import PerSampleLoss, dp_engine

if TYPE_CHECKING:
    from fedbroker.worker.clipping import DPOptimizer

# "ew" trains a Poisson batch in chunks of at most this many per-sample gradient floats (256 MiB):
# beyond it the per-sample gradients fall out of cache and the pass slows (ResNet-style CNN, 1.2 M
# parameters, batch 256 on CPU: 2.4× in one pass, 1.6× in chunks of 32–64).
EW_MAX_FLOATS = 1 << 26
# "bk" trains a Poisson batch in passes of at most this many samples × parameters, a proxy for its
# activations and unfolded inputs (ResNet-style CNN at batch 256: 1.46–1.62× in one pass, 1.29–1.32× in
# passes of 64–128 samples; the MLP and the small CNN are never split). Within a pass the clipper bounds
# what its hooks keep (`one_pass_clipping.PASS_FLOATS`), which a model of few parameters and large
# activations reaches first (small residual CNN: 77 k parameters, 452 k kept floats per sample).
BK_MAX_FLOATS = 1 << 27
POISSON_BLOCK_FLOATS = 1 << 20


Fetch = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LocalRun:
    """What both loops work on: the throw-away copy being trained, its optimizer, the batches, the job's settings
    and the batch stream. `fetch(idx)` gives the samples `idx` as a batch on the device (decoded, prepared and
    augmented when they stream from files: `fedbroker.worker.batches`); `prefetch(idx)`, when set, is told the
    batch that comes after the one being fetched, to decode it meanwhile. `anchor` holds the global weights for
    FedProx's proximal term (None without one); `progress(step, total)` is called after every step, and may raise
    to abandon the training."""

    work: nn.Module
    optimizer: torch.optim.Optimizer
    fetch: Fetch
    num_samples: int
    config: TrainingConfig
    steps_per_epoch: int
    data_gen: torch.Generator
    device: torch.device
    anchor: list[torch.Tensor] | None
    progress: Callable[[int, int], None] | None
    loss: PerSampleLoss   # the task's loss per sample, (n,) (fedbroker.tasks.losses)
    prefetch: Callable[[torch.Tensor], None] | None = None


@dataclass
class _Tally:
    """The last epoch's sample-weighted loss, the samples seen and the steps taken, reported to `progress`."""

    run: LocalRun
    steps: int = 0
    seen: int = 0
    loss_sum: float = 0.0
    loss_n: int = 0

    def new_epoch(self) -> None:
        self.loss_sum, self.loss_n = 0.0, 0

    def add_loss(self, mean_loss: float, samples: int) -> None:
        self.loss_sum += mean_loss * samples
        self.loss_n += samples

    def step_taken(self, samples: int) -> None:
        self.seen += samples
        self.steps += 1
        if self.run.progress is not None:
            self.run.progress(self.steps, self.run.config.local_epochs * self.run.steps_per_epoch)

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(self.loss_n, 1)


def train_plain(run: LocalRun) -> tuple[float, int]:
    """Train without DP; (the last epoch's mean loss, samples seen).

    Shuffled batches of B; the last step of an epoch takes the remainder, so every sample is seen once per
    epoch in exactly int(1/q) steps, the same count as the DP loop.
    """
    tally = _Tally(run)
    epoch = -1
    for unit in _looking_ahead(_shuffled(run), run.prefetch):
        if unit.epoch != epoch:
            epoch = unit.epoch
            tally.new_epoch()
        xb, yb = run.fetch(unit.idx)
        run.optimizer.zero_grad(set_to_none=True)
        loss = run.loss(run.work(xb), yb).mean()
        loss.backward()
        _add_proximal_grad(run)
        run.optimizer.step()
        tally.add_loss(float(loss.detach()), len(yb))
        tally.step_taken(len(yb))
    return tally.mean_loss, tally.seen


@dataclass(frozen=True)
class _Unit:
    """One fetch: the samples `idx` of epoch `epoch`; in a DP step, whether it is its batch's first and last pass
    (a Poisson batch larger than a pass is fetched in passes; an empty batch is one unit of no samples)."""

    epoch: int
    idx: torch.Tensor
    first: bool = True
    last: bool = True


def _shuffled(run: LocalRun) -> Iterator[_Unit]:
    """Every epoch's shuffled batches of B; the last step of an epoch takes the remainder."""
    bs, per_epoch = run.config.batch_size, run.steps_per_epoch
    for epoch in range(run.config.local_epochs):
        perm = torch.randperm(run.num_samples, generator=run.data_gen).to(run.device)
        for s in range(per_epoch):
            yield _Unit(epoch, perm[s * bs : (s + 1) * bs] if s < per_epoch - 1 else perm[s * bs :])


def _looking_ahead(units: Iterator[_Unit], prefetch: Callable[[torch.Tensor], None] | None) -> Iterator[_Unit]:
    """The units in order; `prefetch` is told of the first, then, before one is handed out, of the next (drawing
    it early changes no draw: the batch generator serves nothing else)."""
    current = next(units, None)
    if prefetch is not None and current is not None and len(current.idx):
        prefetch(current.idx)
    while current is not None:
        following = next(units, None)
        if prefetch is not None and following is not None and len(following.idx):
            prefetch(following.idx)
        yield current
        current = following


def train_dp(
    run: LocalRun,
    *,
    dp: DPPolicy,
    history: list[HistoryEntry],
    sample_rate: float,
    noise_gen: torch.Generator,
    clipping: str,
    physical_batch_size: int | None,
) -> tuple[float, int, list[HistoryEntry]]:
    """Train as DP-SGD under `dp`; (the last epoch's mean loss, samples seen, the job's accountant history after).

    Opacus's RDP accountant, restored from `history`, records every step through the optimizer's hook, so
    the history returned is the accountant's own.
    """
    from opacus.accountants import RDPAccountant

    poisson_rate, expected_batch_size = _opacus_poisson_rule(run.num_samples, run.config, run.steps_per_epoch,
                                                             sample_rate)
    wrapped, dp_optimizer, backward = dp_engine(
        run.work, run.optimizer, clipping=clipping, noise_multiplier=dp.noise_multiplier,
        max_grad_norm=dp.max_grad_norm, expected_batch_size=expected_batch_size, generator=noise_gen, loss=run.loss)
    pass_size = _pass_size(clipping, dp_optimizer.params, physical_batch_size)
    accountant = RDPAccountant()
    accountant.history = list(history)
    dp_optimizer.attach_step_hook(accountant.get_optimizer_hook_fn(sample_rate=sample_rate))
    tally = _Tally(run)
    epoch, taken = -1, 0
    try:
        for unit in _looking_ahead(_poisson_units(run, poisson_rate, pass_size), run.prefetch):
            if unit.epoch != epoch:
                epoch = unit.epoch
                tally.new_epoch()
            if unit.first:
                dp_optimizer.zero_grad(set_to_none=True)
                taken = 0
            else:
                # Virtual step: the previous pass's clipped sum is kept (Opacus's skip step), added to by
                # this one, and the whole batch is noised once.
                dp_optimizer.signal_skip_step(do_skip=True)
                dp_optimizer.step()
                dp_optimizer.zero_grad(set_to_none=True)
            if len(unit.idx):
                tally.add_loss(backward(*run.fetch(unit.idx)), len(unit.idx))
                taken += len(unit.idx)
            elif clipping == "ew":
                # An empty Poisson batch has no per-sample gradient: the step adds noise only (skipping it
                # would reveal the empty draw, and "ew" cannot run a forward pass on zero samples).
                for p in dp_optimizer.params:
                    p.grad_sample = p.new_zeros((0, *p.shape))
            # (ghost: no forward pass, no .grad, and FlatGhostDPOptimizer sums zeros: noise only.)
            if unit.last:
                _noised_step(run, dp_optimizer)
                tally.step_taken(taken)
    finally:
        wrapped.cleanup()  # remove Opacus's hooks and per-sample attributes from the throw-away copy
    return tally.mean_loss, tally.seen, normalise_history(accountant.history)


def _poisson_units(run: LocalRun, rate: float, pass_size: int | None) -> Iterator[_Unit]:
    """Every epoch's Poisson batches, each in passes of at most `pass_size` samples."""
    for epoch in range(run.config.local_epochs):
        for idx in poisson_batches(run.num_samples, sample_rate=rate, steps=run.steps_per_epoch,
                                   generator=run.data_gen):
            idx = idx.to(run.device, non_blocking=True)
            chunks = idx.split(pass_size) if pass_size and len(idx) > pass_size else (idx,)
            for i, chunk in enumerate(chunks):
                yield _Unit(epoch, chunk, first=i == 0, last=i == len(chunks) - 1)


def _pass_size(clipping: str, params: Sequence[torch.Tensor], asked: int | None) -> int | None:
    """Samples of one forward/backward pass: `asked`, and for "ew" and "bk" at most what keeps the pass's
    intermediates in cache (virtual steps: the same update)."""
    pass_floats = {"ew": EW_MAX_FLOATS, "bk": BK_MAX_FLOATS}.get(clipping)
    if pass_floats is None:
        return asked
    per_pass = max(1, pass_floats // sum(p.numel() for p in params))
    return per_pass if asked is None else min(asked, per_pass)


def _noised_step(run: LocalRun, dp_optimizer: DPOptimizer) -> None:
    """Noise the clipped sum and step; FedProx's proximal gradient mu·(w − w_global) depends on no training
    sample, so it is added after clipping and noising (post-processing, free in privacy): put into the loss
    it would never reach Opacus's per-sample gradients and would be lost."""
    if run.anchor is None:
        dp_optimizer.step()
    elif dp_optimizer.pre_step():
        _add_proximal_grad(run)
        dp_optimizer.original_optimizer.step()


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


def _add_proximal_grad(run: LocalRun) -> None:
    """Add the gradient of (mu/2)·||w − w_global||², i.e. mu·(w − w_global), to every parameter."""
    if run.anchor is None:
        return
    mu = run.config.proximal_mu
    with torch.no_grad():
        for p, p0 in zip(run.work.parameters(), run.anchor):
            if not p.requires_grad:  # frozen: it never moves from the global model
                continue
            if p.grad is None:
                p.grad = mu * (p - p0)
            else:
                p.grad.add_(p - p0, alpha=mu)
