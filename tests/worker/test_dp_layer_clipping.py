"""The one-pass ("bk") clipping on every layer type of the table (`fedbroker.layers`) and on whole models with skip
connections that mix our rules with Opacus's grad samplers (Embedding → encoder layer, Embedding → DPLSTM): each
noise-free update must equal Opacus's own per-sample clipping (GradSampleModule's per-sample gradients, its
DPOptimizer's clip, sum and mean). ConvTranspose has no sampler in Opacus; GradSampleModule forms its per-sample
gradients with functorch (vmap over the layer), which is still Opacus's reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from opacus import GradSampleModule
from opacus.grad_sample.embedding import compute_embedding_grad_sample
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.errors import ConfigError
from fedbroker.job.spec import TrainingConfig, parse_model
from fedbroker.layers import LAYERS
from fedbroker.layers.library import ARCHITECTURES
from fedbroker.layers.modules import TokenEmbedding
from fedbroker.model import build_layer, build_model
from fedbroker.worker import layer_clipping, one_pass_clipping
from fedbroker.worker.clipping import check_supported, clipping_mode, grad_sample_mode
from fedbroker.worker.training import train_local
from tests.layer_examples import NEW_LAYER_EXAMPLES, token_ids
from tests.worker.test_dp_clipping import _engine_update, _reference_update

CASES = [(kind, i) for kind, models in NEW_LAYER_EXAMPLES.items() for i in range(len(models))]


@pytest.fixture(autouse=True)
def _opacus_reads_token_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference needs a sampler for the token-id Embedding: Opacus's nn.Embedding one, on long ids."""
    monkeypatch.setitem(GradSampleModule.GRAD_SAMPLERS, TokenEmbedding,
                        lambda layer, acts, backprops: compute_embedding_grad_sample(layer, [acts[0].long()], backprops))


def _inputs(raw: dict, n: int, seed: int) -> torch.Tensor:
    shape = tuple(raw["input_shape"])
    if raw["layers"][0]["type"] == "Embedding":
        return torch.from_numpy(token_ids(shape, n, seed, raw["layers"][0]["num_embeddings"]))
    return torch.from_numpy(np.random.default_rng(seed).normal(size=(n, *shape)).astype(np.float32))


def _check_against_opacus(make: object, x: torch.Tensor, y: torch.Tensor, *, every_sample_clipped: bool) -> None:
    _, norms = _reference_update(make(), x, y, clip=1e9, expected=4)  # type: ignore[operator]
    clip = float(norms.min()) * 0.9 if every_sample_clipped else float(norms.median())
    reference, _ = _reference_update(make(), x, y, clip=clip, expected=4)  # type: ignore[operator]
    ours = _engine_update(make(), x, y, clipping="bk", clip=clip, expected=4, physical=None)  # type: ignore[operator]
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-6)
    unclipped, _ = _reference_update(make(), x, y, clip=1e9, expected=4)  # type: ignore[operator]
    assert not torch.allclose(ours, unclipped, rtol=1e-3)  # the clipping did bite


def test_every_layer_type_is_clipped_by_bk_or_holds_no_weights() -> None:
    assert {kind.split()[0] for kind in NEW_LAYER_EXAMPLES} | {"Linear", "Conv2d", "MaxPool2d", "AvgPool2d", "Flatten",
                                                                "ReLU", "Tanh", "Sigmoid", "Dropout", "GroupNorm",
                                                                "standardize"} | set(ARCHITECTURES) == set(LAYERS)
    for raws in NEW_LAYER_EXAMPLES.values():
        for raw in raws:
            model = build_model(parse_model(raw), seed=0)
            assert one_pass_clipping.supported(model), raw
            assert clipping_mode(model, expected_batch_size=32) == "bk"


@pytest.mark.parametrize(("kind", "i"), CASES, ids=[f"{k}-{i}" for k, i in CASES])
def test_bk_on_each_layer_type_equals_opacus_reference(kind: str, i: int) -> None:
    raw = NEW_LAYER_EXAMPLES[kind][i]
    spec = parse_model(raw)
    x = _inputs(raw, 7, seed=i + 1)
    y = torch.arange(7) % 3
    _check_against_opacus(lambda: build_model(spec, seed=3).train(), x, y, every_sample_clipped=False)
    _check_against_opacus(lambda: build_model(spec, seed=4).train(), x[:2], y[:2], every_sample_clipped=True)


def test_bk_forms_conv_and_embedding_norms_in_chunks_of_one_sample_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layer_clipping, "CHUNK_FLOATS", 1)
    for kind in ("Conv1d", "Conv3d", "ConvTranspose2d", "ConvTranspose3d", "Embedding"):
        raw = NEW_LAYER_EXAMPLES[kind][0]
        spec = parse_model(raw)
        _check_against_opacus(lambda: build_model(spec, seed=1), _inputs(raw, 5, 2), torch.arange(5) % 3,
                              every_sample_clipped=True)


def test_bk_takes_conv_ghost_norms_and_per_sample_gradients_where_each_is_cheaper(monkeypatch: pytest.MonkeyPatch):
    choices: list[bool] = []
    real = layer_clipping._ghost_cheaper
    monkeypatch.setattr(layer_clipping, "_ghost_cheaper", lambda *a: choices.append(real(*a)) or choices[-1])
    _check_against_opacus(lambda: _unet(0), torch.randn(5, 2, 8, 8), torch.arange(5) % 3, every_sample_clipped=False)
    assert set(choices) == {True, False}


