"""Model specs: a chain of layers (`layers`) or a graph of nodes (`nodes`, `blocks`: fedbroker.graph) from an
allow-list (never code), validated into frozen objects.

Validation infers every layer's output shape from the input shape, so a Linear whose `in_features` does not
match what the previous layer produces is refused at submission, naming the field, rather than crashing a
worker in round 1. All problems are reported at once. A job (fedbroker.job.spec) holds one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedbroker.errors import ConfigError
from fedbroker.graph.checks import MAX_WIDTH as MAX_WIDTH
from fedbroker.graph.checks import Collector as Collector
from fedbroker.graph.checks import is_int as is_int
from fedbroker.graph.checks import layer_params
from fedbroker.graph.checks import show as show
from fedbroker.graph.expand import GRAPH_KEYS, parse_graph
from fedbroker.graph.nodes import MAX_PARAMETERS as MAX_PARAMETERS
from fedbroker.graph.nodes import NodeSpec as NodeSpec
from fedbroker.graph.nodes import tree_order
from fedbroker.graph.shapes import Bounds, bounds, infer
from fedbroker.layers import LAYERS, ShapeProblem

MAX_INPUT_RANK = 4  # (channels, depth, height, width): a 3-D volume

PLAN_FIELDS = ("initial_weights", "from_job", "freeze", "adapters")  # parsed by fedbroker.weights.plan
MAX_LAYERS = 128
MAX_DEPTH = 32
MAX_SPEC_BYTES = 256 * 1024
_PLAIN_SCALARS = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class LayerSpec:
    """One layer of a model: its type from the allow-list and its checked parameters."""

    type: str
    params: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """The layer as a job writes it."""
        return {"type": self.type, **self.params}


@dataclass(frozen=True)
class ModelSpec:
    """A model: its input shape and its nodes, checked so that every node takes its inputs.

    A chain (`layers`) is the graph whose nodes are "0", "1", ..., each reading the one before (its
    nodes are derived from its layers); a graph (`model.nodes`) keeps `layers` empty and its text as
    written back (`graph`: blocks, nodes and output, every input explicit)."""

    input_shape: tuple[int, ...]
    layers: tuple[LayerSpec, ...]
    nodes: tuple[NodeSpec, ...] = ()
    output: str = ""
    graph: Mapping[str, Any] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.layers and not self.nodes:
            chain = tuple(NodeSpec(str(i), layer.type, layer.params, (str(i - 1) if i else "input",))
                          for i, layer in enumerate(self.layers))
            object.__setattr__(self, "nodes", chain)
            object.__setattr__(self, "output", chain[-1].name)

    @property
    def is_graph(self) -> bool:
        """Written as a graph (`model.nodes`), not as a chain of layers."""
        return self.graph is not None

    def to_dict(self) -> dict[str, Any]:
        """The model as a job writes it."""
        if self.graph is not None:
            return {"input_shape": list(self.input_shape), **self.graph}
        return {"input_shape": list(self.input_shape), "layers": [layer.to_dict() for layer in self.layers]}

    def to_json(self) -> str:
        """The model's one wire form (sorted keys: equal models give equal text)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def num_outputs(self) -> int:
        """The number of scores the model outputs per sample (per pixel: the output's first axis)."""
        return output_shapes(self)[-1][0]

    @property
    def output_shape(self) -> tuple[int, ...]:
        """The shape of one sample's output (without the batch axis)."""
        return output_shapes(self)[-1]


