"""A site's step of a distributed-DP round (privacy.distributed): the clipped sum of its records' gradients.

In such a job a round is one federated DP-SGD step. The site draws a Poisson sample of its records (each joins
independently with the job's probability q, so the sample's size is random and never sent), computes each sampled
record's gradient of its own loss at the global model, clips each to L2 norm C and sums them: no averaging, no
local optimiser and no noise of Opacus's. The noise is the site's Skellam share, added in the ring after this sum is
quantised (worker/secure_task.py); only the secure sum of the survivors' shares is ever seen.

The per-record gradients come from torch.func (`functional_call` under `vmap(grad(...))`): every record's gradient
is its own, which is what the clip bounds. A module that mixes the records of a batch (BatchNorm in training mode)
has no per-record gradient and is refused before anything is sampled. Dropout draws independently per record
(`randomness="different"`). A large model takes fewer records per pass (`CHUNK_BYTES`); the sum is the same.

`DistributedStep` runs the rest on the site, around the secure protocol (worker/secure_task.py): before any key
leaves, the round's settings (`round_for`: γ, ring bits, from the task's participants, the job's section, the model's
size and the records), this site's noise share μ_i (`skellam.share_variance_for` under its own dp.mode and
local_floor_epsilon) and the budget check against the distributed ε; after the key exchange, the gradient sum,
quantised with γ, plus Skellam(μ_i) noise, in the ring, masked, and both ε figures on the ledger before anything
leaves. The sample's loss is not released (the noise does not cover it): the task reports a loss of 0.

The sum is returned in float64 in the model's parameter order (`fedbroker.job.spec.parameter_shapes`: the layout of
secure_task.weighted_vector and of the service), with zeros for what does not train (a frozen layer, a buffer).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.datasets.stream import FileSamples
from fedbroker.errors import ConfigError, TaskRefused
from fedbroker.job.privacy import DistributedDP
from fedbroker.job.settings import InstalledJob
from fedbroker.job.spec import ModelSpec, parameter_shapes
from fedbroker.job.task import TaskConfig
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.secagg import secure_round, skellam
from fedbroker.tasks.losses import per_sample_loss
from fedbroker.worker.batches import Batches
from fedbroker.worker.budget import SiteBudget
from fedbroker.worker.ledger import DistributedRound
from fedbroker.worker.training import TrainResult, prepared_inputs

if TYPE_CHECKING:
    from fedbroker.job.pipeline import DataPipeline

CHUNK = 256   # the most records whose gradients are held at once
CHUNK_BYTES = 2**29   # ... and at most this much of them (float64 copies included): a large model takes fewer


class Masking(Protocol):
    """Where the noised ring vector goes: the task's SecureRun (worker/secure_task.py), which masks it once."""

    def mask_integers(self, values: np.ndarray[Any, Any], *, bits: int) -> None:
        """Mask `values`, elements of the ring of `bits` bits."""


@dataclass(frozen=True)
class GradientSum:
    """The clipped sum of one round (`vector`, float64, the model's parameter order) and what the site keeps to
    itself: how many records the Poisson draw sampled (never sent) and how many of their gradients the clip shortened."""

    vector: np.ndarray
    sampled: int
    clipped: int


def refuse_without_dp(dp: DPPolicy | None, job_id: str) -> None:
    """A site whose owner turned DP off adds no noise share: its gradient sum would join the secure sum noiseless,
    and the other sites' shares were sized for a quorum that counts it. It refuses the job's tasks instead."""
    if dp is None or not dp.enabled:
        raise TaskRefused(f"job {job_id} runs distributed DP (privacy.distributed), but this site's DP policy is "
                          f"off (worker.dp.enabled: false): it would add no noise share to the secure sum; enable "
                          f"worker.dp to take part")


def poisson_sample(num_records: int, sample_rate: float, rng: np.random.Generator) -> np.ndarray:
    """The indices of a Poisson sample: each record independently with probability `sample_rate`."""
    if not 0.0 < sample_rate <= 1.0:
        raise ConfigError("privacy.distributed.sample_rate", f"must lie in (0, 1], got {sample_rate!r}")
    return np.flatnonzero(rng.random(num_records) < sample_rate)


