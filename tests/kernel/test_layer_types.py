"""The layer wing (`fedbroker.layers`): each new type's shape rule names what is wrong, its weights load back by name,
its torch module computes what the type says (the encoder layer as torch's, an RNN's last step as its final
state), BatchNorm is a GroupNorm spelling with a stated group count, and the table imports no torch."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.spec import parse_model
from fedbroker.layers import LAYERS, batchnorm_groups
from fedbroker.model import build_layer, build_model, load_numpy_state, state_to_numpy
from tests.layer_examples import NEW_LAYER_EXAMPLES

CASES = [(kind, i) for kind, models in NEW_LAYER_EXAMPLES.items() for i in range(len(models))]


def test_the_layer_table_imports_no_torch() -> None:
    probe = "import sys, fedbroker.layers, fedbroker.job.spec; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(("kind", "i"), CASES, ids=[f"{k}-{i}" for k, i in CASES])
def test_each_new_layer_types_weights_travel_by_name_and_load_back(kind: str, i: int) -> None:
    spec = parse_model(NEW_LAYER_EXAMPLES[kind][i])
    state = state_to_numpy(build_model(spec, seed=1))
    other = build_model(spec, seed=2)
    load_numpy_state(other, state)
    assert all((state_to_numpy(other)[k] == v).all() for k, v in state.items())


@pytest.mark.parametrize(("layers", "shape", "where", "text"), [
    ([{"type": "Linear", "in_features": 4, "out_features": 2}], [2, 3, 4], "model.layers[0]",
     "Linear needs a flat input or a (sequence, features) one but receives shape [2, 3, 4]; add a Flatten"),
    ([{"type": "Linear", "in_features": 3, "out_features": 2}], [5, 4], "model.layers[0].in_features",
     "is 3 but the previous layer outputs 4 features per position"),
    ([{"type": "Embedding", "num_embeddings": 9, "embedding_dim": 4}], [2, 5], "model.layers[0]",
     "Embedding reads the model's input as a sequence of token ids, input_shape [length], but receives [2, 5]"),
    ([{"type": "Conv3d", "in_channels": 2, "out_channels": 2, "kernel_size": 3}], [2, 5, 5], "model.layers[0]",
     "Conv3d needs a (channels, depth, height, width) input but receives [2, 5, 5]"),
    ([{"type": "Conv1d", "in_channels": 2, "out_channels": 2, "kernel_size": 9}], [2, 5], "model.layers[0].kernel_size",
     "9 is larger than the padded input [5]"),
    ([{"type": "ConvTranspose2d", "in_channels": 2, "out_channels": 2, "kernel_size": 2, "stride": 2,
       "output_padding": 2}], [2, 3, 3], "model.layers[0].output_padding", "2 must be smaller than stride 2"),
    ([{"type": "Upsample", "scale_factor": 2, "mode": "bilinear"}], [2, 5], "model.layers[0].mode",
     "bilinear interpolates 2 spatial axes but the input [2, 5] has 1; use linear or nearest"),
    ([{"type": "MultiheadAttention", "embed_dim": 6, "num_heads": 4}], [3, 6], "model.layers[0].num_heads",
     "4 does not divide embed_dim 6"),
    ([{"type": "LSTM", "input_size": 4, "hidden_size": 3}], [5, 6], "model.layers[0].input_size",
     "is 4 but the input has 6 features per position"),
    ([{"type": "GRU", "input_size": 4, "hidden_size": 3}], [4], "model.layers[0]",
     "GRU needs a (positions, features) input but receives [4]"),
    ([{"type": "BatchNorm2d", "num_features": 3}], [3, 4], "model.layers[0]",
     "BatchNorm2d needs a (channels, height, width) input but receives [3, 4]"),
    ([{"type": "LayerNorm", "normalized_shape": 5}], [3, 4], "model.layers[0].normalized_shape",
     "is 5 but the input has 4 features on its last axis"),
    ([{"type": "Softmax", "dim": -3}], [3, 4], "model.layers[0].dim",
     "-3 names an axis the input [3, 4] does not have (counted from the last, -1 .. -2)"),
    ([{"type": "AdaptiveAvgPool2d", "output_size": 2}], [3, 4], "model.layers[0]",
     "AdaptiveAvgPool2d needs a (channels, height, width) input but receives [3, 4]"),
])
def test_a_layer_that_cannot_take_its_input_is_named_with_the_reason(layers, shape, where, text) -> None:
    with pytest.raises((ConfigError, ConfigErrors)) as info:
        parse_model({"input_shape": shape, "layers": [*layers, {"type": "Flatten"}]})
    assert f"{where}: {text}" in str(info.value)


def test_every_bad_parameter_of_the_new_types_is_named_at_once() -> None:
    layers = [{"type": "Embedding", "num_embeddings": 2 ** 21, "embedding_dim": 4},
              {"type": "LSTM", "input_size": 4, "hidden_size": 4, "num_layers": 9, "output": "all"},
              {"type": "Upsample", "scale_factor": 100, "mode": "bicubic"},
              {"type": "LeakyReLU", "negative_slope": float("nan")},
              {"type": "MultiheadAttention", "embed_dim": 4, "num_heads": 0}]
    with pytest.raises(ConfigErrors) as info:
        parse_model({"input_shape": [3], "layers": layers})
    assert [str(e) for e in info.value.errors] == [
        "model.layers[0].num_embeddings: must be an integer in [1, 1.04858e+06], got 2097152",
        "model.layers[1].num_layers: must be an integer in [1, 8], got 9",
        "model.layers[1].output: must be one of sequence, last, got 'all'",
        "model.layers[2].scale_factor: must be an integer in [1, 16], got 100",
        "model.layers[2].mode: must be one of nearest, linear, bilinear, trilinear, got 'bicubic'",
        "model.layers[3].negative_slope: must be a number in [0, 1], got nan",
        "model.layers[4].num_heads: must be an integer in [1, 64], got 0"]


@pytest.mark.parametrize(("channels", "dims", "groups"), [(64, 2, 32), (48, 2, 24), (3, 2, 3), (96, 3, 32),
                                                          (7, 3, 7), (64, 1, 1)])
def test_batchnorm_trains_as_groupnorm_with_the_stated_group_count(channels: int, dims: int, groups: int) -> None:
    assert batchnorm_groups(channels, dims) == groups
    entry = LAYERS[f"BatchNorm{dims}d"]
    assert entry.trains_as == "GroupNorm" and entry.folds_at_alignment and entry.blocks_alignment
    assert entry.substitution is not None
    assert entry.substitution({"num_features": channels}) == \
        f"BatchNorm{dims}d({channels}) trains as GroupNorm({groups}, {channels})"
    module = build_layer(f"BatchNorm{dims}d", {"num_features": channels})
    assert isinstance(module, nn.GroupNorm) and (module.num_groups, module.num_channels) == (groups, channels)
    assert set(module.state_dict()) == {"weight", "bias"}  # no running statistics travel


def test_the_encoder_layer_computes_what_torchs_encoder_layer_computes() -> None:
    for norm_first, activation in ((False, "relu"), (True, "gelu")):
        ours = build_layer("TransformerEncoderLayer", {"d_model": 8, "nhead": 2, "dim_feedforward": 16, "dropout": 0.0,
                                                       "activation": activation, "norm_first": norm_first}).eval()
        theirs = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation=activation, batch_first=True,
                                            norm_first=norm_first).eval()
        state = ours.state_dict()
        packed = {"self_attn.in_proj_weight": torch.cat([state[f"self_attn.{n}linear.weight"] for n in "qkv"]),
                  "self_attn.in_proj_bias": torch.cat([state[f"self_attn.{n}linear.bias"] for n in "qkv"])}
        theirs.load_state_dict({**{k: v for k, v in state.items() if "linear." not in k or "self_attn" not in k},
                                **packed})
        x = torch.randn(3, 5, 8)
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_an_rnn_computes_torchs_rnn_and_its_last_step_is_each_directions_final_state(kind: str) -> None:
    params = {"input_size": 3, "hidden_size": 4, "num_layers": 2, "bias": True, "bidirectional": True, "dropout": 0.0}
    sequence = build_layer(kind, {**params, "output": "sequence"}).eval()
    last = build_layer(kind, {**params, "output": "last"}).eval()
    last.load_state_dict(sequence.state_dict())
    reference = getattr(nn, kind)(3, 4, num_layers=2, bidirectional=True, batch_first=True).eval()
    reference.load_state_dict(sequence.state_dict())  # torch's names, so torch's module loads them
    x = torch.randn(2, 5, 3)
    out, _ = reference(x)
    torch.testing.assert_close(sequence(x), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last(x), torch.cat([out[:, -1, :4], out[:, 0, 4:]], dim=1), rtol=1e-5, atol=1e-5)


def test_an_embedding_reads_float_token_ids_and_refuses_ids_outside_its_vocabulary() -> None:
    layer = build_layer("Embedding", {"num_embeddings": 5, "embedding_dim": 2})
    torch.testing.assert_close(layer(torch.tensor([[0.0, 4.0]])), layer.weight[[0, 4]].unsqueeze(0))
    for bad, text in ((5.0, "a token id is outside [0, 5)"), (-1.0, "a token id is outside [0, 5)"),
                      (1.5, "whole token ids")):
        with pytest.raises(ValueError, match=re.escape(text)):
            layer(torch.tensor([[0.0, bad]]))



def test_self_attention_computes_what_torchs_multihead_attention_computes() -> None:
    ours = build_layer("MultiheadAttention", {"embed_dim": 8, "num_heads": 2, "dropout": 0.0, "bias": True}).eval()
    theirs = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    state = ours.state_dict()
    theirs.load_state_dict({"in_proj_weight": torch.cat([state[f"{n}linear.weight"] for n in "qkv"]),
                            "in_proj_bias": torch.cat([state[f"{n}linear.bias"] for n in "qkv"]),
                            "out_proj.weight": state["out_proj.weight"], "out_proj.bias": state["out_proj.bias"]})
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(ours(x), theirs(x, x, x, need_weights=False)[0], rtol=1e-5, atol=1e-5)


def test_the_docs_layer_table_has_a_row_for_every_type() -> None:
    """docs/models.md's "Layer types" table names every type of the table, and nothing the table lacks."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text(encoding="utf-8")
    section = text.split("## Layer types", 1)[1].split("\n## ", 1)[0]
    named: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            for cell in line.split("|")[1].split(","):
                name = cell.strip().strip("`")
                family, _, dims = name.partition("/")  # "MaxPool1d/2d/3d"
                named |= {name} if not dims else {family, *(family[:-2] + d for d in name.split("/")[1:])}
    assert named == set(LAYERS)


def test_alignment_refuses_the_new_layers_it_cannot_permute_naming_each() -> None:
    from fedbroker.job.submission import alignment_problems

    for kind in ("Conv1d", "Conv3d", "ConvTranspose2d", "Embedding", "LSTM", "MultiheadAttention", "BatchNorm2d"):
        problems = alignment_problems(parse_model(NEW_LAYER_EXAMPLES[kind][0]))
        assert any(f"is {kind}: " in p for p in problems), (kind, problems)
    (problem, *_) = alignment_problems(parse_model(NEW_LAYER_EXAMPLES["Linear on a sequence"][0]))
    assert problem.startswith("layer 0 is a Linear on a sequence [5, 4]")
    assert alignment_problems(parse_model(NEW_LAYER_EXAMPLES["Upsample"][0])) == []  # Upsample passes, Conv2d matched
