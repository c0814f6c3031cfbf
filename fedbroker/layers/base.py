"""What one entry of the layer table says, and the checks of its parameters' values. No torch here: the
coordinator and the aggregator validate models without it."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

Shape = tuple[int, ...]
# A layer's parameters after validation: each value already checked against its Param's kind.
Params = Mapping[str, Any]
# "width": [1, MAX_WIDTH]; "kernel": [1, 64] or None; "int0": [0, 64]; "bool"; "prob": [0, 1);
# "values": one finite number or a list of them (per input feature); "positive_values": the same, each > 0;
# "int": an integer in [Param.low, Param.high]; "number": a finite number in [Param.low, Param.high];
# "choice": one of Param.choices (text)
ParamKind = Literal["width", "kernel", "int0", "bool", "prob", "values", "positive_values", "int", "number",
                    "choice"]
MAX_WIDTH = 65_536


@dataclass(frozen=True)
class Param:
    """One parameter of a layer type: its kind sets the range a job's value is checked against."""

    kind: ParamKind
    required: bool = False
    default: int | float | bool | str | None = None
    low: float = 0      # "int" and "number": the closed range
    high: float = 0
    choices: tuple[str, ...] = ()  # "choice": the allowed words


# How neuron alignment treats a layer (`AlignTrait`, fedbroker.job.alignment_plan walks the model with it):
# "matched" — its units (weight rows) are matched across clients, and it reads its input in blocks of the previous
# matched layer's units; "elementwise" — it maps unit i of its input to unit i of its output, so any permutation of
# the units passes through it (activations, dropout, pools, Upsample, Flatten, which keeps a channel's values
# together); "per_channel" — each of its tensors holds one value per channel and the function commutes with a
# permutation of the channels (a GroupNorm with one group, or one channel per group): its tensors travel with the
# preceding matched layer's units; "input" — it acts on the model's input, which alignment never permutes;
# "blocks" — alignment cannot permute units through it, for the trait's reason.
AlignKind = Literal["matched", "elementwise", "per_channel", "input", "blocks"]


@dataclass(frozen=True)
class AlignTrait:
    """What neuron alignment may do through one layer (its kind), and, for "blocks", why it cannot."""

    kind: AlignKind
    reason: str = ""


def align_trait(kind: AlignKind, reason: str = "") -> Callable[[Params], AlignTrait]:
    """A trait that does not depend on the layer's parameters."""
    trait = AlignTrait(kind, reason)
    return lambda _: trait


