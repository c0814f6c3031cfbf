"""The torch modules of the layer types torch has no plain class for, and how each such type is built.

`fedbroker.model.build_layer` builds a type as `torch.nn.<torch_class>(**params)` unless BUILDERS names it.
Every module here keeps the state_dict names the table's `tensors` give, and every one can be clipped per
sample: DPLSTM/DPGRU and DPMultiheadAttention are Opacus's, and the encoder layer is made of them, Linear,
LayerNorm and Dropout (torch's fused nn.TransformerEncoderLayer cannot be clipped per sample).
Importing this imports torch, and Opacus when a recurrent or attention layer is built.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from fedbroker.layers.norm import batchnorm_groups


class TokenEmbedding(nn.Embedding):
    """nn.Embedding over the model's input as token ids. Features travel as float32 (exact for every id below
    2^24, and MAX_EMBEDDINGS is 2^20), so the ids are checked and turned into long indices here, on every
    batch: an id that is not an integer in [0, num_embeddings) is refused naming the id, instead of reading
    another row or failing deep inside torch."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The embedded sequence, (batch, positions, embedding_dim)."""
        ids = x if not x.is_floating_point() else x.detach()
        if ids.numel():
            low, high = ids.min(), ids.max()
            if bool(low < 0) or bool(high >= self.num_embeddings):
                bad = low if bool(low < 0) else high
                raise ValueError(f"Embedding: token id {bad.item():g} is outside [0, {self.num_embeddings}) "
                                 f"(num_embeddings); the model's input must be token ids of its vocabulary")
            if ids.is_floating_point() and not bool((ids == ids.round()).all()):
                raise ValueError("Embedding: the model's input must be whole token ids, got a fraction")
        return super().forward(ids.long())


def _last_step(hidden: torch.Tensor, directions: int) -> torch.Tensor:
    """The last layer's final hidden state of each direction, (batch, hidden·directions)."""
    return torch.cat(list(hidden[-directions:]), dim=1)


def _drop_cell_names(module: nn.Module, state: dict[str, Any], prefix: str, _: Any) -> None:
    for old in module.old_to_new:  # type: ignore[attr-defined]
        state.pop(prefix + old, None)


def _fill_cell_names(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    for old, new in module.old_to_new.items():  # type: ignore[attr-defined]
        if prefix + new in state:
            state[prefix + old] = state[prefix + new]


@functools.cache
def _recurrent_class(kind: str) -> type[nn.Module]:
    """Opacus's DPLSTM/DPGRU, batch first, returning the sequence or its last step (`output`); made once, when
    first built, so that importing this module does not import Opacus."""
    from opacus.layers import DPGRU, DPLSTM

    class Recurrent(DPLSTM if kind == "LSTM" else DPGRU):  # type: ignore[misc]
        def __init__(self, p: Mapping[str, Any]) -> None:
            super().__init__(p["input_size"], p["hidden_size"], num_layers=p["num_layers"], bias=p["bias"],
                             batch_first=True, dropout=p["dropout"], bidirectional=p["bidirectional"])
            self.last = p["output"] == "last"
            # Opacus's hook drops its cells' own names (l0.ih.weight) from a copy of the state_dict, which only
            # works at the top level: inside a model they would travel twice. Drop them in place under any
            # prefix instead, and fill them in on loading.
            self._state_dict_hooks.clear()
            self.register_state_dict_post_hook(_drop_cell_names)
            self.register_load_state_dict_pre_hook(_fill_cell_names)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            out, state = super().forward(x)
            if not self.last:
                return out  # type: ignore[no-any-return]
            hidden = state[0] if isinstance(state, tuple) else state
            return _last_step(hidden, 2 if self.bidirectional else 1)

    Recurrent.__name__ = Recurrent.__qualname__ = f"DP{kind}Layer"
    return Recurrent


@functools.cache
def _attention_class() -> type[nn.Module]:
    """Opacus's DPMultiheadAttention as self-attention on a batch-first sequence, with the plain nn.Module
    state_dict (qlinear/klinear/vlinear/out_proj): Opacus's own rewrites its keys into torch's packed
    in_proj_weight, which would not load back into it by name."""
    from opacus.layers import DPMultiheadAttention

    class SelfAttention(DPMultiheadAttention):  # type: ignore[misc]
        state_dict = nn.Module.state_dict
        load_state_dict = nn.Module.load_state_dict

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(x, x, x, need_weights=False)[0]  # type: ignore[no-any-return]

    return SelfAttention


def self_attention(embed_dim: int, num_heads: int, *, dropout: float, bias: bool) -> nn.Module:
    """Self-attention (Opacus's DP attention): (batch, positions, embed_dim) in and out."""
    return _attention_class()(embed_dim, num_heads, dropout=dropout, bias=bias, batch_first=True)


class EncoderLayer(nn.Module):
    """torch's TransformerEncoderLayer (post-norm, or pre-norm with `norm_first`) from DP-capable parts:
    self-attention, a feed-forward block of two Linear layers, two LayerNorms, dropout; same names."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int, *, dropout: float, activation: str,
                 norm_first: bool) -> None:
        super().__init__()
        self.self_attn = self_attention(d_model, nhead, dropout=dropout, bias=True)
        self.linear1, self.linear2 = nn.Linear(d_model, dim_feedforward), nn.Linear(dim_feedforward, d_model)
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.dropout, self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(dropout), nn.Dropout(dropout)
        self.activation: nn.Module = nn.GELU() if activation == "gelu" else nn.ReLU()
        self.norm_first = norm_first

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, positions, d_model) in and out."""
        if self.norm_first:
            x = x + self.dropout1(self.self_attn(self.norm1(x)))
            return x + self._feed_forward(self.norm2(x))
        x = self.norm1(x + self.dropout1(self.self_attn(x)))
        return self.norm2(x + self._feed_forward(x))


def _batchnorm(p: Mapping[str, Any]) -> nn.Module:
    return nn.GroupNorm(batchnorm_groups(p["num_features"]), p["num_features"])


# Layer types whose module is not `torch.nn.<torch_class>(**params)`, by type name.
BUILDERS: Mapping[str, Callable[[Mapping[str, Any]], nn.Module]] = {
    "Embedding": lambda p: TokenEmbedding(p["num_embeddings"], p["embedding_dim"]),
    "LSTM": lambda p: _recurrent_class("LSTM")(p),
    "GRU": lambda p: _recurrent_class("GRU")(p),
    "MultiheadAttention": lambda p: self_attention(p["embed_dim"], p["num_heads"], dropout=p["dropout"],
                                                   bias=p["bias"]),
    "TransformerEncoderLayer": lambda p: EncoderLayer(p["d_model"], p["nhead"], p["dim_feedforward"],
                                                      dropout=p["dropout"], activation=p["activation"],
                                                      norm_first=p["norm_first"]),
    "BatchNorm1d": _batchnorm, "BatchNorm2d": _batchnorm, "BatchNorm3d": _batchnorm,
}
