"""Dense layers and the layers without weights that act value by value: Linear, Embedding, the activations,
Dropout, Flatten, Identity and the input's `standardize`."""

from __future__ import annotations

import math

from fedbroker.layers.base import (
    LayerType,
    Param,
    Params,
    Shape,
    ShapeProblem,
    bias_tensors,
)

# An Embedding's vocabulary: its ids travel as float32 features, exact up to 2^24; this bound keeps a table
# (with MAX_PARAMETERS) from being a way to make every site allocate gigabytes.
MAX_EMBEDDINGS = 1 << 20


def _linear_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    if len(shape) not in (1, 2):
        return ShapeProblem("", f"Linear needs a flat input or a (sequence, features) one but receives shape "
                                f"{list(shape)}; add a Flatten before it")
    if p["in_features"] != shape[-1]:
        return ShapeProblem("in_features", f"is {p['in_features']} but the previous layer outputs {shape[-1]}"
                                           + (" features per position" if len(shape) == 2 else ""))
    return (*shape[:-1], p["out_features"])


def _linear_tensors(p: Params) -> dict[str, Shape]:
    return bias_tensors(p, (p["out_features"], p["in_features"]), p["out_features"])


def _embedding_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    if len(shape) != 1:
        return ShapeProblem("", f"Embedding reads the model's input as a sequence of token ids, input_shape "
                                f"[length], but receives {list(shape)}")
    return (shape[0], p["embedding_dim"])


def _embedding_tensors(p: Params) -> dict[str, Shape]:
    return {"weight": (p["num_embeddings"], p["embedding_dim"])}


def _flatten_output(_: Params, shape: Shape) -> Shape | ShapeProblem:
    return (math.prod(shape),)


def _softmax_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    if -p["dim"] > len(shape):
        return ShapeProblem("dim", f"{p['dim']} names an axis the input {list(shape)} does not have (counted from "
                                   f"the last, -1 .. -{len(shape)})")
    return shape


def _standardize_output(p: Params, shape: Shape) -> Shape | ShapeProblem:
    features = math.prod(shape)
    for name in ("mean", "std"):
        value = p[name]
        if isinstance(value, (list, tuple)) and len(value) != features:
            return ShapeProblem(name, f"has {len(value)} values but the model's input has {features} features "
                                      f"(input_shape {list(shape)} flattened): give one value per feature, or one "
                                      f"number for all")
    return shape


DENSE: dict[str, LayerType] = {
    # Acts on the last axis: a flat input (features,) as always, or a sequence (positions, features) whose every
    # position goes through the same weights (a Transformer's projections).
    "Linear": LayerType(
        "Linear",
        {"in_features": Param("width", required=True), "out_features": Param("width", required=True),
         "bias": Param("bool", default=True)},
        _linear_output, _linear_tensors, out_width="out_features", in_width="in_features", takes_width="in_features",
        width_axis=-1, dp="bk", probe_forward=True,
    ),
    # The model's input as token ids (input_shape [length]); each id must be an integer in [0, num_embeddings),
    # checked on every batch (`fedbroker.layers.modules.TokenEmbedding`).
    "Embedding": LayerType(
        "Embedding",
        {"num_embeddings": Param("int", required=True, low=1, high=MAX_EMBEDDINGS),
         "embedding_dim": Param("width", required=True)},
        _embedding_output, _embedding_tensors, first_only=True, dp="bk",
        blocks_alignment="its output units are its weight's columns, one row per token id",
    ),
    "Flatten": LayerType("Flatten", output_shape=_flatten_output, probe_forward=True),
    "Identity": LayerType("Identity"),
    "ReLU": LayerType("ReLU", probe_forward=True),
    "Tanh": LayerType("Tanh", probe_forward=True),
    "Sigmoid": LayerType("Sigmoid", probe_forward=True),
    "GELU": LayerType("GELU", {"approximate": Param("choice", default="none", choices=("none", "tanh"))}),
    "SiLU": LayerType("SiLU"),
    "LeakyReLU": LayerType("LeakyReLU", {"negative_slope": Param("number", default=0.01, low=0.0, high=1.0)}),
    # `dim` counts axes of one sample from the last (-1: the features of a flat output or of each position).
    "Softmax": LayerType("Softmax", {"dim": Param("int", default=-1, low=-4, high=-1)}, _softmax_output),
    "Dropout": LayerType("Dropout", {"p": Param("prob", default=0.5)}, probe_forward=True),
    # (x - mean) / std on the model's input, with mean and std carried in the spec (no weights): the
    # preprocessing travels with the model (fedbroker.model.Standardize). Alignment passes over it: it never
    # permutes the model's inputs.
    "standardize": LayerType(
        "Standardize",
        {"mean": Param("values", required=True), "std": Param("positive_values", required=True)},
        _standardize_output, first_only=True, probe_forward=True,
    ),
}
