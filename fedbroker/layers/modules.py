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
    batch: an id that is not an integer in [0, num_embeddings) is refused (without echoing it: it is a site's
    datum), instead of reading another row or failing deep inside torch. Workers check their data before
    training (`fedbroker.worker.global_model.fit_problem`); this guards every other caller."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The embedded sequence, (batch, positions, embedding_dim)."""
        ids = x if not x.is_floating_point() else x.detach()
        if ids.numel():
            low, high = ids.min(), ids.max()
            if bool(low < 0) or bool(high >= self.num_embeddings):  # (the id is a datum: never echoed)
                raise ValueError(f"Embedding: a token id is outside [0, {self.num_embeddings}) (num_embeddings); the "
                                 f"model's input must be token ids of its vocabulary")
            if ids.is_floating_point() and not bool((ids == ids.round()).all()):
                raise ValueError("Embedding: the model's input must be whole token ids, got a fraction")
        return super().forward(ids.long())


def _last_step(hidden: torch.Tensor, directions: int) -> torch.Tensor:
    """The last layer's final hidden state of each direction, (batch, hidden·directions)."""
    return torch.cat(list(hidden[-directions:]), dim=1)


def _drop_cell_names(module: nn.Module, state: dict[str, Any], prefix: str, _: Any) -> None:
    renames: dict[str, str] = getattr(module, "old_to_new")  # noqa: B009 (Opacus's map, set at run time)
    for old in renames:
        state.pop(prefix + old, None)


def _fill_cell_names(module: nn.Module, state: dict[str, Any], prefix: str, *_: Any) -> None:
    renames: dict[str, str] = getattr(module, "old_to_new")  # noqa: B009
    for old, new in renames.items():
        if prefix + new in state:
            state[prefix + old] = state[prefix + new]


def _sequence_or_last(last: bool, module: nn.Module, _: Any, output: tuple[torch.Tensor, Any]) -> torch.Tensor:
    """A forward hook: the RNN's output sequence, or with `last` its last layer's final hidden state."""
    out, state = output
    if not last:
        return out
    hidden = state[0] if isinstance(state, tuple) else state
    return _last_step(hidden, 2 if module.bidirectional else 1)


def _recurrent(kind: str, p: Mapping[str, Any]) -> nn.Module:
    """Opacus's DPLSTM/DPGRU itself (its exact class, which Opacus's own per-sample machinery looks for), batch
    first, returning the sequence or its last step as `output` asks, by a forward hook."""
    from opacus.layers import DPGRU, DPLSTM

    rnn: nn.Module = (DPLSTM if kind == "LSTM" else DPGRU)(
        p["input_size"], p["hidden_size"], num_layers=p["num_layers"], bias=p["bias"], batch_first=True,
        dropout=p["dropout"], bidirectional=p["bidirectional"])
    rnn.register_forward_hook(functools.partial(_sequence_or_last, p["output"] == "last"))
    # Opacus's hook drops its cells' own names (l0.ih.weight) from a copy of the state_dict, which only works
    # at the top level: inside a model they would travel twice. Drop them in place under any prefix instead,
    # and fill them in on loading.
    rnn._state_dict_hooks.clear()
    rnn.register_state_dict_post_hook(_drop_cell_names)
    rnn.register_load_state_dict_pre_hook(_fill_cell_names)
    return rnn


@functools.cache
def _attention_class() -> type[nn.Module]:
    """Self-attention on Opacus's DPMultiheadAttention: its parts (q/k/v/out Linear layers, attention dropout)
    and its names, with a batch-first forward of ours. Opacus 1.6's own batch_first path reshapes the heads'
    output without moving the heads beside the positions, which mixes heads and positions (a test checks ours
    against torch's nn.MultiheadAttention), and its sequence-first path would put the batch second in every
    Linear, where per-sample clipping looks for it first. The plain nn.Module state_dict: Opacus's rewrites its
    keys into torch's packed in_proj_weight, which would not load back by name."""
    from opacus.layers import DPMultiheadAttention

    class SelfAttention(DPMultiheadAttention):  # type: ignore[misc]
        state_dict = nn.Module.state_dict
        load_state_dict = nn.Module.load_state_dict

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n, length, width = x.shape
            heads = self.num_heads
            size = width // heads

            def split(t: torch.Tensor) -> torch.Tensor:  # (n, positions, width) → (n, heads, positions, size)
                return t.view(n, length, heads, size).transpose(1, 2)

            q, k, v = split(self.qlinear(x) * size ** -0.5), split(self.klinear(x)), split(self.vlinear(x))
            weights = self.dropout(torch.softmax(q @ k.transpose(-2, -1), dim=-1))
            out: torch.Tensor = self.out_proj((weights @ v).transpose(1, 2).reshape(n, length, width))
            return out

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
        out: torch.Tensor = self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, positions, d_model) in and out."""
        if self.norm_first:
            x = x + self.dropout1(self.self_attn(self.norm1(x)))
            out: torch.Tensor = x + self._feed_forward(self.norm2(x))
        else:
            x = self.norm1(x + self.dropout1(self.self_attn(x)))
            out = self.norm2(x + self._feed_forward(x))
        return out


def _batchnorm(dims: int) -> Callable[[Mapping[str, Any]], nn.Module]:
    return lambda p: nn.GroupNorm(batchnorm_groups(p["num_features"], dims), p["num_features"])


# Layer types whose module is not `torch.nn.<torch_class>(**params)`, by type name.
BUILDERS: Mapping[str, Callable[[Mapping[str, Any]], nn.Module]] = {
    "Embedding": lambda p: TokenEmbedding(p["num_embeddings"], p["embedding_dim"]),
    "LSTM": lambda p: _recurrent("LSTM", p),
    "GRU": lambda p: _recurrent("GRU", p),
    "MultiheadAttention": lambda p: self_attention(p["embed_dim"], p["num_heads"], dropout=p["dropout"],
                                                   bias=p["bias"]),
    "TransformerEncoderLayer": lambda p: EncoderLayer(p["d_model"], p["nhead"], p["dim_feedforward"],
                                                      dropout=p["dropout"], activation=p["activation"],
                                                      norm_first=p["norm_first"]),
    "BatchNorm1d": _batchnorm(1), "BatchNorm2d": _batchnorm(2), "BatchNorm3d": _batchnorm(3),
}
