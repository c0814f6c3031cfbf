"""The allowed layer types, in one table: adding a layer type means adding one entry to LAYERS.

Each entry says what the rest of the project needs to know about a type: its parameters, the shape it
outputs for a given input (or why it cannot take that input), its parameter tensors by state_dict
suffix, which `torch.nn` class builds it, and how neuron alignment treats it. Spec validation
(`fedbroker.job.spec`), the torch builder (`fedbroker.model`) and alignment (`fedbroker.job.submission`,
`fedbroker.aggregators.layer_conversion`) all read this table. No torch here: the coordinator and the
aggregator validate models without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Shape = tuple[int, ...]
# A layer's parameters after validation: each value already checked against its Param's kind.
Params = Mapping[str, Any]
# "width": [1, MAX_WIDTH]; "kernel": [1, 64] or None; "int0": [0, 64]; "bool"; "prob": [0, 1);
# "values": one finite number or a list of them (per input feature); "positive_values": the same, each > 0
ParamKind = Literal["width", "kernel", "int0", "bool", "prob", "values", "positive_values"]


@dataclass(frozen=True)
class Param:
    """One parameter of a layer type: its kind sets the range a job's value is checked against."""

    kind: ParamKind
    required: bool = False
    default: int | float | bool | None = None


@dataclass(frozen=True)
class ShapeProblem:
    """Why a layer cannot take its input; `param` names the parameter at fault ("" for the layer itself)."""

    param: str
    problem: str


def _no_tensors(_: Params) -> dict[str, Shape]:
    return {}


def _same_shape(_: Params, shape: Shape) -> Shape | ShapeProblem:
    return shape


@dataclass(frozen=True)
class LayerType:
    """One allowed layer type. torch builds it as `torch.nn.<torch_class>(**params)`: every parameter is
    a keyword argument of that class, under the same name."""

    torch_class: str
    params: Mapping[str, Param] = field(default_factory=dict)
    output_shape: Callable[[Params, Shape], Shape | ShapeProblem] = _same_shape
    # parameter tensors by state_dict suffix ("weight", "bias"), the layer's index being the prefix
    tensors: Callable[[Params], dict[str, Shape]] = _no_tensors
    # for a layer whose units alignment matches (a weight of shape (out, in, ...)): the parameters holding
    # its output and input widths; "" for a layer alignment passes over
    out_width: str = ""
    in_width: str = ""
    # why alignment cannot permute units through this layer ("" when it can)
    blocks_alignment: str = ""
    # the layer describes the model's input, so it may only be the first layer
    first_only: bool = False
    # the parameter that must equal the width (features, channels) of the input's first axis ("" for none)
    takes_width: str = ""
    # a layer type whose parameters are checked as a whole, by their own rules, instead of `params` (a library
    # architecture, fedbroker.layers.library): raw parameters -> (kept parameters, [(parameter, problem)])
    check_params: Callable[[Mapping[str, Any]], tuple[dict[str, Any], list[tuple[str, str]]]] | None = None

    @property
    def weighted(self) -> bool:
        """Alignment matches this layer's units (its weight's rows) across clients."""
        return bool(self.out_width)

    def declared_input(self, params: Params, shape: Shape, problem: ShapeProblem) -> Shape | None:
        """The input the layer says it takes, when `problem` is only that the input's width (or, for a flat
        layer, its rank) differs from its `takes_width` parameter: validation goes on from the layer's own
        word, so a second wrong layer is named too and one wrong width is not echoed by every later layer.
        None for any other problem."""
        if not self.takes_width or problem.param not in ("", self.takes_width):
            return None
        width = params[self.takes_width]
        return (width, *shape[1:]) if problem.param else (width,)

    def parameter_count(self, params: Params) -> int:
        """Weights of one such layer, to bound a model's size before anything is built."""
        return sum(math.prod(shape) for shape in self.tensors(params).values())


# ----- Linear -----------------------------------------------------------------------------------------

def _linear_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    if len(shape) != 1:
        return ShapeProblem("", f"Linear needs a flat input but receives shape {list(shape)}; add a Flatten before it")
    if p["in_features"] != shape[0]:
        return ShapeProblem("in_features", f"is {p['in_features']} but the previous layer outputs {shape[0]}")
    return (p["out_features"],)


def _linear_tensors(p: Params) -> dict[str, Shape]:
    tensors: dict[str, Shape] = {"weight": (p["out_features"], p["in_features"])}
    if p["bias"]:
        tensors["bias"] = (p["out_features"],)
    return tensors


# ----- Conv2d -----------------------------------------------------------------------------------------

def _conv_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    if len(shape) != 3:
        return ShapeProblem("", f"Conv2d needs a (channels, height, width) input but receives {list(shape)}")
    if p["in_channels"] != shape[0]:
        return ShapeProblem("in_channels", f"is {p['in_channels']} but the input has {shape[0]} channels")
    k, s, pad = p["kernel_size"], p["stride"], p["padding"]
    h, w = (shape[1] + 2 * pad - k) // s + 1, (shape[2] + 2 * pad - k) // s + 1
    if h < 1 or w < 1:
        return ShapeProblem("kernel_size", f"{k} is larger than the padded input {list(shape[1:])}")
    return (p["out_channels"], h, w)


def _conv_tensors(p: Params) -> dict[str, Shape]:
    k = p["kernel_size"]
    tensors: dict[str, Shape] = {"weight": (p["out_channels"], p["in_channels"], k, k)}
    if p["bias"]:
        tensors["bias"] = (p["out_channels"],)
    return tensors


# ----- pooling, Flatten, GroupNorm --------------------------------------------------------------------

