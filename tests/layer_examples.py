"""One or more small chain models per layer type added with issue 32's layer wing, each ending in class scores:
the kernel's table tests (shapes and tensors agree with torch) and the worker's DP tests (bk clips each as
Opacus does) read the same models. `tests/kernel/test_spec.py` holds the older types' examples."""

from __future__ import annotations

from typing import Any


def _lin(i: int, o: int = 3) -> dict[str, Any]:
    return {"type": "Linear", "in_features": i, "out_features": o}


FLAT = {"type": "Flatten"}
CONV1 = {"type": "Conv1d", "in_channels": 2, "out_channels": 3, "kernel_size": 3, "padding": 1}
CONV2 = {"type": "Conv2d", "in_channels": 2, "out_channels": 3, "kernel_size": 3, "padding": 1}
CONV3 = {"type": "Conv3d", "in_channels": 2, "out_channels": 3, "kernel_size": 3, "padding": 1}
EMBED = {"type": "Embedding", "num_embeddings": 11, "embedding_dim": 8}

NEW_LAYER_EXAMPLES: dict[str, list[dict[str, Any]]] = {
    "Linear on a sequence": [{"input_shape": [5, 4], "layers": [_lin(4, 6), {"type": "ReLU"}, FLAT, _lin(30)]}],
    "Conv1d": [{"input_shape": [2, 9], "layers": [CONV1, FLAT, _lin(27)]},
               {"input_shape": [2, 9], "layers": [
                   {"type": "Conv1d", "in_channels": 2, "out_channels": 4, "kernel_size": 2, "stride": 2,
                    "bias": False}, FLAT, _lin(16)]}],
    "Conv3d": [{"input_shape": [2, 4, 4, 4], "layers": [CONV3, FLAT, _lin(192)]},
               {"input_shape": [2, 5, 5, 5], "layers": [
                   {"type": "Conv3d", "in_channels": 2, "out_channels": 2, "kernel_size": 2, "stride": 2,
                    "bias": False}, FLAT, _lin(16)]}],
    "ConvTranspose2d": [{"input_shape": [2, 3, 3], "layers": [
        {"type": "ConvTranspose2d", "in_channels": 2, "out_channels": 3, "kernel_size": 2, "stride": 2}, FLAT,
        _lin(108)]},
        {"input_shape": [2, 3, 3], "layers": [
            {"type": "ConvTranspose2d", "in_channels": 2, "out_channels": 2, "kernel_size": 3, "stride": 2,
             "padding": 1, "output_padding": 1, "bias": False}, FLAT, _lin(72)]}],
    "ConvTranspose3d": [{"input_shape": [2, 2, 2, 2], "layers": [
        {"type": "ConvTranspose3d", "in_channels": 2, "out_channels": 2, "kernel_size": 2, "stride": 2}, FLAT,
        _lin(128)]}],
    "Upsample": [{"input_shape": [2, 3, 3], "layers": [{"type": "Upsample", "scale_factor": 2}, CONV2, FLAT,
                                                       _lin(108)]},
                 {"input_shape": [2, 3, 3], "layers": [{"type": "Upsample", "scale_factor": 2, "mode": "bilinear"},
                                                       CONV2, FLAT, _lin(108)]},
                 {"input_shape": [2, 4], "layers": [{"type": "Upsample", "scale_factor": 3, "mode": "linear"}, CONV1,
                                                    FLAT, _lin(36)]},
                 {"input_shape": [2, 2, 2, 2], "layers": [{"type": "Upsample", "scale_factor": 2,
                                                           "mode": "trilinear"}, CONV3, FLAT, _lin(192)]}],
    "AdaptiveAvgPool1d": [{"input_shape": [2, 9], "layers": [CONV1, {"type": "AdaptiveAvgPool1d", "output_size": 1},
                                                             FLAT, _lin(3)]}],
    "AdaptiveAvgPool2d": [{"input_shape": [2, 5, 5], "layers": [CONV2, {"type": "AdaptiveAvgPool2d", "output_size": 2},
                                                                FLAT, _lin(12)]}],
    "AdaptiveAvgPool3d": [{"input_shape": [2, 4, 4, 4], "layers": [
        CONV3, {"type": "AdaptiveAvgPool3d", "output_size": 1}, FLAT, _lin(3)]}],
    "MaxPool3d": [{"input_shape": [2, 4, 4, 4], "layers": [CONV3, {"type": "MaxPool3d", "kernel_size": 2}, FLAT,
                                                           _lin(24)]}],
    "MaxPool1d": [{"input_shape": [2, 9], "layers": [CONV1, {"type": "MaxPool1d", "kernel_size": 3}, FLAT, _lin(9)]}],
    "AvgPool1d": [{"input_shape": [2, 9], "layers": [CONV1, {"type": "AvgPool1d", "kernel_size": 2, "stride": 1},
                                                     FLAT, _lin(24)]}],
    "BatchNorm1d": [{"input_shape": [6], "layers": [_lin(6, 6), {"type": "BatchNorm1d", "num_features": 6},
                                                    _lin(6)]},
                    {"input_shape": [2, 9], "layers": [CONV1, {"type": "BatchNorm1d", "num_features": 3}, FLAT,
                                                       _lin(27)]}],
    "BatchNorm2d": [{"input_shape": [2, 5, 5], "layers": [
        {"type": "Conv2d", "in_channels": 2, "out_channels": 6, "kernel_size": 3, "padding": 1},
        {"type": "BatchNorm2d", "num_features": 6}, {"type": "ReLU"}, FLAT, _lin(150)]}],
    "BatchNorm3d": [{"input_shape": [2, 4, 4, 4], "layers": [CONV3, {"type": "BatchNorm3d", "num_features": 3}, FLAT,
                                                             _lin(192)]}],
    "LayerNorm": [{"input_shape": [5, 4], "layers": [_lin(4, 6), {"type": "LayerNorm", "normalized_shape": 6}, FLAT,
                                                     _lin(30)]},
                  {"input_shape": [6], "layers": [{"type": "LayerNorm", "normalized_shape": 6}, _lin(6)]}],
    "Embedding": [{"input_shape": [5], "layers": [EMBED, FLAT, _lin(40)]}],
    "LSTM": [{"input_shape": [5], "layers": [
        EMBED, {"type": "LSTM", "input_size": 8, "hidden_size": 6, "output": "last"}, _lin(6)]},
        {"input_shape": [4, 3], "layers": [
            {"type": "LSTM", "input_size": 3, "hidden_size": 4, "num_layers": 2, "bidirectional": True,
             "bias": False}, FLAT, _lin(32)]}],
    "GRU": [{"input_shape": [5], "layers": [
        EMBED, {"type": "GRU", "input_size": 8, "hidden_size": 6, "bidirectional": True, "output": "last"},
        _lin(12)]},
        {"input_shape": [4, 3], "layers": [{"type": "GRU", "input_size": 3, "hidden_size": 4}, FLAT, _lin(16)]}],
    "MultiheadAttention": [{"input_shape": [5, 8], "layers": [
        {"type": "MultiheadAttention", "embed_dim": 8, "num_heads": 2}, FLAT, _lin(40)]},
        {"input_shape": [5], "layers": [EMBED, {"type": "MultiheadAttention", "embed_dim": 8, "num_heads": 4,
                                                "bias": False}, FLAT, _lin(40)]}],
    "TransformerEncoderLayer": [{"input_shape": [5], "layers": [
        EMBED, {"type": "TransformerEncoderLayer", "d_model": 8, "nhead": 2, "dim_feedforward": 16, "dropout": 0.0},
        FLAT, _lin(40)]},
        {"input_shape": [5, 8], "layers": [
            {"type": "TransformerEncoderLayer", "d_model": 8, "nhead": 4, "dim_feedforward": 12,
             "activation": "gelu", "norm_first": True}, FLAT, _lin(40)]}],
    "GELU": [{"input_shape": [4], "layers": [_lin(4, 5), {"type": "GELU"}, _lin(5)]},
             {"input_shape": [4], "layers": [_lin(4, 5), {"type": "GELU", "approximate": "tanh"}, _lin(5)]}],
    "SiLU": [{"input_shape": [4], "layers": [_lin(4, 5), {"type": "SiLU"}, _lin(5)]}],
    "LeakyReLU": [{"input_shape": [4], "layers": [_lin(4, 5), {"type": "LeakyReLU", "negative_slope": 0.2}, _lin(5)]}],
    "Softmax": [{"input_shape": [4], "layers": [_lin(4, 5), {"type": "Softmax"}, _lin(5)]},
                {"input_shape": [5, 4], "layers": [_lin(4, 6), {"type": "Softmax", "dim": -2}, FLAT, _lin(30)]}],
    "Identity": [{"input_shape": [4], "layers": [{"type": "Identity"}, _lin(4)]}],
}


def token_ids(shape: tuple[int, ...], n: int, seed: int, vocabulary: int = 11) -> Any:
    """Integer token ids as float32 features, as a site's data carries them."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, vocabulary, size=(n, *shape)).astype(np.float32)
