"""Between the wire format (an nn.Sequential state dict named by its spec) and the alignment algorithms'
list of Layers; and back, with the spec's widths updated when matching grows a layer."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedbroker.aggregators.alignment import Layer
from fedbroker.spec import LayerSpec, ModelSpec, parse_model

WEIGHTED = ("Linear", "Conv2d")


def alignment_problems(spec: ModelSpec) -> list[str]:
    """Why neurons of this model cannot be matched across clients (empty when they can)."""
    problems = []
    for i, layer in enumerate(spec.layers):
        if layer.type == "GroupNorm":
            problems.append(f"layer {i} is GroupNorm: permuting channels across its groups would change the "
                            f"function; use alignment 'none' or drop the GroupNorm")
    if sum(layer.type in WEIGHTED for layer in spec.layers) < 2:
        problems.append("the model needs at least one hidden Linear/Conv2d layer to align")
    return problems


def to_layers(spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> list[Layer]:
    return [
        Layer(np.asarray(tensors[f"{i}.weight"], dtype=np.float64),
              np.asarray(tensors[f"{i}.bias"], dtype=np.float64) if f"{i}.bias" in tensors else None)
        for i, layer in enumerate(spec.layers) if layer.type in WEIGHTED
    ]


def from_layers(spec: ModelSpec, layers: list[Layer]) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """The spec with every Linear/Conv2d resized to the aligned layers, and its float32 state dict."""
    indices = [i for i, layer in enumerate(spec.layers) if layer.type in WEIGHTED]
    if len(indices) != len(layers):
        raise ValueError(f"alignment returned {len(layers)} layers for a model with {len(indices)}")
    new_layers = list(spec.layers)
    for i, layer in zip(indices, layers):  # input widths come from the aligned weights themselves
        params = dict(spec.layers[i].params)
        out = int(layer.weight.shape[0])
        if spec.layers[i].type == "Linear":
            params["out_features"] = out
            params["in_features"] = int(layer.weight.shape[1])
        else:
            params["out_channels"] = out
            params["in_channels"] = int(layer.weight.shape[1])
        new_layers[i] = LayerSpec(spec.layers[i].type, params)
    new_spec = parse_model(ModelSpec(spec.input_shape, tuple(new_layers)).to_dict())
    tensors: dict[str, np.ndarray] = {}
    for i, layer in zip(indices, layers):
        tensors[f"{i}.weight"] = layer.weight.astype(np.float32)
        if layer.bias is not None:
            tensors[f"{i}.bias"] = layer.bias.astype(np.float32)
    return new_spec, tensors
