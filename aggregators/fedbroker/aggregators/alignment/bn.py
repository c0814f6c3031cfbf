"""BatchNorm folded into the preceding conv (or dense) layer, so matching sees one neuron per channel.

NAFI Appendix E: in eval mode BN is the per-channel affine map γ·(f − μ)/√(σ² + ε) + β, hence
W' = W·s and b' = (b − μ)·s + β with s = γ/√(σ² + ε); the folded layer's outputs equal conv→BN's.
"""

from __future__ import annotations

import numpy as np

from fedbroker.aggregators.alignment.base import Layer


def fold_batchnorm(
    conv_weight: np.ndarray,
    conv_bias: np.ndarray | None,
    gamma: np.ndarray,
    beta: np.ndarray,
    running_mean: np.ndarray,
    running_var: np.ndarray,
    eps: float = 1e-5,
) -> tuple[np.ndarray, np.ndarray]:
    """(weight, bias) of the single layer equal to layer → BatchNorm in eval mode."""
    w = np.asarray(conv_weight, dtype=np.float64)
    n = w.shape[0]
    params = {"gamma": gamma, "beta": beta, "running_mean": running_mean, "running_var": running_var}
    arrays = {}
    for name, value in params.items():
        arr = np.asarray(value, dtype=np.float64)
        if arr.shape != (n,):
            raise ValueError(f"{name} has shape {arr.shape}; the layer has {n} output channels")
        arrays[name] = arr
    bias = np.zeros(n) if conv_bias is None else np.asarray(conv_bias, dtype=np.float64)
    if bias.shape != (n,):
        raise ValueError(f"conv_bias has shape {bias.shape}; the layer has {n} output channels")
    denom = arrays["running_var"] + float(eps)
    if np.any(denom <= 0):
        raise ValueError("running_var + eps must be positive")
    scale = arrays["gamma"] / np.sqrt(denom)
    folded_w = w * scale.reshape((n,) + (1,) * (w.ndim - 1))
    folded_b = (bias - arrays["running_mean"]) * scale + arrays["beta"]
    return folded_w, folded_b


def fold_batchnorm_layer(
    layer: Layer,
    gamma: np.ndarray,
    beta: np.ndarray,
    running_mean: np.ndarray,
    running_var: np.ndarray,
    eps: float = 1e-5,
) -> Layer:
    """`fold_batchnorm` for a Layer."""
    weight, bias = fold_batchnorm(layer.weight, layer.bias, gamma, beta, running_mean, running_var, eps)
    return Layer(weight, bias)