def check_plain(raw: Any, where: str) -> None:
    """Refuse, before anything else reads it, a value that is not plain JSON data (text keys; no dates,
    bytes or sets from YAML), nests deeper than MAX_DEPTH, or would encode to more than MAX_SPEC_BYTES.
    The walk is iterative and stops at the size limit, so a YAML alias bomb (a few KiB of text that expand
    to billions of nodes) costs at most MAX_SPEC_BYTES steps."""
    size = 0
    stack: list[tuple[Any, str, int]] = [(raw, where, 0)]
    while stack:
        value, at, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(at, f"nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, Mapping):
            size += 2
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ConfigError(f"{at}.{show(key)}", f"keys must be text, got {type(key).__name__}")
                size += len(key) + 4
                stack.append((item, f"{at}.{key}", depth + 1))
        elif isinstance(value, (list, tuple)):
            size += 2
            stack.extend((item, f"{at}[{i}]", depth + 1) for i, item in enumerate(value))
            size += len(value)
        elif isinstance(value, str):
            size += len(value) + 2
        elif isinstance(value, _PLAIN_SCALARS):
            size += 8
        else:
            raise ConfigError(at, f"must be plain data (text, number, boolean, list, mapping), got "
                                  f"{type(value).__name__} {show(value)}")
        if size > MAX_SPEC_BYTES:
            raise ConfigError(where, f"is larger than {MAX_SPEC_BYTES} bytes")


def parse_model(raw: Any, *, errors: Collector | None = None, where: str = "model") -> ModelSpec:
    """Check a model given as a mapping, a chain (`layers`) or a graph (`nodes`); raise (or, with `errors`,
    collect) every problem, naming its field."""
    own = errors is None
    errors = errors or Collector()
    errors_before = len(errors.errors)
    if not isinstance(raw, Mapping):
        errors.add(where, f"must be a mapping with input_shape and layers (or nodes), got {type(raw).__name__}")
        errors.raise_if_any()
    if own:
        check_plain(raw, where)
    graph = "nodes" in raw or "blocks" in raw
    known = GRAPH_KEYS if graph else ("input_shape", "layers")
    for key in sorted(set(raw) - set(known) - set(PLAN_FIELDS)):  # the plan: fedbroker.weights.plan
        hint = "; a model is a chain (layers) or a graph (nodes), not both" if key == "layers" else ""
        errors.add(f"{where}.{key}", f"unknown field; known: {', '.join(known)}{hint}")
    shape = raw.get("input_shape")
    if not isinstance(shape, (list, tuple)) or not 1 <= len(shape) <= MAX_INPUT_RANK or not all(
        is_int(d) and 1 <= d <= MAX_WIDTH for d in shape
    ):
        errors.add(f"{where}.input_shape", f"must be a list of 1 to {MAX_INPUT_RANK} integers in [1, {MAX_WIDTH}], "
                                           f"got {show(shape)}")
        shape = None
    if graph:
        return _parse_graph(raw, shape, errors, where, own=own, errors_before=errors_before)
    layers = _parse_layers(raw.get("layers"), errors, where)
    if own:
        errors.raise_if_any()
    if len(errors.errors) != errors_before:
        # A model with bad fields is reported as such; its half-parsed layers must never reach a later
        # check (shapes, alignment, a GA probe set), which would trip over them instead of naming them.
        return ModelSpec((), ())
    spec = ModelSpec(tuple(shape or ()), tuple(layers))
    _check_shapes(spec, errors, where)
    if own:
        errors.raise_if_any()
    return spec


def _parse_layers(layers_raw: Any, errors: Collector, where: str) -> list[LayerSpec]:
    layers: list[LayerSpec] = []
    if not isinstance(layers_raw, list) or not layers_raw:
        errors.add(f"{where}.layers", f"must be a non-empty list of layers, got {show(layers_raw)}")
    elif len(layers_raw) > MAX_LAYERS:
        errors.add(f"{where}.layers", f"has {len(layers_raw)} layers, more than the limit of {MAX_LAYERS}")
    else:
        for i, layer in enumerate(layers_raw):
            at = f"{where}.layers[{i}]"
            if not isinstance(layer, Mapping) or not isinstance(layer.get("type"), str):
                errors.add(f"{at}.type", f"each layer must be a mapping with a string 'type', got {show(layer)}")
                continue
            kind = layer["type"]
            if kind not in LAYERS:
                errors.add(f"{at}.type", f"unknown layer type {show(kind)}; allowed: {', '.join(sorted(LAYERS))}")
                continue
            if LAYERS[kind].first_only and i:
                errors.add(f"{at}.type", f"{kind} must be the first layer: it describes the model's input")
            layers.append(LayerSpec(kind, layer_params(errors, at, kind, layer)))
    return layers


def _parse_graph(raw: Mapping[str, Any], shape: Any, errors: Collector, where: str, *, own: bool,
                 errors_before: int) -> ModelSpec:
    graph = parse_graph(raw, errors=errors, where=where)
    if graph is None or shape is None:
        if own:
            errors.raise_if_any()
        return ModelSpec((), ())
    spec = ModelSpec(tuple(shape), (), graph.nodes, graph.output, graph.written)
    infer(spec.nodes, spec.input_shape, errors, where)  # what the output must be is the job task's rule, not the graph's
    if own:
        errors.raise_if_any()
    return spec if len(errors.errors) == errors_before else ModelSpec((), ())


def output_shapes(spec: ModelSpec) -> list[tuple[int, ...]]:
    """The output shape (without the batch axis) after every node, in `spec.nodes`' order (the output node's
    last); raises ConfigError on a mismatch."""
    errors = Collector()
    if spec.is_graph:
        found = infer(spec.nodes, spec.input_shape, errors, "model")
        errors.raise_if_any()
        return [found[node.name] for node in spec.nodes]
    shapes = _check_shapes(spec, errors, "model")
    errors.raise_if_any()
    return shapes


def model_bounds(spec: ModelSpec) -> Bounds:
    """Parameters, activation bytes and FLOPs per sample (fedbroker.graph.shapes), for a chain or a graph."""
    found = dict(zip((node.name for node in spec.nodes), output_shapes(spec), strict=True))
    found["input"] = tuple(spec.input_shape)
    return bounds(spec.nodes, found)


def _check_shapes(spec: ModelSpec, errors: Collector, where: str) -> list[tuple[int, ...]]:
    """Every layer's output shape, from the input shape. A layer whose only fault is its input width is named and
    then taken at its word (`LayerType.declared_input`), so every wrong layer is named; any other fault stops the
    walk (later problems would only echo it), as does a model of more than MAX_PARAMETERS."""
    shape = tuple(spec.input_shape)
    shapes: list[tuple[int, ...]] = []
    params_total = 0
    for i, layer in enumerate(spec.layers):
        layer_type = LAYERS[layer.type]
        out = layer_type.output_shape(layer.params, shape)
        if isinstance(out, ShapeProblem):
            errors.add(f"{where}.layers[{i}]" + (f".{out.param}" if out.param else ""), out.problem)
            declared = layer_type.declared_input(layer.params, shape, out)
            out = layer_type.output_shape(layer.params, declared) if declared else out
            if isinstance(out, ShapeProblem):
                return shapes
        shape = out
        params_total += layer_type.parameter_count(layer.params)
        shapes.append(shape)
        if params_total > MAX_PARAMETERS:
            errors.add(f"{where}.layers[{i}]", f"{layer.type} brings the model to {params_total} parameters, more "
                                               f"than {MAX_PARAMETERS} parameters allowed")
            return shapes
    return shapes  # what the output must be is the task's rule (fedbroker.job.task.output_problems)


def matched_layers(spec: ModelSpec) -> list[int]:  # a chain's; a graph has no layers
    """The indices of the layers whose units alignment matches (the weighted ones)."""
    return [i for i, layer in enumerate(spec.layers) if LAYERS[layer.type].weighted]


def parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The tensors the torch model built from `spec` holds, by state_dict name (`<node>.<tensor>`, the
    chain's "0.weight"), in its state_dict's order, without importing torch."""
    by_name = {node.name: node for node in spec.nodes}
    return {f"{name}.{suffix}": shape
            for name in tree_order([node.name for node in spec.nodes]) if by_name[name].type in LAYERS
            for suffix, shape in LAYERS[by_name[name].type].tensors(by_name[name].params).items()}