def _pool_output(name: str) -> Callable[[Params, Shape], Shape | ShapeProblem]:
    def output(p: Params, shape: Shape) -> Shape | ShapeProblem:
        if len(shape) != 3:
            return ShapeProblem("", f"{name} needs a (channels, height, width) input but receives {list(shape)}")
        k = p["kernel_size"]
        s = p["stride"] or k  # torch's default stride is the kernel size
        h, w = (shape[1] - k) // s + 1, (shape[2] - k) // s + 1
        if h < 1 or w < 1:
            return ShapeProblem("kernel_size", f"{k} is larger than the input {list(shape[1:])}")
        return (shape[0], h, w)

    return output


def _flatten_output(_: Params, shape: Shape) -> Shape | ShapeProblem:
    return (math.prod(shape),)


def _group_norm_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    if p["num_channels"] != shape[0]:
        return ShapeProblem("num_channels", f"is {p['num_channels']} but the input has {shape[0]} channels")
    if p["num_channels"] % p["num_groups"]:
        return ShapeProblem("num_groups", f"{p['num_groups']} does not divide num_channels {p['num_channels']}")
    return shape


def _group_norm_tensors(p: Params) -> dict[str, Shape]:
    return {"weight": (p["num_channels"],), "bias": (p["num_channels"],)}


# ----- standardize -----------------------------------------------------------------------------------

FLOAT32_MAX = 3.4e38          # a standardize layer's mean and std are float32 buffers: finite there, std not 0
FLOAT32_TINY = 1.2e-38


def check_values(value: Any, *, positive: bool, show: Callable[[Any], str] = repr) -> tuple[Any, list[tuple[str, str]]]:
    """A "values" parameter (a standardize layer's mean or std): one number or a non-empty list of them, each
    finite in float32 (and > 0 with `positive`). The value as kept (a float, or a tuple of floats) and its
    first problem, as (path suffix such as "[3]", problem); `show` bounds what an error echoes."""
    limit = "a number > 0" if positive else "a number"
    is_list = isinstance(value, (list, tuple))
    if is_list and not value:
        return value, [("", f"must be {limit} or a non-empty list of them, got an empty list")]
    for i, v in enumerate(value if is_list else [value]):
        at = f"[{i}]" if is_list else ""
        # (an int is finite, and compares with a float exactly: math.isfinite would overflow on a huge one)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or (isinstance(v, float) and not math.isfinite(v)):
            return value, [(at, f"must be {limit} (finite), got {show(v)}")]
        if abs(v) > FLOAT32_MAX or (positive and not v >= FLOAT32_TINY):
            span = f"[{FLOAT32_TINY:g}, {FLOAT32_MAX:g}]" if positive else f"[{-FLOAT32_MAX:g}, {FLOAT32_MAX:g}]"
            return value, [(at, f"must be {limit} within float32's range {span}, got {show(v)}")]
    return (tuple(float(v) for v in value) if is_list else float(value)), []


def _standardize_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    features = math.prod(shape)
    for name in ("mean", "std"):
        value = p[name]
        if isinstance(value, (list, tuple)) and len(value) != features:
            return ShapeProblem(name, f"has {len(value)} values but the model's input has {features} features "
                                      f"(input_shape {list(shape)} flattened): give one value per feature, or one "
                                      f"number for all")
    return shape


_POOL_PARAMS = {"kernel_size": Param("kernel", required=True), "stride": Param("kernel", default=None)}

LAYERS: Mapping[str, LayerType] = {
    "Linear": LayerType(
        "Linear",
        {"in_features": Param("width", required=True), "out_features": Param("width", required=True),
         "bias": Param("bool", default=True)},
        _linear_output, _linear_tensors, out_width="out_features", in_width="in_features", takes_width="in_features",
    ),
    "Conv2d": LayerType(
        "Conv2d",
        {"in_channels": Param("width", required=True), "out_channels": Param("width", required=True),
         "kernel_size": Param("kernel", required=True), "stride": Param("kernel", default=1),
         "padding": Param("int0", default=0), "bias": Param("bool", default=True)},
        _conv_output, _conv_tensors, out_width="out_channels", in_width="in_channels", takes_width="in_channels",
    ),
    "MaxPool2d": LayerType("MaxPool2d", _POOL_PARAMS, _pool_output("MaxPool2d")),
    "AvgPool2d": LayerType("AvgPool2d", _POOL_PARAMS, _pool_output("AvgPool2d")),
    "Flatten": LayerType("Flatten", output_shape=_flatten_output),
    "ReLU": LayerType("ReLU"),
    "Tanh": LayerType("Tanh"),
    "Sigmoid": LayerType("Sigmoid"),
    "Dropout": LayerType("Dropout", {"p": Param("prob", default=0.5)}),
    "GroupNorm": LayerType(
        "GroupNorm",
        {"num_groups": Param("width", required=True), "num_channels": Param("width", required=True)},
        _group_norm_output, _group_norm_tensors,
        blocks_alignment="permuting channels across its groups would change the function", takes_width="num_channels",
    ),
    # (x - mean) / std on the model's input, with mean and std carried in the spec (no weights): the
    # preprocessing travels with the model (fedbroker.model.Standardize). Alignment passes over it: it never
    # permutes the model's inputs.
    "standardize": LayerType(
        "Standardize",
        {"mean": Param("values", required=True), "std": Param("positive_values", required=True)},
        _standardize_output, first_only=True,
    ),
}

from fedbroker.layers.library import layer_types  # noqa: E402  (the library wing builds LayerTypes: after them)

LAYERS = {**LAYERS, **layer_types()}
