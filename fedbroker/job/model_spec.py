"""Model specs: a list of layers from an allow-list (never code), validated into frozen objects.

Validation infers every layer's output shape from the input shape, so a Linear whose `in_features` does not
match what the previous layer produces is refused at submission, naming the field, rather than crashing a
worker in round 1. All problems are reported at once. A job (fedbroker.job.spec) holds one.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.layers import LAYERS, Param, ShapeProblem, check_param
from fedbroker.layers.base import MAX_WIDTH as MAX_WIDTH

MAX_INPUT_RANK = 4  # (channels, depth, height, width): a 3-D volume
MAX_LAYERS = 128
MAX_PARAMETERS = 200_000_000
MAX_DEPTH = 32
MAX_SPEC_BYTES = 256 * 1024
_PLAIN_SCALARS = (str, int, float, bool, type(None))

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 80
_short.maxlist = _short.maxdict = _short.maxtuple = 6
_short.maxlevel = 3


def show(value: Any) -> str:
    """A bounded repr for error messages: a hostile value is never echoed back in full."""
    return _short.repr(value)

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
    """A model: its input shape and its layers, checked so that every layer takes its input."""

    input_shape: tuple[int, ...]
    layers: tuple[LayerSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        """The model as a job writes it."""
        return {"input_shape": list(self.input_shape), "layers": [layer.to_dict() for layer in self.layers]}

    def to_json(self) -> str:
        """The model's one wire form (sorted keys: equal models give equal text)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def num_outputs(self) -> int:
        """The number of class scores the model outputs."""
        return output_shapes(self)[-1][-1]


class Collector:
    """Every problem of a spec, gathered so that one submission names them all."""

    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def add(self, field_name: str, problem: str) -> None:
        """Note one problem at its full path."""
        self.errors.append(ConfigError(field_name, problem))

    def raise_if_any(self) -> None:
        """One ConfigError, several as ConfigErrors, or nothing."""
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigErrors(self.errors)


def is_int(value: Any) -> bool:
    """An int that is not a bool (True is an int to Python, never a width to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _check_param(errors: Collector, where: str, param: Param, value: Any) -> Any:
    value, problems = check_param(param, value, show)
    for suffix, problem in problems:
        errors.add(f"{where}{suffix}", problem)
    return value


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
    """Check a model given as a mapping; raise (or, with `errors`, collect) every problem, naming its field."""
    own = errors is None
    errors = errors or Collector()
    errors_before = len(errors.errors)
    if not isinstance(raw, Mapping):
        errors.add(where, f"must be a mapping with input_shape and layers, got {type(raw).__name__}")
        errors.raise_if_any()
    if own:
        check_plain(raw, where)
    unknown = sorted(set(raw) - {"input_shape", "layers"})
    for key in unknown:
        errors.add(f"{where}.{key}", "unknown field; known: input_shape, layers")
    shape = raw.get("input_shape")
    if not isinstance(shape, (list, tuple)) or not 1 <= len(shape) <= MAX_INPUT_RANK or not all(
        is_int(d) and 1 <= d <= MAX_WIDTH for d in shape
    ):
        errors.add(f"{where}.input_shape", f"must be a list of 1 to {MAX_INPUT_RANK} integers in [1, {MAX_WIDTH}], "
                                           f"got {show(shape)}")
        shape = None
    layers_raw = raw.get("layers")
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
            allowed = LAYERS[kind].params
            params: dict[str, Any] = {}
            check_whole = LAYERS[kind].check_params
            if check_whole is not None:  # a library architecture: its own typed, bounded parameters
                params, problems = check_whole({k: v for k, v in layer.items() if k != "type"})
                for key, problem in problems:
                    errors.add(f"{at}.{key}", problem)
                layers.append(LayerSpec(kind, params))
                continue
            for key in sorted(set(layer) - {"type"} - set(allowed)):
                errors.add(f"{at}.{key}", f"unknown parameter for {kind}; allowed: {', '.join(allowed) or 'none'}")
            for key, param in allowed.items():
                if key not in layer or (layer[key] is None and param.required):
                    if param.required:  # None stands for "the default" (a pool's stride), never for a value
                        errors.add(f"{at}.{key}", f"is required for {kind}")
                        continue
                    params[key] = param.default
                else:
                    params[key] = _check_param(errors, f"{at}.{key}", param, layer[key])
            layers.append(LayerSpec(kind, params))
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


def output_shapes(spec: ModelSpec) -> list[tuple[int, ...]]:
    """The output shape (without the batch axis) after every layer; raises ConfigError on a mismatch."""
    errors = Collector()
    shapes = _check_shapes(spec, errors, "model")
    errors.raise_if_any()
    return shapes


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
            errors.add(where, f"has more than {MAX_PARAMETERS} parameters")
            return shapes
    if shapes and len(shapes[-1]) != 1:
        errors.add(f"{where}.layers", f"the last layer must output class scores (a flat vector), not {list(shapes[-1])}")
    return shapes


def matched_layers(spec: ModelSpec) -> list[int]:
    """The indices of the layers whose units alignment matches (the weighted ones)."""
    return [i for i, layer in enumerate(spec.layers) if LAYERS[layer.type].weighted]


def parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The tensors an nn.Sequential built from `spec` holds, by state_dict name, without importing torch."""
    return {f"{i}.{suffix}": shape
            for i, layer in enumerate(spec.layers)
            for suffix, shape in LAYERS[layer.type].tensors(layer.params).items()}
