"""Build a torch model from a validated ModelSpec, and move its weights to and from numpy."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from fedbroker.spec import ModelSpec


def build_model(spec: ModelSpec, *, seed: int | None = None) -> nn.Sequential:
    """An nn.Sequential whose state_dict names ("0.weight", ...) are the tensor names on the wire."""
    if seed is not None:
        torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for layer in spec.layers:
        p = dict(layer.params)
        if layer.type == "Linear":
            layers.append(nn.Linear(p["in_features"], p["out_features"], bias=p["bias"]))
        elif layer.type == "Conv2d":
            layers.append(
                nn.Conv2d(p["in_channels"], p["out_channels"], p["kernel_size"], stride=p["stride"],
                          padding=p["padding"], bias=p["bias"])
            )
        elif layer.type == "MaxPool2d":
            layers.append(nn.MaxPool2d(p["kernel_size"], stride=p["stride"]))
        elif layer.type == "AvgPool2d":
            layers.append(nn.AvgPool2d(p["kernel_size"], stride=p["stride"]))
        elif layer.type == "Flatten":
            layers.append(nn.Flatten())
        elif layer.type == "ReLU":
            layers.append(nn.ReLU())
        elif layer.type == "Tanh":
            layers.append(nn.Tanh())
        elif layer.type == "Sigmoid":
            layers.append(nn.Sigmoid())
        elif layer.type == "Dropout":
            layers.append(nn.Dropout(p["p"]))
        elif layer.type == "GroupNorm":
            layers.append(nn.GroupNorm(p["num_groups"], p["num_channels"]))
        else:  # parse_model refuses unknown types; reaching here means the allow-list and builder disagree
            raise ValueError(f"no builder for layer type {layer.type!r}")
    return nn.Sequential(*layers)


def state_to_numpy(model: nn.Module) -> dict[str, np.ndarray]:
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
    return state_to_numpy(build_model(spec, seed=seed))
