"""Normalisation layers: GroupNorm, LayerNorm, and BatchNorm as a spelling only.

BatchNorm mixes the samples of a batch (its statistics are the batch's), so a sample's gradient is not its
own and DP-SGD cannot clip it. A job may still write BatchNorm1d/2d/3d(num_features=C) — the way published
architectures are written — and the layer trains as GroupNorm(g, C):
- BatchNorm2d/3d (images, volumes): g the largest divisor of C that is at most 32 (32 groups for C = 64, 16 for
  C = 48, C itself for C ≤ 32), as Opacus's validator swaps in GroupNorm, with a count that always divides C;
- BatchNorm1d (flat features or sequences): g = 1, a LayerNorm over the sample's channels (and positions). With
  one value per channel, groups of one or two channels would normalise every value to 0 or ±1. Its weights are GroupNorm's (`weight`, `bias`, one
per channel; no running statistics); the job's view names the swap, and the spec keeps the type as written,
so alignment knows to fold it (`folds_at_alignment`).
"""

from __future__ import annotations

from collections.abc import Callable

from fedbroker.layers.base import LayerType, Param, Params, Shape, ShapeProblem, rank_problem, width_problem
from fedbroker.layers.conv import AXES

MAX_GROUPS = 32


def batchnorm_groups(channels: int, dims: int) -> int:
    """The GroupNorm group count a BatchNorm{dims}d over `channels` trains with: 1 for BatchNorm1d, else the
    largest divisor of `channels` that is at most MAX_GROUPS."""
    if dims == 1:
        return 1
    return max(g for g in range(1, min(channels, MAX_GROUPS) + 1) if channels % g == 0)


def _group_norm_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    if p["num_channels"] != shape[0]:
        return width_problem("num_channels", p["num_channels"], shape[0], "channels")
    if p["num_channels"] % p["num_groups"]:
        return ShapeProblem("num_groups", f"{p['num_groups']} does not divide num_channels {p['num_channels']}")
    return shape


def _per_channel(width: str) -> Callable[[Params], dict[str, Shape]]:
    def tensors(p: Params) -> dict[str, Shape]:
        return {"weight": (p[width],), "bias": (p[width],)}

    return tensors


def _layer_norm_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    if p["normalized_shape"] != shape[-1]:
        return width_problem("normalized_shape", p["normalized_shape"], shape[-1], "features on its last axis")
    return shape


def _batchnorm_output(name: str, ranks: tuple[int, ...]) -> Callable[[Params, Shape], Shape | ShapeProblem]:
    def output(p: Params, shape: Shape) -> Shape | ShapeProblem:
        if len(shape) not in ranks:
            axes = " or ".join("(channels,)" if r == 1 else AXES[r - 1] for r in ranks)
            return rank_problem(name, shape, axes)
        if p["num_features"] != shape[0]:
            return width_problem("num_features", p["num_features"], shape[0], "channels")
        return shape

    return output


def _batchnorm_substitution(name: str, dims: int) -> Callable[[Params], str]:
    def text(p: Params) -> str:
        c = p["num_features"]
        return f"{name}({c}) trains as GroupNorm({batchnorm_groups(c, dims)}, {c})"

    return text


def _batchnorm(dims: int, ranks: tuple[int, ...]) -> LayerType:
    name = f"BatchNorm{dims}d"
    return LayerType(
        "GroupNorm", {"num_features": Param("width", required=True)}, _batchnorm_output(name, ranks),
        _per_channel("num_features"), takes_width="num_features", trains_as="GroupNorm",
        substitution=_batchnorm_substitution(name, dims), folds_at_alignment=True, dp="bk",
        blocks_alignment=f"{name} trains as GroupNorm, whose groups would mix permuted channels; an alignment that "
                         "folds BatchNorm into the layer before it may take it",
    )


NORM: dict[str, LayerType] = {
    "GroupNorm": LayerType(
        "GroupNorm",
        {"num_groups": Param("width", required=True), "num_channels": Param("width", required=True)},
        _group_norm_output, _per_channel("num_channels"), dp="bk", probe_forward=True,
        blocks_alignment="permuting channels across its groups would change the function", takes_width="num_channels",
    ),
    # over the last axis: the features of a flat input or of each position of a sequence
    "LayerNorm": LayerType(
        "LayerNorm", {"normalized_shape": Param("width", required=True)}, _layer_norm_output,
        _per_channel("normalized_shape"), takes_width="normalized_shape", width_axis=-1, dp="bk",
        blocks_alignment="its per-feature scale and shift would have to follow the permutation, which the alignment "
                         "engines do not carry",
    ),
    "BatchNorm1d": _batchnorm(1, (1, 2)),
    "BatchNorm2d": _batchnorm(2, (3,)),
    "BatchNorm3d": _batchnorm(3, (4,)),
}
