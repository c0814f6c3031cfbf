"""Shapes through a graph's nodes, and what the graph costs per sample (its bounds).

Every node's output shape is inferred from its inputs' by the layer table (merges here); a node that
cannot take its input is named with its path, and a node whose shape explodes (or a graph whose
activations or parameters pass the limits) stops the walk there, so a hostile graph costs one pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fedbroker.graph.checks import Collector
from fedbroker.graph.nodes import MAX_ACTIVATION_ELEMENTS, MAX_PARAMETERS, MAX_SHAPE_ELEMENTS, MERGES, NodeSpec
from fedbroker.layers import LAYERS, ShapeProblem

Shape = tuple[int, ...]
FLOAT32_BYTES = 4


def fmt(shape: Sequence[int]) -> str:
    """A shape as people write it: 64×32×32."""
    return "×".join(str(d) for d in shape)


def _merge(node: NodeSpec, shapes: Sequence[Shape], errors: Collector, at: str) -> Shape | None:
    first = shapes[0]
    ok = True
    for i, shape in enumerate(shapes[1:], start=1):
        if node.type == "add" and shape != first:
            errors.add(f"{at}.inputs[{i}]", f"{fmt(shape)} cannot add to {fmt(first)} (add needs inputs of one shape)")
            ok = False
        elif node.type == "concat" and (len(shape) != len(first) or shape[1:] != first[1:]):
            errors.add(f"{at}.inputs[{i}]", f"{fmt(shape)} cannot concat with {fmt(first)} (concat joins channels, "
                                            f"axis 0; every other axis must match)")
            ok = False
    if not ok:
        return None
    if node.type == "add":
        return first
    return (sum(s[0] for s in shapes), *first[1:])


def infer(nodes: Sequence[NodeSpec], input_shape: Shape, errors: Collector, where: str) -> dict[str, Shape]:
    """Each node's output shape by name ("input" too). A node that cannot take its inputs is named (and, when
    only its declared input width is wrong, taken at its word so later nodes are checked too); nodes after
    one without a shape are skipped silently (they would only echo it). The instances of one block share
    their fixed parameters' mapping, so a layer's shape and size are computed once per (parameters, input)."""
    shapes: dict[str, Shape] = {"input": tuple(input_shape)}
    activations = math.prod(input_shape)
    parameters = 0
    known: dict[tuple[int, str, Shape], tuple[Shape | None, int]] = {}
    for node in nodes:
        inputs = node.inputs
        if len(inputs) == 1 and node.type not in MERGES:
            given = shapes.get(inputs[0])
            if given is None:
                continue
            key = (id(node.params), node.type, given)
            found = known.get(key)
            if found is None:
                found = _layer(node, given, errors, f"{where}.nodes.{node.name}")
                known[key] = found  # an identical node's identical problem is named once
            out, size = found
            parameters += size
        else:
            ins = [shapes.get(name) for name in inputs]
            if any(shape is None for shape in ins):
                continue
            out = _merge(node, [s for s in ins if s is not None], errors, f"{where}.nodes.{node.name}")
        if out is None:
            continue
        elements = math.prod(out)
        activations += elements
        if elements > MAX_SHAPE_ELEMENTS or activations > MAX_ACTIVATION_ELEMENTS or parameters > MAX_PARAMETERS:
            _over(errors, f"{where}.nodes.{node.name}", out, elements, activations, parameters)
            return shapes
        shapes[node.name] = out
    return shapes


def _layer(node: NodeSpec, given: Shape, errors: Collector, at: str) -> tuple[Shape | None, int]:
    layer = LAYERS[node.type]
    result = layer.output_shape(node.params, given)
    if isinstance(result, ShapeProblem):
        errors.add(at + (f".{result.param}" if result.param else ""), result.problem)
        declared = layer.declared_input(node.params, given, result)
        result = layer.output_shape(node.params, declared) if declared else result
    out = None if isinstance(result, ShapeProblem) else result
    return out, layer.parameter_count(node.params)


def _over(errors: Collector, at: str, out: Shape, elements: int, activations: int, parameters: int) -> None:
    if elements > MAX_SHAPE_ELEMENTS:
        errors.add(at, f"outputs {fmt(out)} = {elements} values per sample, above the limit of "
                       f"{MAX_SHAPE_ELEMENTS} for one node")
    elif activations > MAX_ACTIVATION_ELEMENTS:
        errors.add(at, f"brings the nodes' outputs to more than {MAX_ACTIVATION_ELEMENTS} values per sample "
                       f"(the limit for all nodes together)")
    else:
        errors.add(at, f"brings the model to more than {MAX_PARAMETERS} parameters")


@dataclass(frozen=True)
class Bounds:
    """What one sample costs the model, from its spec alone: a site compares these to its own limits."""

    parameters: int
    activation_bytes: int   # float32 bytes of the input and of every node's output, for one sample
    flops: int              # forward pass, one sample (the rule in `node_flops`)

    def describe(self) -> str:
        """One line for the job's view."""
        return (f"{self.parameters:,} parameters; per sample {_scaled(self.activation_bytes, 1024, 'B', 'i')} of "
                f"activations and {_scaled(self.flops, 1000, ' FLOPs', '')}")


def _scaled(value: int, base: int, unit: str, infix: str) -> str:
    """1536 → "1.5 KiB" (binary) or 155130000 → "155.1 M FLOPs": three significant figures at most."""
    size, prefix = float(value), ""
    for step in ("k" if base == 1000 else "K", "M", "G", "T", "P"):
        if size < base:
            break
        size, prefix = size / base, step + infix
    return f"{value:,} {unit.strip()}" if not prefix else f"{size:.3g} {prefix}{unit.strip() if unit.startswith(' ') else unit}"


def node_flops(node: NodeSpec, out: Shape, source: Shape | None = None) -> int:
    """A node's forward FLOPs for one sample: a node with weights costs 2 × its weights' elements × its
    output's positions (every axis after the channel axis) — a multiply and an add per weight per position,
    exact for Linear and Conv; every node adds one per output value (bias, activation, normalisation,
    merge), a pool kernel_size² per output value. A layer type with its own count (a library network, whose
    weights act at many resolutions) gives it from its input shape `source`."""
    own = LAYERS[node.type].flops if node.type in LAYERS else None
    if own is not None and source is not None:
        return own(node.params, source)
    elements = math.prod(out)
    if node.type in ("add", "concat"):
        return elements
    tensors = LAYERS[node.type].tensors(node.params)
    weights = sum(math.prod(shape) for name, shape in tensors.items() if name.startswith("weight"))
    positions = math.prod(out[1:]) if len(out) > 1 else 1
    per_value = node.params["kernel_size"] ** 2 if not tensors and node.params.get("kernel_size") else 1
    return 2 * weights * positions + per_value * elements


def bounds(nodes: Sequence[NodeSpec], shapes: Mapping[str, Shape]) -> Bounds:
    """The bounds of a graph whose shapes `infer` found in full."""
    parameters = sum(LAYERS[n.type].parameter_count(n.params) for n in nodes if n.type in LAYERS)
    activations = math.prod(shapes["input"]) + sum(math.prod(shapes[n.name]) for n in nodes)
    flops = sum(node_flops(n, shapes[n.name], shapes[n.inputs[0]] if n.inputs else None) for n in nodes)
    return Bounds(parameters, FLOAT32_BYTES * activations, flops)
