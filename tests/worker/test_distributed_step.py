"""A site's step of a distributed-DP round (worker/distributed_step.py): the Poisson-sampled sum of per-record
gradients, each clipped to L2 ≤ C, in the service's layout; and what it refuses."""

import numpy as np
import pytest
import torch
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.errors import ConfigError, TaskRefused
from fedbroker.job.task import TaskConfig
from fedbroker.worker.distributed_step import gradient_sum, poisson_sample, refuse_without_dp

REGRESSION = TaskConfig(type="regression", loss="mse")


def _names(model: nn.Module) -> list[str]:
    return list(model.state_dict())


def _linear() -> nn.Module:
    model = nn.Linear(3, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.5, -1.0, 2.0]]))
        model.bias.fill_(0.25)
    return model


def test_the_sum_is_the_hand_computed_clipped_gradients_of_a_linear_model() -> None:
    x = np.array([[1.0, 0.0, 0.0], [0.0, 2.0, 1.0], [1.0, 1.0, 1.0], [0.1, 0.0, 0.0]], dtype=np.float32)
    y = np.array([[1.0], [5.0], [10.0], [0.0]], dtype=np.float32)
    clip = 3.0
    out = gradient_sum(_linear(), x, y, names=["weight", "bias"], clip=clip, sample_rate=1.0,
                       rng=np.random.default_rng(0), task=REGRESSION)
    w, b = np.array([0.5, -1.0, 2.0]), 0.25
    expected = np.zeros(4)
    for xi, yi in zip(x.astype(np.float64), y[:, 0].astype(np.float64)):
        residual = xi @ w + b - yi                       # d/dθ of (θ·x + b − y)² is 2·residual·(x, 1)
        g = 2 * residual * np.append(xi, 1.0)
        expected += g * min(1.0, clip / np.linalg.norm(g))
    np.testing.assert_allclose(out.vector, expected, rtol=1e-5, atol=1e-6)
    assert out.sampled == 4
    assert out.clipped == 2       # the second and third records' gradients are longer than 3


def test_a_record_with_a_huge_gradient_adds_at_most_the_clip() -> None:
    x = np.array([[1e6, 1e6, 1e6]], dtype=np.float32)
    y = np.array([[-1e6]], dtype=np.float32)
    out = gradient_sum(_linear(), x, y, names=["weight", "bias"], clip=0.7, sample_rate=1.0,
                       rng=np.random.default_rng(1), task=REGRESSION)
    assert np.linalg.norm(out.vector) <= 0.7 * (1 + 1e-9)
    assert np.linalg.norm(out.vector) > 0.69
    assert out.clipped == 1


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.GroupNorm(1, 2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(2 * 5 * 5, 3))


def test_each_record_of_a_small_cnn_is_clipped_on_its_own_and_the_layout_is_the_state_dicts() -> None:
    model = _cnn()
    rng = np.random.default_rng(3)
    x = rng.normal(size=(6, 1, 5, 5)).astype(np.float32) * 10
    y = rng.integers(0, 3, size=6)
    clip = 0.05
    out = gradient_sum(model, x, y, names=_names(model), clip=clip, sample_rate=1.0, rng=np.random.default_rng(0))
    assert out.vector.size == sum(p.numel() for p in model.parameters())
    # the same sum one record at a time with autograd
    expected = []
    for i in range(6):
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.from_numpy(x[i:i + 1])), torch.tensor(y[i:i + 1]))
        loss.backward()
        g = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double().numpy()
        expected.append(g * min(1.0, clip / np.linalg.norm(g)))
    np.testing.assert_allclose(out.vector, np.sum(expected, axis=0), rtol=1e-4, atol=1e-7)
    assert np.linalg.norm(out.vector) <= 6 * clip * (1 + 1e-9)
    # in chunks of two records (what a large model gets): the same sum
    chunked = gradient_sum(model, x, y, names=_names(model), clip=clip, sample_rate=1.0, rng=np.random.default_rng(0),
                           chunk=2)
    np.testing.assert_allclose(chunked.vector, out.vector, rtol=1e-4, atol=1e-7)   # float32 per-record kernels


def test_frozen_tensors_stay_zero_in_the_layout() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    y = np.array([0, 1, 0, 1, 1])
    out = gradient_sum(model, x, y, names=_names(model), clip=1.0, sample_rate=1.0, rng=np.random.default_rng(0),
                       frozen={"0.weight", "0.bias"})
    assert not out.vector[:15].any()
    assert out.vector[15:].any()


def test_the_poisson_sample_keeps_each_record_at_the_job_rate() -> None:
    n, q, trials = 2000, 0.05, 40
    rng = np.random.default_rng(7)
    sizes = np.array([poisson_sample(n, q, rng).size for _ in range(trials)])
    # mean of 40 Binomial(2000, 0.05) draws: sd of the mean ≈ 1.54; 6 sd either side
    assert abs(sizes.mean() - n * q) < 6 * np.sqrt(n * q * (1 - q) / trials)
    assert sizes.std() > 0   # the size varies: it is no fixed batch
    first = np.concatenate([poisson_sample(n, q, rng) for _ in range(trials)])
    counts = np.bincount(first, minlength=n)
    assert counts[: n // 2].sum() > 0 and counts[n // 2:].sum() > 0
    with pytest.raises(ConfigError, match="sample_rate"):
        poisson_sample(n, 0.0, rng)


def test_batchnorm_in_training_mode_is_refused_before_any_sample() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    x = np.zeros((4, 4), dtype=np.float32)
    with pytest.raises(ConfigError, match="BatchNorm"):
        gradient_sum(model, x, np.zeros(4, dtype=np.int64), names=_names(model), clip=1.0, sample_rate=1.0,
                     rng=np.random.default_rng(0))


def test_a_site_with_dp_off_refuses_a_distributed_dp_job() -> None:
    with pytest.raises(TaskRefused, match="dp.enabled: false"):
        refuse_without_dp(None, "job-a")
    with pytest.raises(TaskRefused, match="no noise share"):
        refuse_without_dp(DPPolicy(enabled=False), "job-a")
    refuse_without_dp(DPPolicy(), "job-a")   # an enabled policy takes part
