"""Between the wire format (an nn.Sequential state dict named by its spec) and the alignment algorithms'
list of Layers; and back, with the spec's widths updated when matching grows a layer. Which layers are
matched (`fedbroker.job.spec.matched_layers`), and which parameters hold their widths, is read from the table
in fedbroker.layers."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedbroker.aggregators.alignment import Layer
from fedbroker.job.spec import LayerSpec, ModelSpec, matched_layers, parse_model
from fedbroker.layers import LAYERS


def to_layers(spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> list[Layer]:
    """The matched layers of a state dict, as float64 Layers in model order."""
    return [
        Layer(np.asarray(tensors[f"{i}.weight"], dtype=np.float64),
              np.asarray(tensors[f"{i}.bias"], dtype=np.float64) if f"{i}.bias" in tensors else None)
        for i in matched_layers(spec)
    ]


def from_layers(spec: ModelSpec, layers: list[Layer]) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """The spec with every matched layer resized to the aligned layers, and its float32 state dict."""
    indices = matched_layers(spec)
    if len(indices) != len(layers):
        raise ValueError(f"alignment returned {len(layers)} layers for a model with {len(indices)}")
    new_layers = list(spec.layers)
    for i, layer in zip(indices, layers):  # input widths come from the aligned weights themselves
        layer_type = LAYERS[spec.layers[i].type]
        params = dict(spec.layers[i].params)
        params[layer_type.out_width] = int(layer.weight.shape[0])
        params[layer_type.in_width] = int(layer.weight.shape[1])
        new_layers[i] = LayerSpec(spec.layers[i].type, params)
    new_spec = parse_model(ModelSpec(spec.input_shape, tuple(new_layers)).to_dict())
    tensors: dict[str, np.ndarray] = {}
    for i, layer in zip(indices, layers):
        tensors[f"{i}.weight"] = layer.weight.astype(np.float32)
        if layer.bias is not None:
            tensors[f"{i}.bias"] = layer.bias.astype(np.float32)
    return new_spec, tensors
