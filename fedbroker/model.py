"""Build a torch model from a validated ModelSpec, and move its weights to and from numpy."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from fedbroker.graph.nodes import MERGES
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


class GraphModel(nn.Module):
    """A model graph (ModelSpec.nodes) as one module: each node's layer registered under its dotted name in
    nested ModuleDicts, so state_dict names are `<node>.<tensor>` (`b1.conv1.weight`), in the order
    `parameter_shapes` gives. Forward runs the nodes in topological order; merges are out of place (never
    `+=` on a tensor autograd, Opacus's hooks or our clipping's hooks still hold), and each value is
    dropped after its last reader."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self._steps: list[tuple[str, str, tuple[str, ...]]] = []
        last_read: dict[str, int] = {}
        for index, node in enumerate(spec.nodes):
            if node.type not in MERGES:
                module = build_layer(node.type, node.params)
                self._place(node.name, module)
            self._steps.append((node.name, node.type, node.inputs))
            for name in node.inputs:
                last_read[name] = index
        self._output = spec.output
        self._release = [[name for name in dict.fromkeys(inputs) if last_read[name] == index and name != spec.output]
                         for index, (_, _, inputs) in enumerate(self._steps)]

    def _place(self, dotted: str, module: nn.Module) -> None:
        *path, leaf = dotted.split(".")
        holder: nn.Module = self
        for part in path:
            if part not in holder._modules:
                holder.add_module(part, nn.ModuleDict())
            holder = cast(nn.Module, holder._modules[part])
        holder.add_module(leaf, module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The output node's value for a batch `x`."""
        values: dict[str, torch.Tensor] = {"input": x}
        for (name, kind, inputs), release in zip(self._steps, self._release, strict=True):
            if kind == "add":
                out = values[inputs[0]]
                for other in inputs[1:]:
                    out = out + values[other]
            elif kind == "concat":
                out = torch.cat([values[i] for i in inputs], dim=1)
            else:
                out = self.get_submodule(name)(values[inputs[0]])  # looked up: a module swapped in is used
            for gone in release:
                del values[gone]
            values[name] = out
        return values[self._output]


def build_model(spec: ModelSpec, *, seed: int | None = None) -> nn.Module:
    """An nn.Sequential for a chain (state_dict names "0.weight", ...) or a GraphModel for a graph (names
    "b1.conv1.weight"): the names are the tensor names on the wire."""
    if seed is not None:
        torch.manual_seed(seed)
    if spec.is_graph:
        return GraphModel(spec)
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