def gradient_sum(model: nn.Module, x: np.ndarray | FileSamples, y: np.ndarray | FileSamples,
                 *, names: Sequence[str], clip: float, sample_rate: float, rng: np.random.Generator,
                 task: TaskConfig | None = None, pipeline: DataPipeline | None = None, device: str = "cpu",
                 frozen: Collection[str] = (), chunk: int = CHUNK, cache: str = "") -> GradientSum:
    """Σ over a Poisson sample of the records of clip_C(∇ loss(record)) at `model`'s weights (module docstring).

    `names`: the model's tensors in the service's layout order; a name that is no trainable parameter (or is in
    `frozen`) stays zero. `rng` draws the sample: the worker seeds it from the operating system (whoever knows the
    seed knows which records were drawn)."""
    if not (isinstance(clip, (int, float)) and math.isfinite(clip) and clip > 0):
        raise ConfigError("privacy.distributed.clip", f"must be a positive finite number, got {clip!r}")
    check_per_record(model)
    task = task or TaskConfig()
    x_in, y_in = prepared_inputs(task, x, y)
    dev = torch.device(device)
    work = model.to(dev)
    work.train()
    params = {n: p.detach() for n, p in work.named_parameters() if p.requires_grad and n not in set(frozen)}
    unknown = sorted(set(params) - set(names))
    if unknown:
        raise ConfigError("model", f"trains tensors the round's layout does not hold: {', '.join(unknown[:5])}")
    buffers = {n: b.detach() for n, b in work.named_buffers()}
    sums = {n: torch.zeros(p.shape, dtype=torch.float64, device=dev) for n, p in params.items()}
    index = poisson_sample(len(x_in), sample_rate, rng)
    per_record = _per_record_grad(work, task)
    chunk = max(1, min(chunk, CHUNK_BYTES // (12 * max(1, sum(p.numel() for p in params.values())))))
    clipped = 0
    batches = Batches(x_in, y_in, pipeline=pipeline, device=dev, cache=cache,
                      generator=torch.Generator().manual_seed(int(rng.integers(2**62))))
    try:
        for start in range(0, index.size, chunk):
            xb, yb = batches.fetch(torch.from_numpy(index[start:start + chunk]))
            grads = per_record(params, buffers, xb, yb)
            clipped += _add_clipped(grads, sums, clip)
    finally:
        batches.close()
    return GradientSum(vector=_flat(sums, names, dict(work.state_dict())), sampled=int(index.size), clipped=clipped)


def _per_record_grad(model: nn.Module, task: TaskConfig) -> Any:
    """vmap(grad(one record's loss)) over the records of a batch."""
    from torch.func import functional_call, grad, vmap

    def loss_of_one(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], xi: torch.Tensor,
                    yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, (params, buffers), (xi.unsqueeze(0),))
        return per_sample_loss(task, out, yi.unsqueeze(0)).sum()

    return vmap(grad(loss_of_one), in_dims=(None, None, 0, 0), randomness="different")


def _add_clipped(grads: dict[str, torch.Tensor], sums: dict[str, torch.Tensor], clip: float) -> int:
    """Add each record's gradient, scaled to L2 norm ≤ `clip` (in float64, so the bound holds to rounding), to
    `sums`; the number of records it shortened."""
    if not grads:
        return 0
    g64 = {n: g.to(torch.float64) for n, g in grads.items()}
    norms = torch.sqrt(sum((g.flatten(1) ** 2).sum(dim=1) for g in g64.values()))  # type: ignore[arg-type]
    factor = torch.clamp(clip / torch.clamp(norms, min=1e-300), max=1.0)
    for name, g in g64.items():
        sums[name] += torch.einsum("r,r...->...", factor, g)
    return int((norms > clip).sum().item())


def _flat(sums: dict[str, torch.Tensor], names: Sequence[str], state: dict[str, torch.Tensor]) -> np.ndarray:
    """The sums in the layout's order, zeros for the tensors that do not train."""
    parts = []
    for name in names:
        if name in sums:
            parts.append(sums[name].detach().cpu().numpy().reshape(-1))
        elif name in state:
            parts.append(np.zeros(state[name].numel(), dtype=np.float64))
        else:
            raise ConfigError("model", f"has no tensor {name!r} of the round's layout")
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float64)


