"""Library architectures a model node may name: an allow-list of MONAI's networks with typed, bounded parameters.

A node `{type: monai.UNet, spatial_dims: 2, in_channels: 1, ...}` asks a site to build MONAI's own UNet: the site
runs the code of a library it installed, never a data scientist's. Each entry lists its parameters under
MONAI's constructor names, each with its kind and bounds; anything else (an unknown parameter, a norm or
activation off the list, `pretrained`, arbitrary keyword arguments) is refused, naming the field.

Three choices are fixed here rather than left to the job, so that DP training works and every site builds
the same network:

- **norms**: the network is built with BatchNorm and every BatchNorm is then swapped for
  GroupNorm(gcd(num_groups, C), C), Opacus's ModuleValidator rule (num_groups 32 by default, as Opacus's);
  BatchNorm mixes samples of a batch, which per-sample clipping cannot allow. The swap is the same for every
  network and always valid (gcd divides C), where MONAI's `norm=("group", ...)` would need num_groups to
  divide every width, out_channels included.
- **version**: a node carries `version`, which must be the MONAI version this fedbroker pins (MONAI_VERSION,
  also pinned in requirements.txt). The coordinator refuses any other; a worker whose installed MONAI differs
  refuses to build the model (fedbroker.layers.monai_nets), so two sites never train different code under
  one name.
- **no downloads**: `pretrained` is never passed (starting weights come from the job's own weights file).

Shapes and tensors, without building a real network: the output shape is each network's own rule, written
out here (no torch). The tensors (names and shapes, for the wire, aggregation and the parameter bound) come
from building the network on torch's `meta` device, which allocates no memory and draws no weights; the
result is cached per parameter set. The parameters' bounds keep that build small (at most a few hundred
modules), and the exact count it gives is checked against MAX_LIBRARY_PARAMETERS before any site builds a
real network. So the coordinator imports torch and MONAI only for a job that names a library node.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fedbroker.errors import ConfigError
from fedbroker.layers.base import LayerType, Params, Shape, ShapeProblem
from fedbroker.layers.monai_pins import MONAI_VERSION as MONAI_VERSION

# one library node may hold at most this many weights (DenseNet-121 holds 7 M, ResNet-34 21 M, ViT-B/16 86 M)
MAX_LIBRARY_PARAMETERS = 100_000_000
MAX_CHANNELS = 1024
ACTIVATIONS = ("relu", "leakyrelu", "prelu", "gelu", "elu")

ParamKind = Literal["int", "ints", "size", "choice", "bool", "prob"]


@dataclass(frozen=True)
class LibParam:
    """One parameter of a library architecture. int: an integer in [low, high]; ints: a list of `length`
    (min, max) such integers; size: one such integer or a list of spatial_dims of them (kept as a tuple);
    choice: one of `choices`; bool; prob: a number in [0, high]."""

    kind: ParamKind
    low: int = 0
    high: float = 0
    length: tuple[int, int] = (1, 1)
    choices: tuple[Any, ...] = ()
    required: bool = False
    default: Any = None

    def check(self, value: Any) -> tuple[Any, str]:
        """The value as kept and "" when it is allowed, else the problem (what it must be)."""
        def whole(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and self.low <= v <= self.high

        span = f"an integer in [{self.low}, {self.high}]"
        if self.kind == "int":
            return value, "" if whole(value) else f"must be {span}, got {_show(value)}"
        if self.kind in ("ints", "size"):
            if self.kind == "size" and whole(value):
                return value, ""
            lo, hi = self.length
            if isinstance(value, list) and lo <= len(value) <= hi and all(whole(v) for v in value):
                return tuple(value), ""
            count = f"{lo}" if lo == hi else f"{lo} to {hi}"
            either = f"{span} or " if self.kind == "size" else ""
            return value, f"must be {either}a list of {count} of {span.replace('an integer', 'integers')}, got {_show(value)}"
        if self.kind == "choice":
            ok = any(value == c and type(value) is type(c) for c in self.choices)
            return value, "" if ok else f"must be one of {', '.join(map(_show, self.choices))}, got {_show(value)}"
        if self.kind == "bool":
            return value, "" if isinstance(value, bool) else f"must be true or false, got {_show(value)}"
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value <= self.high
        return value, "" if ok else f"must be a number in [0, {self.high}], got {_show(value)}"


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Architecture:
    """One allowed library network: its parameters, its own cross-parameter rules and its output shape rule."""

    params: Mapping[str, LibParam]
    # problems between parameters, as (parameter, problem), once each parameter alone is allowed
    rules: Callable[[Params], list[tuple[str, str]]]
    output_shape: Callable[[Params, Shape], Shape | ShapeProblem]


_DIMS = LibParam("choice", choices=(2, 3), required=True)
_CHANNELS_IN = LibParam("int", 1, 64, required=True)
_CLASSES = LibParam("int", 1, MAX_CHANNELS, required=True)
_GROUPS = LibParam("int", 1, 64, default=32)
_VERSION = LibParam("choice", choices=(MONAI_VERSION,), default=MONAI_VERSION)
_DROPOUT = LibParam("prob", high=0.5, default=0.0)


def _image_input(name: str, p: Params, shape: Shape, channels: str) -> ShapeProblem | None:
    d = p["spatial_dims"]
    if len(shape) != d + 1:
        kind = "(channels, height, width)" if d == 2 else "(channels, depth, height, width)"
        return ShapeProblem("spatial_dims", f"is {d}: {name} needs a {kind} input but receives {list(shape)}")
    if shape[0] != p[channels]:
        return ShapeProblem(channels, f"is {p[channels]} but the input has {shape[0]} channels")
    return None


# ----- monai.UNet --------------------------------------------------------------------------------------

def _unet_rules(p: Params) -> list[tuple[str, str]]:
    if len(p["strides"]) != len(p["channels"]) - 1:
        return [("strides", f"has {len(p['strides'])} values; a UNet of {len(p['channels'])} channel levels needs "
                            f"{len(p['channels']) - 1} (one per step down)")]
    return []


def _unet_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    problem = _image_input("monai.UNet", p, shape, "in_channels")
    if problem:
        return problem
    scale = math.prod(p["strides"])
    if any(n % scale for n in shape[1:]):
        return ShapeProblem("strides", f"go down by {scale} in all; every input size must be a multiple of it so that "
                                       f"each skip meets its upsampled path, got {list(shape[1:])}")
    return (p["out_channels"], *shape[1:])


UNET = Architecture(
    {"spatial_dims": _DIMS, "in_channels": _CHANNELS_IN, "out_channels": _CLASSES,
     "channels": LibParam("ints", 1, MAX_CHANNELS, length=(2, 6), required=True),
     "strides": LibParam("ints", 1, 4, length=(1, 5), required=True),
     "kernel_size": LibParam("choice", choices=(1, 3, 5), default=3),
     "up_kernel_size": LibParam("choice", choices=(1, 3, 5), default=3),
     "num_res_units": LibParam("int", 0, 4, default=0),
     "act": LibParam("choice", choices=ACTIVATIONS, default="relu"),
     "num_groups": _GROUPS, "dropout": _DROPOUT, "bias": LibParam("bool", default=True), "version": _VERSION},
    _unet_rules, _unet_output,
)


# ----- monai.DenseNet121 -------------------------------------------------------------------------------

def _down(n: int, kernel: int, stride: int, pad: int) -> int:
    return (n + 2 * pad - kernel) // stride + 1


def _densenet_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    problem = _image_input("monai.DenseNet121", p, shape, "in_channels")
    if problem:
        return problem
    # stem: 7×7 convolution, stride 2, padding 3; 3×3 max pool, stride 2, padding 1; three transitions halve
    for n in shape[1:]:
        if _down(_down(n, 7, 2, 3), 3, 2, 1) // 8 < 1:
            return ShapeProblem("", f"monai.DenseNet121 shrinks its input 32-fold; input sizes {list(shape[1:])} "
                                    f"must be at least 29 (for small images use the catalogue's densenet121_small)")
    return (p["out_channels"],)


DENSENET121 = Architecture(
    {"spatial_dims": _DIMS, "in_channels": _CHANNELS_IN, "out_channels": _CLASSES,
     "init_features": LibParam("int", 8, 128, default=64), "growth_rate": LibParam("int", 4, 64, default=32),
     "num_groups": _GROUPS, "dropout_prob": _DROPOUT, "version": _VERSION},
    lambda _: [], _densenet_output,
)


# ----- monai.ResNet (resnet18 / resnet34) --------------------------------------------------------------


def _resnet_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    problem = _image_input("monai.ResNet", p, shape, "n_input_channels")
    if problem:
        return problem
    k, s = p["conv1_t_size"], p["conv1_t_stride"]
    for n in shape[1:]:
        n = _down(n, k, s, k // 2)
        if not p["no_max_pool"]:
            n = _down(n, 3, 2, 1)
        for _ in range(3):  # layers 2 to 4 each start with a 3×3 convolution of stride 2
            n = _down(n, 3, 2, 1)
        if n < 1:
            return ShapeProblem("", f"monai.ResNet's input sizes {list(shape[1:])} are too small for its stem and "
                                    f"three stride-2 stages")
    return (p["num_classes"],)


RESNET = Architecture(
    {"depth": LibParam("choice", choices=(18, 34), required=True), "spatial_dims": _DIMS,
     "n_input_channels": _CHANNELS_IN, "num_classes": _CLASSES,
     "conv1_t_size": LibParam("choice", choices=(3, 5, 7), default=7),
     "conv1_t_stride": LibParam("choice", choices=(1, 2), default=2),
     "no_max_pool": LibParam("bool", default=False), "shortcut_type": LibParam("choice", choices=("A", "B"), default="B"),
     "num_groups": _GROUPS, "version": _VERSION},
    lambda _: [], _resnet_output,
)


# ----- monai.ViT (classification) ----------------------------------------------------------------------

def _per_dim(p: Params, name: str) -> tuple[int, ...]:
    value = p[name]
    return tuple(value) if isinstance(value, (list, tuple)) else (value,) * p["spatial_dims"]


def _vit_rules(p: Params) -> list[tuple[str, str]]:
    problems = []
    for name in ("img_size", "patch_size"):
        if isinstance(p[name], (list, tuple)) and len(p[name]) != p["spatial_dims"]:
            problems.append((name, f"has {len(p[name])} sizes; spatial_dims is {p['spatial_dims']}"))
    if not problems:
        img, patch = _per_dim(p, "img_size"), _per_dim(p, "patch_size")
        if any(i % q for i, q in zip(img, patch)):
            problems.append(("patch_size", f"{list(patch)} must divide img_size {list(img)}"))
        elif math.prod(i // q for i, q in zip(img, patch)) > 4096:
            problems.append(("patch_size", f"{list(patch)} cuts img_size {list(img)} into more than 4096 patches"))
    if p["hidden_size"] % p["num_heads"]:
        problems.append(("num_heads", f"{p['num_heads']} must divide hidden_size {p['hidden_size']}"))
    return problems


def _vit_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    problem = _image_input("monai.ViT", p, shape, "in_channels")
    if problem:
        return problem
    if tuple(shape[1:]) != _per_dim(p, "img_size"):
        return ShapeProblem("img_size", f"is {list(_per_dim(p, 'img_size'))} but the input is {list(shape[1:])}: a ViT's "
                                        f"position embeddings fix its input size")
    return (p["num_classes"],)


VIT = Architecture(
    {"spatial_dims": _DIMS, "in_channels": _CHANNELS_IN,
     "img_size": LibParam("size", 1, 512, length=(2, 3), required=True),
     "patch_size": LibParam("size", 1, 64, length=(2, 3), required=True),
     "hidden_size": LibParam("int", 8, 1024, default=768), "mlp_dim": LibParam("int", 8, 4096, default=3072),
     "num_layers": LibParam("int", 1, 24, default=12), "num_heads": LibParam("int", 1, 16, default=12),
     "num_classes": _CLASSES, "proj_type": LibParam("choice", choices=("conv", "perceptron"), default="conv"),
     "dropout_rate": _DROPOUT, "qkv_bias": LibParam("bool", default=False), "version": _VERSION},
    _vit_rules, _vit_output,
)

ARCHITECTURES: Mapping[str, Architecture] = {
    "monai.UNet": UNET, "monai.DenseNet121": DENSENET121, "monai.ResNet": RESNET, "monai.ViT": VIT,
}


def check_params(type_name: str, raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A library node's parameters (without `type` and `inputs`) checked: (the parameters as kept, with every
    default filled in; every problem as (parameter, problem)). Unknown parameters are refused by name."""
    arch = ARCHITECTURES[type_name]
    problems = [(key, f"unknown parameter for {type_name}; allowed: {', '.join(arch.params)}")
                for key in sorted(set(raw) - set(arch.params))]
    params: dict[str, Any] = {}
    for key, spec in arch.params.items():
        if key not in raw:
            if spec.required:
                problems.append((key, f"is required for {type_name}"))
            params[key] = spec.default
            continue
        params[key], problem = spec.check(raw[key])
        if problem:
            problems.append((key, problem))
    if not problems:
        problems = arch.rules(params)
    return params, problems


