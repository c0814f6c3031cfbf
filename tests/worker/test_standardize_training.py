"""A model whose first layer is `standardize` trains as any other, DP included: the layer holds no parameters,
so Opacus's GradSampleModule and every clipping mode take the model, the weights it returns are the model's
state dict without mean or std, and its per-sample clipping matches Opacus's reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.job.spec import TrainingConfig, parameter_shapes, parse_model
from fedbroker.model import Standardize, build_model
from fedbroker.worker.training import train_local

POLICY = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)
MEAN, STD = [5.0] * 63 + [-3.0], 4.0
SPEC = parse_model({"input_shape": [1, 8, 8], "layers": [
    {"type": "standardize", "mean": MEAN, "std": STD},
    {"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": 3, "padding": 1},
    {"type": "GroupNorm", "num_groups": 2, "num_channels": 4}, {"type": "ReLU"}, {"type": "Flatten"},
    {"type": "Linear", "in_features": 256, "out_features": 10}]})


def data(n: int = 120) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (5.0 + 4.0 * rng.normal(size=(n, 1, 8, 8))).astype(np.float32), rng.integers(0, 10, size=n)


@pytest.mark.parametrize("clipping", ["bk", "ghost", "ew"])
def test_dp_training_runs_through_a_standardize_layer_in_every_clipping_mode(clipping: str) -> None:
    model = build_model(SPEC, seed=0)
    x, y = data()
    result = train_local(model, x, y, config=TrainingConfig(rounds=1, batch_size=16, lr=0.05), dp=POLICY,
                         seed=1, clipping=clipping)
    assert result.epsilon is not None and result.epsilon > 0 and result.clipping == clipping
    assert {k: v.shape for k, v in result.state.items()} == parameter_shapes(SPEC)  # no mean, no std
    assert np.isfinite(result.train_loss)
    standardize = model[0]
    assert isinstance(standardize, Standardize) and float(standardize.std) == STD  # untouched by training
    torch.testing.assert_close(standardize.mean, torch.tensor(MEAN))


def test_opacus_grad_sample_module_takes_the_model_and_clips_per_sample() -> None:
    """GradSampleModule computes per-sample gradients through the layer, equal to one backward per sample."""
    from opacus import GradSampleModule

    model = build_model(SPEC, seed=0).double()
    x, y = data(5)
    xt, yt = torch.from_numpy(x).double(), torch.from_numpy(y)
    wrapped = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    nn.functional.cross_entropy(wrapped(xt), yt, reduction="sum").backward()
    per_sample = {name: p.grad_sample.clone() for name, p in wrapped.named_parameters()}
    wrapped.cleanup()
    for i in range(len(y)):
        single = build_model(SPEC, seed=0).double()
        nn.functional.cross_entropy(single(xt[i:i + 1]), yt[i:i + 1], reduction="sum").backward()
        for name, p in single.named_parameters():
            torch.testing.assert_close(per_sample[f"_module.{name}"][i], p.grad)
