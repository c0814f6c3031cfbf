"""A model graph (skips, blocks, add and concat) trains under DP in every clipping mode the worker can pick for it,
and each mode releases exactly Opacus's reference per-sample-clipped update (noise off)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.job.spec import TrainingConfig, parse_model
from fedbroker.model import GraphModel, build_model
from fedbroker.worker.clipping import check_supported, clipping_mode, dp_engine
from fedbroker.worker.training import train_local

GRAPH = {
    "input_shape": [1, 8, 8],
    "blocks": {"res": {
        "params": ["c"],
        "nodes": {
            "conv1": {"type": "Conv2d", "in_channels": "$c", "out_channels": "$c", "kernel_size": 3, "padding": 1,
                      "bias": False},
            "norm": {"type": "GroupNorm", "num_groups": 2, "num_channels": "$c"},
            "relu": {"type": "ReLU"},
            "conv2": {"type": "Conv2d", "in_channels": "$c", "out_channels": "$c", "kernel_size": 3, "padding": 1},
            "sum": {"type": "add", "inputs": ["conv2", "x"]},
        }}},
    "nodes": {
        "stem": {"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": 3, "padding": 1},
        "b1": {"block": "res", "c": 4},
        "b2": {"block": "res", "c": 4},
        "skip": {"type": "concat", "inputs": ["b2", "stem"]},
        "pool": {"type": "MaxPool2d", "kernel_size": 2},
        "flat": {"type": "Flatten"},
        "head": {"type": "Linear", "in_features": 128, "out_features": 10},
    },
}
POLICY = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)


def _graph(seed: int = 0) -> nn.Module:
    return build_model(parse_model(GRAPH), seed=seed)


def _data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, size=n)


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    wrapped = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    optimizer = DPOptimizer(torch.optim.SGD(wrapped.parameters(), lr=1.0), noise_multiplier=0.0,
                            max_grad_norm=clip, expected_batch_size=8)
    nn.functional.cross_entropy(wrapped(x), y).backward()
    norms = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in optimizer.params], dim=1).norm(dim=1)
    assert optimizer.pre_step()
    update = torch.cat([p.grad.flatten() for p in optimizer.params])
    wrapped.cleanup()
    return update, norms


def _modes() -> list[str]:
    out = []
    for mode in ("bk", "ghost", "ew"):
        try:
            check_supported(_graph(), mode)
        except ValueError:
            continue
        out.append(mode)
    return out


def test_the_graph_module_names_its_weights_as_the_spec_does():
    model = _graph()
    assert isinstance(model, GraphModel)
    from fedbroker.job.spec import parameter_shapes
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == parameter_shapes(parse_model(GRAPH))
    assert list(model.state_dict())[:3] == ["stem.weight", "stem.bias", "b1.conv1.weight"]


def test_the_worker_picks_one_pass_clipping_for_a_graph_with_skips():
    assert clipping_mode(_graph(), expected_batch_size=32) == "bk"
    assert {"bk", "ew"} <= set(_modes())


@pytest.mark.parametrize("clipping", _modes())
def test_every_clipping_mode_releases_opacus_reference_update_on_a_graph(clipping):
    x_np, y_np = _data(11, seed=3)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    _, norms = _reference(_graph(), x, y, clip=1e9)
    clip = float(norms.median())  # about half the samples clipped
    reference, _ = _reference(_graph(), x, y, clip=clip)
    model = _graph()
    wrapped, optimizer, backward = dp_engine(model, torch.optim.SGD(model.parameters(), lr=1.0), clipping=clipping,
                                             noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=8,
                                             generator=None)
    optimizer.zero_grad(set_to_none=True)
    backward(x, y)
    assert optimizer.pre_step()
    ours = torch.cat([p.grad.flatten() for p in optimizer.params])
    wrapped.cleanup()
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("clipping", _modes())
def test_a_graph_trains_under_dp_and_its_weights_change(clipping):
    x, y = _data(64)
    model = _graph()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train_local(model, x, y, config=TrainingConfig(local_epochs=1, batch_size=16, lr=0.05), dp=POLICY,
                         seed=1, clipping=clipping)
    assert result.clipping == clipping and result.epsilon is not None and result.epsilon > 0
    assert list(result.state) == list(before)
    assert all(np.isfinite(v).all() for v in result.state.values())
    assert any(not np.allclose(result.state[k], before[k].numpy()) for k in before)
