"""Training with frozen parameters (the layer-wise mode's matched layers): under every clipping mode and without
DP, a frozen tensor comes back bit for bit as it went in, gets no noise, and the others still train."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.errors import ConfigError
from fedbroker.job.spec import TrainingConfig
from fedbroker.worker.training import train_local

POLICY = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)
FROZEN = ("0.weight", "0.bias", "1.weight", "1.bias")


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(4, 4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64, 10))


def data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, size=n)


@pytest.mark.parametrize("clipping", ["bk", "ghost", "ew", None])
def test_frozen_parameters_come_back_unchanged_and_the_rest_trains(clipping: str | None) -> None:
    model = cnn()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x, y = data()
    config = TrainingConfig(rounds=1, local_epochs=1, batch_size=16, lr=0.5, optimizer="sgd", momentum=0.9)
    result = train_local(model, x, y, config=config, dp=POLICY if clipping else None, seed=3,
                         clipping=clipping or "auto", frozen=FROZEN)
    for name in FROZEN:
        np.testing.assert_array_equal(result.state[name], before[name].numpy())
    assert not np.allclose(result.state["5.weight"], before["5.weight"].numpy())
    assert all(p.requires_grad for p in model.parameters())  # the caller's module is left trainable


def test_a_frozen_name_the_model_lacks_is_refused() -> None:
    x, y = data()
    with pytest.raises(ConfigError, match="frozen: names parameters the model does not have: 9.weight"):
        train_local(cnn(), x, y, config=TrainingConfig(), dp=None, frozen=("9.weight",))


def test_freezing_every_parameter_is_refused() -> None:
    x, y = data()
    every = tuple(name for name, _ in cnn().named_parameters())
    with pytest.raises(ConfigError, match="nothing to train"):
        train_local(cnn(), x, y, config=TrainingConfig(), dp=POLICY, frozen=every)
