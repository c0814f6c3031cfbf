"""Convolutions over 1, 2 or 3 spatial axes, and the transposed ones a U-Net decodes with. One square (cubic)
kernel size, stride and padding per layer, as torch takes a single int."""

from __future__ import annotations

from collections.abc import Callable

from fedbroker.layers.base import (
    LayerType,
    Param,
    Params,
    Shape,
    ShapeProblem,
    bias_tensors,
    rank_problem,
    width_problem,
)

AXES = {1: "(channels, length)", 2: "(channels, height, width)", 3: "(channels, depth, height, width)"}


def _conv_output(name: str, dims: int) -> Callable[[Params, Shape], Shape | ShapeProblem]:
    def output(p: Params, shape: Shape) -> Shape | ShapeProblem:
        if len(shape) != dims + 1:
            return rank_problem(name, shape, AXES[dims])
        if p["in_channels"] != shape[0]:
            return width_problem("in_channels", p["in_channels"], shape[0], "channels")
        k, s, pad = p["kernel_size"], p["stride"], p["padding"]
        sizes = tuple((x + 2 * pad - k) // s + 1 for x in shape[1:])
        if min(sizes) < 1:
            return ShapeProblem("kernel_size", f"{k} is larger than the padded input {list(shape[1:])}")
        return (p["out_channels"], *sizes)

    return output


def _conv_tensors(dims: int) -> Callable[[Params], dict[str, Shape]]:
    def tensors(p: Params) -> dict[str, Shape]:
        k = p["kernel_size"]
        return bias_tensors(p, (p["out_channels"], p["in_channels"], *[k] * dims), p["out_channels"])

    return tensors


def _transposed_output(name: str, dims: int) -> Callable[[Params, Shape], Shape | ShapeProblem]:
    def output(p: Params, shape: Shape) -> Shape | ShapeProblem:
        if len(shape) != dims + 1:
            return rank_problem(name, shape, AXES[dims])
        if p["in_channels"] != shape[0]:
            return width_problem("in_channels", p["in_channels"], shape[0], "channels")
        k, s, pad, extra = p["kernel_size"], p["stride"], p["padding"], p["output_padding"]
        if extra >= s:
            return ShapeProblem("output_padding", f"{extra} must be smaller than stride {s}")
        sizes = tuple((x - 1) * s - 2 * pad + k + extra for x in shape[1:])
        if min(sizes) < 1:
            return ShapeProblem("padding", f"{pad} leaves no output from the input {list(shape[1:])}")
        return (p["out_channels"], *sizes)

    return output


def _transposed_tensors(dims: int) -> Callable[[Params], dict[str, Shape]]:
    def tensors(p: Params) -> dict[str, Shape]:  # torch lays a transposed convolution's weight out (in, out, ...)
        k = p["kernel_size"]
        return bias_tensors(p, (p["in_channels"], p["out_channels"], *[k] * dims), p["out_channels"])

    return tensors


def _conv_params(*, transposed: bool) -> dict[str, Param]:
    params = {"in_channels": Param("width", required=True), "out_channels": Param("width", required=True),
              "kernel_size": Param("kernel", required=True), "stride": Param("kernel", default=1),
              "padding": Param("int0", default=0), "bias": Param("bool", default=True)}
    if transposed:
        params["output_padding"] = Param("int0", default=0)
    return params


def _conv(dims: int) -> LayerType:
    name = f"Conv{dims}d"
    # Conv1d/Conv3d: matched units like Conv2d's once an engine handles their 3-D/5-D weights
    blocks = "" if dims == 2 else (f"the alignment engines match Linear and Conv2d weights, not a Conv{dims}d's "
                                   f"{dims + 2}-D one")
    return LayerType(name, _conv_params(transposed=False), _conv_output(name, dims), _conv_tensors(dims),
                     out_width="out_channels", in_width="in_channels", takes_width="in_channels", dp="bk",
                     probe_forward=dims == 2, blocks_alignment=blocks)


def _transposed(dims: int) -> LayerType:
    name = f"ConvTranspose{dims}d"
    return LayerType(name, _conv_params(transposed=True), _transposed_output(name, dims), _transposed_tensors(dims),
                     takes_width="in_channels", dp="bk",
                     blocks_alignment="its weight is laid out (in, out, ...), the transpose of the (out, in, ...) "
                                      "that the alignment engines match by rows")


CONV: dict[str, LayerType] = {
    "Conv1d": _conv(1), "Conv2d": _conv(2), "Conv3d": _conv(3),
    "ConvTranspose2d": _transposed(2), "ConvTranspose3d": _transposed(3),
}