def check_per_record(model: nn.Module) -> None:
    """Refuse a module with no per-record gradient before anything is sampled, so a refused task spends nothing:
    BatchNorm in training mode (and InstanceNorm tracking running statistics) mixes the records of a batch."""
    from torch.nn.modules.batchnorm import _BatchNorm
    from torch.nn.modules.instancenorm import _InstanceNorm

    mixing = sorted({type(m).__name__ for m in model.modules()
                     if isinstance(m, _BatchNorm) or (isinstance(m, _InstanceNorm) and m.track_running_stats)})
    if mixing:
        raise ConfigError("model", f"has no per-record gradient for distributed DP: {', '.join(mixing)} mixes the "
                                   f"records of a batch in training mode. Replace BatchNorm with GroupNorm (or "
                                   f"LayerNorm) in the model spec")


def layout_size(spec: ModelSpec) -> int:
    """d: the values of the round's vector (every tensor of the layout, as secure_task.weighted_vector lays them)."""
    return sum(math.prod(shape) for shape in parameter_shapes(spec).values())


def round_for(*, participants: int, distributed: DistributedDP, dim: int, records: int) -> skellam.DDPRound:
    """The round's settings, as the service derives them (`secure_round.ddp_round_params`, shared by both ends).
    Both ends check the other's ring bits."""
    return secure_round.ddp_round_params(participants=participants, distributed=distributed, dimension=dim,
                                         records=records)


def step_for(job_id: str, installed: InstalledJob, *, policy: DPPolicy | None,
             budget: SiteBudget) -> DistributedStep | None:
    """The site's step of a round of `installed` when it runs distributed DP (None: the secure round sums updates)."""
    settings = installed.privacy.distributed
    if not settings.enabled:
        return None
    return DistributedStep(job_id=job_id, policy=policy, settings=settings, budget=budget,
                           num_samples=budget.num_samples)


