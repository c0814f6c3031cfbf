"""Layers that resample the spatial axes without weights: max and average pooling, adaptive average pooling
and Upsample. Alignment passes over all of them (they act channel by channel)."""

from __future__ import annotations

from collections.abc import Callable

from fedbroker.layers.base import LayerType, Param, Params, Shape, ShapeProblem, rank_problem
from fedbroker.layers.conv import AXES

MAX_SCALE = 16
# Upsample's modes by the spatial axes they interpolate (nearest works on any)
_MODE_AXES = {"linear": 1, "bilinear": 2, "trilinear": 3}


def _pool_output(name: str, dims: int) -> Callable[[Params, Shape], Shape | ShapeProblem]:
    def output(p: Params, shape: Shape) -> Shape | ShapeProblem:
        if len(shape) != dims + 1:
            return rank_problem(name, shape, AXES[dims])
        k = p["kernel_size"]
        s = p["stride"] or k  # torch's default stride is the kernel size
        sizes = tuple((x - k) // s + 1 for x in shape[1:])
        if min(sizes) < 1:
            return ShapeProblem("kernel_size", f"{k} is larger than the input {list(shape[1:])}")
        return (shape[0], *sizes)

    return output


def _adaptive_output(name: str, dims: int) -> Callable[[Params, Shape], Shape | ShapeProblem]:
    def output(p: Params, shape: Shape) -> Shape | ShapeProblem:
        if len(shape) != dims + 1:
            return rank_problem(name, shape, AXES[dims])
        return (shape[0], *[p["output_size"]] * dims)

    return output


def _upsample_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    if not 2 <= len(shape) <= 4:
        return rank_problem("Upsample", shape, "(channels, length), (channels, height, width) or "
                                               "(channels, depth, height, width)")
    axes = _MODE_AXES.get(p["mode"])
    if axes is not None and axes != len(shape) - 1:
        return ShapeProblem("mode", f"{p['mode']} interpolates {axes} spatial axes but the input {list(shape)} has "
                                    f"{len(shape) - 1}; use {next(m for m, a in _MODE_AXES.items() if a == len(shape) - 1)}"
                                    " or nearest")
    return (shape[0], *(x * p["scale_factor"] for x in shape[1:]))


_POOL_PARAMS = {"kernel_size": Param("kernel", required=True), "stride": Param("kernel", default=None)}


def _pool(kind: str, dims: int) -> LayerType:
    name = f"{kind}{dims}d"
    return LayerType(name, _POOL_PARAMS, _pool_output(name, dims), probe_forward=dims == 2)


def _adaptive(dims: int) -> LayerType:
    name = f"AdaptiveAvgPool{dims}d"
    return LayerType(name, {"output_size": Param("width", required=True)}, _adaptive_output(name, dims))


POOL: dict[str, LayerType] = {
    "MaxPool1d": _pool("MaxPool", 1), "MaxPool2d": _pool("MaxPool", 2), "MaxPool3d": _pool("MaxPool", 3),
    "AvgPool1d": _pool("AvgPool", 1), "AvgPool2d": _pool("AvgPool", 2),
    "AdaptiveAvgPool1d": _adaptive(1), "AdaptiveAvgPool2d": _adaptive(2), "AdaptiveAvgPool3d": _adaptive(3),
    # every spatial axis times an integer `scale_factor`; nearest, or the interpolation of the input's rank
    "Upsample": LayerType(
        "Upsample",
        {"scale_factor": Param("int", required=True, low=1, high=MAX_SCALE),
         "mode": Param("choice", default="nearest", choices=("nearest", *_MODE_AXES))},
        _upsample_output,
    ),
}