def _key(type_name: str, params: Params) -> str:
    return json.dumps([type_name, {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}], sort_keys=True)


@functools.lru_cache(maxsize=128)
def _meta_tensors(key: str) -> dict[str, Shape] | str:
    type_name, params = json.loads(key)
    from fedbroker.layers import monai_nets  # torch and MONAI: only for a job that names a library node

    try:
        return monai_nets.meta_tensors(type_name, _kept(type_name, params))
    except ConfigError as exc:  # this machine's MONAI is not the pinned one
        return exc.problem
    except (ValueError, TypeError, AssertionError, RuntimeError) as exc:  # MONAI's own refusals
        return f"MONAI cannot build it: {exc}"


def _kept(type_name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Parameters as check_params keeps them (lists back to tuples after the JSON round trip of the cache key)."""
    arch = ARCHITECTURES[type_name]
    return {k: tuple(v) if isinstance(v, list) and arch.params[k].kind in ("ints", "size") else v
            for k, v in params.items()}


def tensors(type_name: str, params: Params) -> dict[str, Shape]:
    """The network's state_dict names and shapes, from a build on the meta device (cached); {} when MONAI
    refuses the parameters (output_shape names that problem)."""
    found = _meta_tensors(_key(type_name, params))
    return found if isinstance(found, dict) else {}


@functools.lru_cache(maxsize=128)
def _meta_flops(key: str, shape: Shape) -> int:
    type_name, params = json.loads(key)
    from fedbroker.layers import monai_nets

    return monai_nets.meta_flops(type_name, _kept(type_name, params), shape)


def flops(type_name: str, params: Params, shape: Shape) -> int:
    """Forward FLOPs of one sample of `shape` through the network, counted by torch's FLOP counter on the meta
    device (cached): a UNet's or a ViT's weights act at many positions, which no per-weight rule sees."""
    return _meta_flops(_key(type_name, params), tuple(shape))


def _output_with_bound(type_name: str) -> Callable[[Params, Shape], Shape | ShapeProblem]:
    arch = ARCHITECTURES[type_name]

    def output(p: Params, shape: Shape) -> Shape | ShapeProblem:
        out = arch.output_shape(p, shape)
        if isinstance(out, ShapeProblem):
            return out
        found = _meta_tensors(_key(type_name, p))
        if isinstance(found, str):
            return ShapeProblem("", found)
        count = sum(math.prod(s) for s in found.values())
        if count > MAX_LIBRARY_PARAMETERS:
            return ShapeProblem("", f"{type_name} with these parameters holds {count:,} weights, more than a library "
                                    f"node's limit of {MAX_LIBRARY_PARAMETERS:,}")
        return out

    return output


# the table's entries (fedbroker.layers.LAYERS adds them); "opacus": the worker clips them with Opacus's samplers
# where its own one-pass clipping does not know a layer (a UNet's ConvTranspose, a ViT's class token)
LIBRARY: Mapping[str, LayerType] = {
    name: LayerType(
        "", output_shape=_output_with_bound(name), tensors=functools.partial(tensors, name),
        blocks_alignment=f"{name} is a library network: alignment does not permute units inside it",
        check_params=functools.partial(check_params, name), flops=functools.partial(flops, name), dp="opacus",
    )
    for name in ARCHITECTURES
}
