"""Build a torch model from a validated ModelSpec, and move its weights to and from numpy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from fedbroker.job.spec import ModelSpec
from fedbroker.layers import LAYERS
from fedbroker.layers.library import ARCHITECTURES
from fedbroker.layers.modules import BUILDERS


class Standardize(nn.Module):
    """(x - mean) / std on the model's input: the spec's `standardize` layer, the preprocessing that travels
    with the model. mean and std are one number, or one per input feature (in the flattened input's order,
    reshaped to the input's shape). They are non-persistent buffers: not in the state_dict, so the weights on
    the wire, aggregation and Opacus see a model without them; they follow `.to()` and `.double()`."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: float | Sequence[float], std: float | Sequence[float]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The standardised input, shaped as the input."""
        shape = x.shape[1:]
        mean = self.mean.reshape(shape) if self.mean.dim() else self.mean
        std = self.std.reshape(shape) if self.std.dim() else self.std
        return (x - mean) / std


_OWN_MODULES: Mapping[str, type[nn.Module]] = {"Standardize": Standardize}  # layer types torch has no class for


def build_layer(kind: str, params: Mapping[str, Any]) -> nn.Module:
    """One layer of the table (`fedbroker.layers.LAYERS`) from its checked parameters: torch's class of the
    entry's name, or the wing's own builder (`fedbroker.layers.modules.BUILDERS`)."""
    if kind not in LAYERS:  # parse_model refuses unknown types; a hand-built spec may not have
        raise ValueError(f"no builder for layer type {kind!r}")
    if kind in BUILDERS:
        return BUILDERS[kind](params)
    if kind in ARCHITECTURES:  # a library network: MONAI builds it (MONAI imported only for such a model)
        from fedbroker.layers.monai_nets import build as build_library

        return build_library(kind, params)
    name = LAYERS[kind].torch_class
    torch_class: type[nn.Module] = _OWN_MODULES.get(name) or getattr(nn, name)
    return torch_class(**params)


def build_model(spec: ModelSpec, *, seed: int | None = None) -> nn.Sequential:
    """An nn.Sequential whose state_dict names ("0.weight", ...) are the tensor names on the wire."""
    if seed is not None:
        torch.manual_seed(seed)
    return nn.Sequential(*(build_layer(layer.type, layer.params) for layer in spec.layers))


def state_to_numpy(model: nn.Module) -> dict[str, np.ndarray]:
    """float32 copies of the weights, detached from torch, as they are streamed and averaged."""
    return {name: t.detach().cpu().numpy().astype(np.float32, copy=True) for name, t in model.state_dict().items()}


def load_numpy_state(model: nn.Module, state: Mapping[str, np.ndarray]) -> None:
    """Load weights, refusing missing, unexpected or mis-shaped tensors by name."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    if missing or extra:
        raise ValueError(f"model weights do not match the spec: missing {missing}, unexpected {extra}")
    for name, tensor in own.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r} has shape {list(state[name].shape)}, the spec needs {list(tensor.shape)}")
    model.load_state_dict({k: torch.from_numpy(np.array(v, dtype=np.float32)) for k, v in state.items()})


def initial_weights(spec: ModelSpec, *, seed: int) -> dict[str, np.ndarray]:
    """Round 0's weights: the same seed gives every run of a job the same starting model."""
    return state_to_numpy(build_model(spec, seed=seed))