class DistributedStep:
    """One site's part of one distributed-DP round (module docstring); kept with its SecureRun across retries, so
    a retry re-sends the same masked bytes and spends nothing again."""

    def __init__(self, *, job_id: str, policy: DPPolicy | None, settings: DistributedDP, budget: SiteBudget,
                 num_samples: int, rng: np.random.Generator | None = None) -> None:
        refuse_without_dp(policy, job_id)
        assert policy is not None
        self.job_id, self.policy, self.settings, self.budget = job_id, policy, settings, budget
        self.num_samples = num_samples
        self.rng = rng if rng is not None else np.random.default_rng(int.from_bytes(os.urandom(16), "little"))
        self.round: skellam.DDPRound | None = None
        self.step: DistributedRound | None = None   # what the ledger records of the round
        self.figures: tuple[float, float] | None = None   # (distributed ε, local-floor ε) after the round
        self.result: TrainResult | None = None

    @property
    def mu(self) -> float:
        """μ_i, the variance this site adds (what it declares in its advertisement); 0 before `prepare`."""
        return self.step.mu if self.step is not None else 0.0

    def prepare(self, task: pb.RoundTask, spec: ModelSpec) -> None:
        """Before any key leaves: the round's settings, μ_i and the budget check (BudgetExceeded, TaskRefused).
        Once; a retry keeps them."""
        if self.step is not None:
            return
        policy, ledger = self.policy, self.budget.ledger
        r = self._round(task, dim=layout_size(spec), records=self.num_samples)
        done = len(ledger.distributed_rounds(self.job_id))
        try:
            mu = skellam.share_variance_for(mode=policy.mode, round=r, local_floor_epsilon=policy.local_floor_epsilon,
                                            rounds=done + 1, delta=policy.delta)
        except ConfigError as exc:
            raise TaskRefused(f"job {self.job_id}: this site's floor cannot be kept in round {done + 1}: {exc}") from None
        cap = r.max_share_variance or r.full_variance
        if mu > cap * (1 + 1e-12):
            raise TaskRefused(f"job {self.job_id}: this site's dp.local_floor_epsilon {policy.local_floor_epsilon:g} "
                              f"needs a noise share of {mu:.4g} levels², above the {cap:.4g} the round's ring is "
                              f"sized for (it could wrap the sum); raise the floor or take part in mode local")
        step = DistributedRound(round=int(task.round), scale=r.scale, dim=r.dim, clip=r.clip,
                                noise_multiplier=r.noise_multiplier, sample_rate=r.sample_rate, quorum=r.quorum,
                                mu=mu, bits=r.bits, delta=policy.delta, mode=policy.mode)
        self.figures = self.budget.check_distributed(self.job_id, step)
        self.round, self.step = r, step

    def settle(self, params: pb.SecParams, task: pb.RoundTask) -> int:
        """The ring bits of the round as the service announced it: the round re-derived with the roster's records
        (`ddp_records` where the service sends them), checked against the service's length and γ."""
        assert self.round is not None and self.step is not None
        records = int(getattr(params, "ddp_records", 0) or self.num_samples)
        if records < self.num_samples:
            raise TaskRefused(f"job {self.job_id}: the service sizes the ring for {records} records, fewer than this "
                              f"site's {self.num_samples}")
        final = self._round(task, dim=self.round.dim, records=records)
        stated = (getattr(params, "ddp_scale", 0.0) or final.scale, getattr(params, "ddp_bits", 0) or final.bits,
                  getattr(params, "ddp_quorum", 0) or final.quorum)   # the service's own statement, where it sends one
        if (int(params.length) != final.dim or final.scale != self.round.scale
                or stated != (final.scale, final.bits, final.quorum)):
            raise TaskRefused(f"job {self.job_id}: the service's round ({params.length} values; γ, bits, quorum "
                              f"{stated}) is not the one this site priced ({final.dim} values; "
                              f"{(self.round.scale, final.bits, final.quorum)})")
        self.round, self.step = final, replace(self.step, bits=final.bits)
        return final.bits

    def _round(self, task: pb.RoundTask, *, dim: int, records: int) -> skellam.DDPRound:
        """`round_for`, a job the round cannot run refused (a quorum above the participants, a ring over 64 bits)."""
        try:
            return round_for(participants=task.participants, distributed=self.settings, dim=dim, records=records)
        except ConfigError as exc:
            raise TaskRefused(f"job {self.job_id}: round {task.round} cannot run distributed DP here: {exc}") from None

    def run(self, secure: Masking, model: nn.Module, spec: ModelSpec, *, x: Any, y: Any, task: TaskConfig | None,
            pipeline: DataPipeline | None, device: str, frozen: Collection[str], cache: str = "") -> TrainResult:
        """The gradient sum, quantised, noised, in the ring, recorded on the ledger, then masked (once)."""
        if self.result is not None:
            return self.result
        assert self.round is not None and self.step is not None and self.figures is not None
        start = time.perf_counter()
        total = gradient_sum(model, x, y, names=list(parameter_shapes(spec)), clip=self.settings.clip,
                             sample_rate=self.settings.sample_rate, rng=self.rng, task=task, pipeline=pipeline,
                             device=device, frozen=frozen, cache=cache)
        levels = skellam.quantise(total.vector, scale=self.round.scale, rng=self.rng)
        levels += skellam.noise_share(self.rng, size=levels.shape[0], variance=self.step.mu)
        ring = skellam.to_ring(levels, bits=self.step.bits)
        distributed, floor = self.figures
        self.budget.ledger.record_distributed(self.job_id, step=self.step, epsilon=distributed, floor_epsilon=floor)
        self.budget.export()
        secure.mask_integers(ring, bits=self.step.bits)
        seconds = time.perf_counter() - start
        self.result = TrainResult(state={}, num_samples=self.num_samples, train_loss=0.0, steps=1, seconds=seconds,
                                  samples_per_second=total.sampled / seconds if seconds > 0 else 0.0,
                                  epsilon=distributed, history=[], clipping="per-record",
                                  epsilon_local_floor=floor)
        return self.result
