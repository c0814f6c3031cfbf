"""Between the wire format (a state dict named by the model's nodes) and the alignment algorithms' list of
Layers; and back, with the spec's widths updated when matching grows a layer. Which layers are matched, and
which per-channel norms travel with their units, is the model's alignment plan
(`fedbroker.job.alignment_plan`, read off the layer table's traits); which parameters hold a layer's widths is
the table's (`fedbroker.layers`)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedbroker.aggregators.alignment import Layer
from fedbroker.job.alignment_plan import MatchedLayer, alignment_plan
from fedbroker.job.spec import LayerSpec, ModelSpec, parse_model
from fedbroker.layers import LAYERS


def to_layers(spec: ModelSpec, tensors: Mapping[str, np.ndarray]) -> list[Layer]:
    """The matched layers of a state dict, as float64 Layers in model order, each with its attached norms'
    per-channel tensors."""
    def f64(name: str) -> np.ndarray:
        return np.asarray(tensors[name], dtype=np.float64)

    return [Layer(f64(layer.weight_name),
                  f64(layer.bias_name) if layer.bias_name is not None and layer.bias_name in tensors else None,
                  {name: f64(name) for name in layer.channel_tensors()})
            for layer in alignment_plan(spec).layers]


def from_layers(spec: ModelSpec, layers: list[Layer]) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """The spec with every matched layer (and its attached norms) resized to the aligned layers, and the
    float32 state dict of everything the plan moves."""
    plan = alignment_plan(spec)
    if len(plan.layers) != len(layers):
        raise ValueError(f"alignment returned {len(layers)} layers for a model with {len(plan.layers)}")
    tensors: dict[str, np.ndarray] = {}
    for matched, layer in zip(plan.layers, layers):
        tensors[matched.weight_name] = layer.weight.astype(np.float32)
        if matched.bias_name is not None and layer.bias is not None:
            tensors[matched.bias_name] = layer.bias.astype(np.float32)
        for name in matched.channel_tensors():
            tensors[name] = np.asarray(layer.channels[name], dtype=np.float32)
    if all(tuple(tensors[m.weight_name].shape) == _declared(m.type, m.params) for m in plan.layers):
        return spec, tensors  # no width changed (FedDNA, or a match that kept every width)
    return _resized(spec, plan.layers, layers), tensors


def _declared(layer_type: str, params: Mapping[str, object]) -> tuple[int, ...]:
    return LAYERS[layer_type].tensors(params)["weight"]


def _resized(spec: ModelSpec, matched: tuple[MatchedLayer, ...], layers: list[Layer]) -> ModelSpec:
    """The chain form with each matched layer's widths (and its norms' channels) from the aligned weights."""
    if not spec.layers:
        raise ValueError("a graph model's widths cannot change under alignment; use equal widths "
                         "(max_global_width at the layers' width)")
    new_layers = list(spec.layers)
    for m, layer in zip(matched, layers):
        i = int(m.node)
        layer_type = LAYERS[spec.layers[i].type]
        params = dict(spec.layers[i].params)
        params[layer_type.out_width] = int(layer.weight.shape[0])
        params[layer_type.in_width] = int(layer.weight.shape[1])  # input widths come from the aligned weights
        new_layers[i] = LayerSpec(spec.layers[i].type, params)
        for norm in m.norms:  # a per-channel norm: one group per channel, as many as the layer's units
            j = int(norm.node)
            norm_params = dict(spec.layers[j].params)
            width = int(layer.weight.shape[0])
            norm_params.update({key: width for key in ("num_channels", "num_groups", "num_features")
                                if key in norm_params})
            new_layers[j] = LayerSpec(spec.layers[j].type, norm_params)
    return parse_model(ModelSpec(spec.input_shape, tuple(new_layers)).to_dict())