class _TinyUNet(nn.Module):
    """Two levels, a transposed convolution up and a concatenated skip, BatchNorm spelt (trains as GroupNorm),
    Upsample beside the transposed path, a Conv1d over rows and a deep 3×3 layer with few positions (ghost norm)."""

    def __init__(self) -> None:
        super().__init__()
        conv = {"kernel_size": 3, "padding": 1}
        self.down = build_layer("Conv2d", {**conv, "in_channels": 2, "out_channels": 4, "stride": 1, "bias": False})
        self.norm = build_layer("BatchNorm2d", {"num_features": 4})
        self.pool = build_layer("MaxPool2d", {"kernel_size": 2, "stride": None})
        self.deep = build_layer("Conv2d", {**conv, "in_channels": 4, "out_channels": 64, "stride": 2, "bias": True})
        self.up = build_layer("ConvTranspose2d", {"in_channels": 64, "out_channels": 4, "kernel_size": 4, "stride": 4,
                                                  "padding": 0, "output_padding": 0, "bias": True})
        self.resample = build_layer("Upsample", {"scale_factor": 2, "mode": "nearest"})
        self.mix = build_layer("Conv2d", {**conv, "in_channels": 12, "out_channels": 4, "stride": 1, "bias": True})
        self.rows = build_layer("Conv1d", {**conv, "in_channels": 4, "out_channels": 2, "stride": 1, "bias": True})
        self.head = build_layer("Linear", {"in_features": 2 * 64, "out_features": 3, "bias": True})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.norm(self.down(x)))                     # (4, 8, 8)
        low = self.pool(skip)                                          # (4, 4, 4)
        up = self.up(torch.relu(self.deep(low)))                       # (4, 8, 8)
        h = torch.relu(self.mix(torch.cat([skip, up, self.resample(low)], dim=1)))
        return self.head(self.rows(h.flatten(2)).flatten(1))


def _unet(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _TinyUNet()


class _TextModel(nn.Module):
    """Token ids → Embedding → encoder layer with a skip around it → DP LSTM (Opacus's samplers) → LayerNorm →
    Linear, the embedding's second use (the first token) added to the head's input: bk rules and Opacus's grad
    samplers in one pass, a skip connection and a layer used twice."""

    def __init__(self, vocabulary: int = 13) -> None:
        super().__init__()
        self.embed = build_layer("Embedding", {"num_embeddings": vocabulary, "embedding_dim": 8})
        self.encoder = build_layer("TransformerEncoderLayer", {"d_model": 8, "nhead": 2, "dim_feedforward": 16,
                                                               "dropout": 0.0, "activation": "gelu", "norm_first": True})
        self.rnn = build_layer("LSTM", {"input_size": 8, "hidden_size": 8, "num_layers": 1, "bias": True,
                                        "bidirectional": True, "dropout": 0.0, "output": "last"})
        self.norm = build_layer("LayerNorm", {"normalized_shape": 16})
        self.head = build_layer("Linear", {"in_features": 16, "out_features": 3, "bias": True})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.encoder(h)
        first = self.embed(x[:, :1]).flatten(1)
        return self.head(self.norm(self.rnn(h)) + torch.cat([first, first], dim=1))


def _text(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _TextModel()


@pytest.mark.parametrize("every_sample_clipped", [False, True])
@pytest.mark.parametrize("name", ["unet", "text"])
def test_bk_on_whole_models_with_skips_equals_opacus_reference(name: str, every_sample_clipped: bool) -> None:
    make = {"unet": _unet, "text": _text}[name]
    x = torch.randn(6, 2, 8, 8) if name == "unet" else torch.from_numpy(token_ids((6,), 6, 1, 13))
    y = torch.arange(6) % 3
    assert clipping_mode(make(0), expected_batch_size=32) == "bk"
    _check_against_opacus(lambda: make(2), x, y, every_sample_clipped=every_sample_clipped)


def test_a_model_bk_cannot_clip_is_refused_naming_its_layer() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.LSTM(4, 4), nn.Conv2d(1, 1, 3, dilation=2))
    with pytest.raises(ConfigError) as info:
        check_supported(model, "bk")
    assert "1 (LSTM)" in str(info.value) and "0 (Linear)" not in str(info.value)
    assert layer_clipping.unclippable(nn.Sequential(nn.Conv3d(1, 1, 3, dilation=2)), one_pass_clipping.LAYERS) == \
        ["0 (Conv3d)"]
    transposed = build_model(parse_model(NEW_LAYER_EXAMPLES["ConvTranspose2d"][0]), seed=0)
    check_supported(transposed, "bk")
    check_supported(transposed, "ew")  # ExpandedWeights has no rule for it: "ew" runs Opacus's hooks instead
    assert grad_sample_mode(transposed) == "hooks"


@pytest.mark.parametrize("kind", ["LSTM", "TransformerEncoderLayer"])
def test_a_text_model_trains_under_dp_with_bk_from_float_token_ids(kind: str) -> None:
    raw = NEW_LAYER_EXAMPLES[kind][0]
    model = build_model(parse_model(raw), seed=0)
    x = token_ids(tuple(raw["input_shape"]), 64, 0)
    y = (x[:, 0] % 3).astype(np.int64)
    config = TrainingConfig(rounds=1, local_epochs=2, batch_size=16, lr=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train_local(model, x, y, config=config, seed=1,
                         dp=DPPolicy(noise_multiplier=0.5, max_grad_norm=1.0, delta=1e-5, epsilon_budget=1e3))
    assert result.clipping == "bk" and np.isfinite(result.train_loss) and result.epsilon
    assert set(result.state) == set(before)
    assert any(not torch.equal(before[k], torch.from_numpy(v)) for k, v in result.state.items())
