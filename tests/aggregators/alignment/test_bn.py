"""BatchNorm folded into the preceding layer computes what layer → BatchNorm computes in eval mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedbroker.aggregators.alignment import Layer, fold_batchnorm, fold_batchnorm_layer


def _randomise_bn(bn: nn.modules.batchnorm._BatchNorm, gen: torch.Generator) -> None:
    n = bn.num_features
    with torch.no_grad():
        bn.weight.copy_(torch.randn(n, generator=gen))
        bn.bias.copy_(torch.randn(n, generator=gen))
        bn.running_mean.copy_(torch.randn(n, generator=gen))
        bn.running_var.copy_(torch.rand(n, generator=gen) * 3 + 0.05)


def _bn_params(bn: nn.modules.batchnorm._BatchNorm) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    gamma, beta, mean, var = (t.detach().numpy() for t in (bn.weight, bn.bias, bn.running_mean, bn.running_var))
    return gamma, beta, mean, var


@pytest.mark.parametrize("with_bias", [True, False])
def test_folded_conv_matches_torch_conv_batchnorm_in_eval_mode(with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, padding=1, bias=with_bias)
    bn = nn.BatchNorm2d(5, eps=1e-3)
    _randomise_bn(bn, gen)
    model = nn.Sequential(conv, bn).double().eval()
    x = torch.randn(4, 3, 8, 8, generator=gen, dtype=torch.float64)
    expected = model(x).detach().numpy()

    conv_bias = conv.bias.detach().numpy() if with_bias else None
    weight, bias = fold_batchnorm(conv.weight.detach().numpy(), conv_bias, *_bn_params(bn), eps=bn.eps)
    folded = nn.Conv2d(3, 5, 3, padding=1).double()
    with torch.no_grad():
        folded.weight.copy_(torch.from_numpy(weight))
        folded.bias.copy_(torch.from_numpy(bias))
    np.testing.assert_allclose(folded(x).detach().numpy(), expected, rtol=0, atol=1e-6)


def test_folded_dense_matches_torch_linear_batchnorm1d_in_eval_mode() -> None:
    gen = torch.Generator().manual_seed(1)
    linear = nn.Linear(6, 4)
    bn = nn.BatchNorm1d(4)
    _randomise_bn(bn, gen)
    model = nn.Sequential(linear, bn).double().eval()
    x = torch.randn(9, 6, generator=gen, dtype=torch.float64)
    layer = fold_batchnorm_layer(
        Layer(linear.weight.detach().numpy(), linear.bias.detach().numpy()), *_bn_params(bn), eps=bn.eps
    )
    got = x.numpy() @ layer.weight.T + layer.bias
    np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=0, atol=1e-6)


def test_fold_rejects_parameters_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="running_var"):
        fold_batchnorm(np.ones((3, 2, 1, 1)), None, np.ones(3), np.zeros(3), np.zeros(3), np.ones(4))


def test_fold_rejects_a_non_positive_variance() -> None:
    with pytest.raises(ValueError, match="positive"):
        fold_batchnorm(np.ones((2, 2)), None, np.ones(2), np.zeros(2), np.zeros(2), np.array([1.0, -1.0]), eps=0.0)
