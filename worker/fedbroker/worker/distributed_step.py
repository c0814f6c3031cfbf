"""A site's step of a distributed-DP round (privacy.distributed): the clipped sum of its records' gradients.

In such a job a round is one federated DP-SGD step. The site draws a Poisson sample of its records (each joins
independently with the job's probability q, so the sample's size is random and never sent), computes each sampled
record's gradient of its own loss at the global model, clips each to L2 norm C and sums them: no averaging, no
local optimiser and no noise of Opacus's. The noise is the site's Skellam share, added in the ring after this sum is
quantised (worker/secure_task.py); only the secure sum of the survivors' shares is ever seen.

The per-record gradients come from torch.func (`functional_call` under `vmap(grad(...))`): every record's gradient
is its own, which is what the clip bounds. A module that mixes the records of a batch (BatchNorm in training mode)
has no per-record gradient and is refused, with Opacus's validator's reasons, as DP training refuses it. Dropout
draws independently per record (`randomness="different"`).

The sum is returned in float64 in the model's parameter order (`fedbroker.job.spec.parameter_shapes`: the layout of
secure_task.weighted_vector and of the service), with zeros for what does not train (a frozen layer, a buffer).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.datasets.stream import FileSamples
from fedbroker.errors import ConfigError, TaskRefused
from fedbroker.job.task import TaskConfig
from fedbroker.tasks.losses import per_sample_loss
from fedbroker.worker.batches import Batches

if TYPE_CHECKING:
    from fedbroker.job.pipeline import DataPipeline

CHUNK = 256   # records whose gradients are held at once (memory: CHUNK × the model's parameters, float32)


@dataclass(frozen=True)
class GradientSum:
    """The clipped sum of one round (`vector`, float64, the model's parameter order) and what the site logs of it:
    how many records the Poisson draw sampled (never sent) and how many of their gradients the clip shortened."""

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


def gradient_sum(model: nn.Module, x: np.ndarray | torch.Tensor | FileSamples, y: np.ndarray | torch.Tensor | FileSamples,
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
    from fedbroker.worker.training import prepared_inputs

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
    """Refuse a module with no per-record gradient (BatchNorm in training mode mixes a batch's records): before
    anything is sampled, so a refused task spends nothing."""
    from fedbroker.worker.training import validate_for_dp

    validate_for_dp(model)
