"""A job's plan on a torch model: LoRA adapters put in place of their target Linears, and every tensor that
does not train frozen (`requires_grad` off), so Opacus's optimizers, our clipping and the noise see only
what trains.

An adapted Linear keeps its own `weight` and `bias` (their names on the wire stay `<node>.weight`,
`<node>.bias`) and holds A and B as plain `nn.Linear` submodules (`<node>.lora_a.weight`,
`<node>.lora_b.weight`), so per-sample clipping handles them as any Linear, with no new machinery.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedbroker.job.model_spec import ModelSpec
from fedbroker.model import build_model, load_numpy_state, state_to_numpy
from fedbroker.weights.plan import Adapters, ModelPlan, trainable_names


class LoRALinear(nn.Linear):
    """base(x) + (alpha/rank)·B(A(x)): the base weight frozen, A (rank×in) drawn as nn.Linear draws its
    weights, B (out×rank) zero, so the adapted model starts as the base model."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float) -> None:
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None,
                         device=base.weight.device, dtype=base.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(base.weight)
            if base.bias is not None and self.bias is not None:
                self.bias.copy_(base.bias)
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.scale = alpha / rank
        self.lora_a = nn.Linear(base.in_features, rank, bias=False, device=base.weight.device, dtype=base.weight.dtype)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False, device=base.weight.device,
                                dtype=base.weight.dtype)
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen base's output plus the scaled low-rank path."""
        low_rank: torch.Tensor = self.lora_b(self.lora_a(x))
        return F.linear(x, self.weight, self.bias) + self.scale * low_rank


def add_adapters(model: nn.Module, adapters: Adapters) -> None:
    """Put a LoRALinear in place of every target (a dotted node name, "0" for a chain's first layer)."""
    for target in adapters.targets:
        parent_name, _, child = target.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = parent.get_submodule(child)
        if type(base) is not nn.Linear:
            raise ValueError(f"adapter target {target!r} is a {type(base).__name__}, not a Linear")
        setattr(parent, child, LoRALinear(base, rank=adapters.rank, alpha=adapters.alpha))


def apply_plan(model: nn.Module, plan: ModelPlan, trainable: list[str]) -> None:
    """Add the plan's adapters (when it has them), then train exactly the `trainable` tensors
    (`fedbroker.weights.plan.trainable_names`); a name that is no parameter of the model raises ValueError."""
    if plan.adapters is not None:
        add_adapters(model, plan.adapters)
    names = dict(model.named_parameters())
    unknown = sorted(set(trainable) - set(names))
    if unknown:
        raise ValueError(f"the plan trains {unknown[0]!r}, which the model does not hold")
    keep = set(trainable)
    for name, param in names.items():
        param.requires_grad_(name in keep)


def trained_names(model: nn.Module) -> list[str]:
    """The parameters that train (requires_grad on), by state_dict name."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def start_state(spec: ModelSpec, plan: ModelPlan, *, seed: int,
                base: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """A job's version-1 weights: `base` (checked start weights) or the seeded random draw, then the plan's
    adapters (A drawn from the same seed, B zero: the adapted model computes what the base model does)."""
    model = build_model(spec, seed=seed)
    if base is not None:
        load_numpy_state(model, base)
    apply_plan(model, plan, trainable_names(spec, plan))
    return state_to_numpy(model)


def planned_model(spec: ModelSpec, plan: ModelPlan) -> nn.Module:
    """The torch model a site trains for a job: built from the spec, the plan's adapters in place and every
    tensor outside `trainable_names` frozen (weights still to be loaded)."""
    model = build_model(spec)
    apply_plan(model, plan, trainable_names(spec, plan))
    return model
