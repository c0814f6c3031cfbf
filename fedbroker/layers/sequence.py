"""Layers over sequences, input (positions, features): LSTM and GRU (Opacus's DPLSTM/DPGRU), self-attention
(Opacus's DPMultiheadAttention) and a Transformer encoder layer built from DP-capable parts. Each takes one
sample's sequence with its positions first (torch's batch_first)."""

from __future__ import annotations

from collections.abc import Callable

from fedbroker.layers.base import LayerType, Param, Params, Shape, ShapeProblem, rank_problem, width_problem

MAX_RNN_LAYERS = 8
MAX_HEADS = 64
_SEQ = "(positions, features)"
_GATES = {"LSTM": 4, "GRU": 3}


def _rnn_output(name: str) -> Callable[[Params, Shape], Shape | ShapeProblem]:
    def output(p: Params, shape: Shape) -> Shape | ShapeProblem:
        if len(shape) != 2:
            return rank_problem(name, shape, _SEQ)
        if p["input_size"] != shape[1]:
            return width_problem("input_size", p["input_size"], shape[1], "features per position")
        width = p["hidden_size"] * (2 if p["bidirectional"] else 1)
        return (shape[0], width) if p["output"] == "sequence" else (width,)

    return output


def _rnn_tensors(name: str) -> Callable[[Params], dict[str, Shape]]:
    def tensors(p: Params) -> dict[str, Shape]:  # torch's (and DPLSTM's renamed) names, layer by layer
        gates, hidden = _GATES[name] * p["hidden_size"], p["hidden_size"]
        directions = ("", "_reverse") if p["bidirectional"] else ("",)
        out: dict[str, Shape] = {}
        for layer in range(p["num_layers"]):
            inputs = p["input_size"] if layer == 0 else hidden * len(directions)
            for d in directions:
                out[f"weight_ih_l{layer}{d}"] = (gates, inputs)
                out[f"weight_hh_l{layer}{d}"] = (gates, hidden)
                if p["bias"]:
                    out[f"bias_ih_l{layer}{d}"] = (gates,)
                    out[f"bias_hh_l{layer}{d}"] = (gates,)
        return out

    return tensors


def _rnn(name: str) -> LayerType:
    return LayerType(
        name,
        {"input_size": Param("width", required=True), "hidden_size": Param("width", required=True),
         "num_layers": Param("int", default=1, low=1, high=MAX_RNN_LAYERS), "bias": Param("bool", default=True),
         "bidirectional": Param("bool", default=False), "dropout": Param("prob", default=0.0),
         # "sequence": every position's hidden state, (positions, hidden·directions); "last": the final hidden
         # state of the last layer, (hidden·directions,) — each direction's own last step — for a classifier
         "output": Param("choice", default="sequence", choices=("sequence", "last"))},
        _rnn_output(name), _rnn_tensors(name), takes_width="input_size", width_axis=-1, dp="opacus",
        blocks_alignment=f"its hidden units feed back through {_GATES[name]} gates each; the alignment engines match "
                         "feed-forward layers only",
    )


def _attention_output(name: str, width: str, heads: str) -> Callable[[Params, Shape], Shape | ShapeProblem]:
    def output(p: Params, shape: Shape) -> Shape | ShapeProblem:
        if len(shape) != 2:
            return rank_problem(name, shape, _SEQ)
        if p[width] != shape[1]:
            return width_problem(width, p[width], shape[1], "features per position")
        if p[width] % p[heads]:
            return ShapeProblem(heads, f"{p[heads]} does not divide {width} {p[width]}")
        return shape

    return output


def _attention_tensors(p: Params, prefix: str = "", width: str = "embed_dim") -> dict[str, Shape]:
    """DPMultiheadAttention's own names (its q/k/v projections apart; torch's packs them in in_proj_weight)."""
    e = p[width]
    out: dict[str, Shape] = {}
    for name in ("qlinear", "klinear", "vlinear", "out_proj"):
        out[f"{prefix}{name}.weight"] = (e, e)
        if p["bias"]:
            out[f"{prefix}{name}.bias"] = (e,)
    return out


def _encoder_tensors(p: Params) -> dict[str, Shape]:
    d, ff = p["d_model"], p["dim_feedforward"]
    return {**_attention_tensors({**p, "bias": True}, "self_attn.", "d_model"),
            "linear1.weight": (ff, d), "linear1.bias": (ff,), "linear2.weight": (d, ff), "linear2.bias": (d,),
            "norm1.weight": (d,), "norm1.bias": (d,), "norm2.weight": (d,), "norm2.bias": (d,)}


_ATTENTION_BLOCKS = "its heads mix units within fixed slices of the embedding; the alignment engines match whole layers"

SEQUENCE: dict[str, LayerType] = {
    "LSTM": _rnn("LSTM"),
    "GRU": _rnn("GRU"),
    # self-attention: query, key and value are the input; the output has the input's shape
    "MultiheadAttention": LayerType(
        "MultiheadAttention",
        {"embed_dim": Param("width", required=True), "num_heads": Param("int", required=True, low=1, high=MAX_HEADS),
         "dropout": Param("prob", default=0.0), "bias": Param("bool", default=True)},
        _attention_output("MultiheadAttention", "embed_dim", "num_heads"), _attention_tensors,
        takes_width="embed_dim", width_axis=-1, dp="bk", blocks_alignment=_ATTENTION_BLOCKS,
    ),
    # torch's TransformerEncoderLayer's function and names (self_attn, linear1/2, norm1/2) from DP-capable parts
    "TransformerEncoderLayer": LayerType(
        "TransformerEncoderLayer",
        {"d_model": Param("width", required=True), "nhead": Param("int", required=True, low=1, high=MAX_HEADS),
         "dim_feedforward": Param("width", required=True), "dropout": Param("prob", default=0.1),
         "activation": Param("choice", default="relu", choices=("relu", "gelu")),
         "norm_first": Param("bool", default=False)},
        _attention_output("TransformerEncoderLayer", "d_model", "nhead"), _encoder_tensors,
        takes_width="d_model", width_axis=-1, dp="bk", blocks_alignment=_ATTENTION_BLOCKS,
    ),
}