ELEMENTWISE = align_trait("elementwise")


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
    """One allowed layer type. By default torch builds it as `torch.nn.<torch_class>(**params)` (every parameter
    a keyword argument of that class, under the same name); `fedbroker.layers.modules.BUILDERS` builds the others."""

    torch_class: str
    params: Mapping[str, Param] = field(default_factory=dict)
    output_shape: Callable[[Params, Shape], Shape | ShapeProblem] = _same_shape
    # parameter tensors by state_dict suffix ("weight", "bias", "self_attn.qlinear.weight"), the layer's name
    # being the prefix: exactly what the built torch module's state_dict holds
    tensors: Callable[[Params], dict[str, Shape]] = _no_tensors
    # for a layer whose units alignment matches (a weight of shape (out, in, ...)): the parameters holding
    # its output and input widths; "" for a layer alignment passes over
    out_width: str = ""
    in_width: str = ""
    # why alignment cannot permute units through this layer ("" when it can)
    blocks_alignment: str = ""
    # how alignment treats the layer, given its parameters (AlignKind); None: `alignment` derives it
    align: Callable[[Params], AlignTrait] | None = None
    # the layer describes the model's input, so it may only be the first layer
    first_only: bool = False
    # the parameter that must equal the width (features, channels) of the input's `width_axis` ("" for none)
    takes_width: str = ""
    width_axis: int = 0
    # a spelling that trains as another type (BatchNorm2d trains as GroupNorm): that type's name, and the
    # text the job's view shows for one such layer; alignment may fold such a layer (`folds_at_alignment`)
    trains_as: str = ""
    substitution: Callable[[Params], str] | None = None
    folds_at_alignment: bool = False
    # how DP training clips this layer's per-sample gradients (the docs' table; the worker decides for real):
    # "none" (no weights), "bk" (our one-pass clipping), "opacus" (Opacus's grad samplers inside bk's pass)
    dp: Literal["none", "bk", "opacus"] = "none"
    # a layer type whose parameters are checked as a whole, by their own rules, instead of `params` (a library
    # architecture, fedbroker.layers.library): raw parameters -> (kept parameters, [(parameter, problem)])
    check_params: Callable[[Mapping[str, Any]], tuple[dict[str, Any], list[tuple[str, str]]]] | None = None
    # a layer type whose forward FLOPs per sample no general rule gives (a library network): (params, input shape)
    flops: Callable[[Params, Shape], int] | None = None
    # the aggregation side's numpy forward pass (a probe set's: the GA's fitness, FLTrust) computes this layer
    probe_forward: bool = False

    @property
    def weighted(self) -> bool:
        """Alignment matches this layer's units (its weight's rows) across clients."""
        return bool(self.out_width)

    def alignment(self, params: Params) -> AlignTrait:
        """The layer's alignment trait: its own `align`; else "blocks" with `blocks_alignment`'s reason, "matched"
        for a weighted layer, and "blocks" for a type that declares nothing (a new type is refused by alignment
        until it says how a permutation passes through it)."""
        if self.align is not None:
            return self.align(params)
        if self.blocks_alignment:
            return AlignTrait("blocks", self.blocks_alignment)
        if self.weighted:
            return AlignTrait("matched")
        return AlignTrait("blocks", "its layer type declares no alignment trait")

    def declared_input(self, params: Params, shape: Shape, problem: ShapeProblem) -> Shape | None:
        """The input the layer says it takes, when `problem` is only that the input's width (or, for a flat
        layer, its rank) differs from its `takes_width` parameter: validation goes on from the layer's own
        word, so a second wrong layer is named too and one wrong width is not echoed by every later layer.
        None for any other problem."""
        if not self.takes_width or problem.param not in ("", self.takes_width):
            return None
        width = params[self.takes_width]
        if not problem.param:
            return (width,)
        axis = self.width_axis % len(shape)
        return (*shape[:axis], width, *shape[axis + 1:])

    def parameter_count(self, params: Params) -> int:
        """Weights of one such layer, to bound a model's size before anything is built."""
        return sum(math.prod(shape) for shape in self.tensors(params).values())


def check_param(param: Param, value: Any, show: Callable[[Any], str] = repr) -> tuple[Any, list[tuple[str, str]]]:
    """A job's value for `param`: the value as kept and its problems as (path suffix, problem)."""
    kind = param.kind
    if kind in ("values", "positive_values"):
        return check_values(value, positive=kind == "positive_values", show=show)
    is_int = isinstance(value, int) and not isinstance(value, bool)
    is_number = is_int or (isinstance(value, float) and math.isfinite(value))
    if kind == "width":
        ok, limit = is_int and 1 <= value <= MAX_WIDTH, f"an integer in [1, {MAX_WIDTH}]"
    elif kind == "kernel":
        ok, limit = value is None or (is_int and 1 <= value <= 64), "an integer in [1, 64]"
    elif kind == "int0":
        ok, limit = is_int and 0 <= value <= 64, "an integer in [0, 64]"
    elif kind == "int":
        ok, limit = is_int and param.low <= value <= param.high, f"an integer in [{param.low:g}, {param.high:g}]"
    elif kind == "number":
        ok, limit = is_number and param.low <= value <= param.high, f"a number in [{param.low:g}, {param.high:g}]"
        value = float(value) if ok else value
    elif kind == "choice":
        ok, limit = isinstance(value, str) and value in param.choices, f"one of {', '.join(param.choices)}"
    elif kind == "bool":
        ok, limit = isinstance(value, bool), "true or false"
    else:  # "prob"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < 1.0
        limit = "a number in [0, 1)"
    return value, ([] if ok else [("", f"must be {limit}, got {show(value)}")])


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


def rank_problem(name: str, shape: Shape, axes: str) -> ShapeProblem:
    """A layer given an input of the wrong rank: `axes` names what it takes, e.g. "(channels, length)"."""
    return ShapeProblem("", f"{name} needs a {axes} input but receives {list(shape)}")


def width_problem(param: str, value: int, actual: int, what: str) -> ShapeProblem:
    """A layer whose width parameter differs from its input's: `what` names the input's axis ("channels")."""
    return ShapeProblem(param, f"is {value} but the input has {actual} {what}")


def bias_tensors(p: Params, weight: Shape, width: int) -> dict[str, Shape]:
    """A weight and, when the layer's `bias` parameter is on, a bias of `width` values."""
    return {"weight": weight, **({"bias": (width,)} if p["bias"] else {})}
