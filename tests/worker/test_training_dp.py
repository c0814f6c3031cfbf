"""The DP-SGD engine inside `train_local`: bulk Poisson sampling, the flat DP optimizer, grad-sample modes.

Each test pins a property the privacy guarantee rests on (what Opacus would have done), never a time.
"""

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.job.spec import TrainingConfig
from fedbroker.worker import clipping
from fedbroker.worker.dp_optimizer import FlatDPOptimizer
from fedbroker.worker.training import train_local
from fedbroker.worker.training_loops import poisson_batches

POLICY = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)


def _cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 10)
    )


def _data(n: int = 200, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, size=n)


def test_poisson_batches_are_the_draws_of_opacus_sampler_for_the_same_generator():
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    ours = poisson_batches(300, sample_rate=0.07, steps=20, generator=torch.Generator().manual_seed(4))
    opacus = UniformWithReplacementSampler(
        num_samples=300, sample_rate=0.07, generator=torch.Generator().manual_seed(4)
    )
    assert len(opacus) == 14  # int(1/q): Opacus's own step count; ours is told the trainer's count
    theirs = iter(opacus)
    for ours_batch, _ in zip(ours, range(14)):
        assert ours_batch.tolist() == next(theirs)


def test_poisson_batches_include_each_sample_independently_with_the_sample_rate():
    n, q, steps = 500, 0.04, 1000
    masks = torch.zeros(steps, n)
    sizes = []
    for s, idx in enumerate(poisson_batches(n, sample_rate=q, steps=steps, generator=torch.Generator().manual_seed(0))):
        assert idx.dtype == torch.int64 and torch.equal(idx, idx.unique())  # sorted, no sample twice
        masks[s, idx] = 1.0
        sizes.append(len(idx))
    assert len(sizes) == steps
    assert abs(masks.mean().item() - q) < 6 * math.sqrt(q * (1 - q) / masks.numel())
    per_sample = masks.mean(dim=0)  # every sample, not just on average, joins at rate q
    assert (per_sample - q).abs().max().item() < 6 * math.sqrt(q * (1 - q) / steps)
    # Binomial batch sizes (variance N·q·(1-q)), not a fixed size: independent draws, as the accountant assumes.
    assert 0.8 < np.var(sizes) / (n * q * (1 - q)) < 1.25
    both = (masks[:, :250] * masks[:, 250:]).mean().item()  # two different samples together: q², not q
    assert abs(both - q * q) < 6 * math.sqrt(q * q / masks[:, :250].numel())


def test_trainer_samples_and_averages_exactly_as_opacus_make_private_would():
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    from fedbroker.privacy import dp_sample_rate, steps_per_epoch
    from fedbroker.worker.training_loops import _opacus_poisson_rule

    for n, b in [(185, 2), (1797, 32), (300, 64), (50, 64)]:
        config = TrainingConfig(batch_size=b)
        module = nn.Linear(3, 2)
        loader = DataLoader(TensorDataset(torch.zeros(n, 3), torch.zeros(n, dtype=torch.int64)), batch_size=b)
        _, optimizer, dp_loader = PrivacyEngine().make_private(
            module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1), data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=True,
        )
        rate, expected_batch = _opacus_poisson_rule(n, config, steps_per_epoch(n, config), dp_sample_rate(n, config))
        assert rate == dp_loader.batch_sampler.sample_rate
        assert expected_batch == optimizer.expected_batch_size
        assert len(dp_loader) == steps_per_epoch(n, config)


def _params_with_grad_samples(grad_samples: list[torch.Tensor]) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(g.shape[1:])) for g in grad_samples]
    for p, g in zip(params, grad_samples):
        p.grad_sample = g.clone()
    return params


@pytest.mark.parametrize("n", [0, 1, 7])
def test_flat_optimizer_clips_sums_and_averages_like_opacus_dp_optimizer(n):
    from opacus.optimizers import DPOptimizer

    rng = torch.Generator().manual_seed(n)
    scale = torch.logspace(-2, 1, n)  # per-sample norms from far below the clip bound to far above it
    shapes = [(5, 4), (5,), (2, 3, 3)]
    grad_samples = [torch.randn(n, *s, generator=rng) * scale.view(-1, *[1] * len(s)) for s in shapes]
    grads = []
    for cls in (DPOptimizer, FlatDPOptimizer):
        params = _params_with_grad_samples(grad_samples)
        # noise 0 isolates clipping, summing and averaging (a policy never allows it; the optimizer does)
        opt = cls(torch.optim.SGD(params, lr=1.0), noise_multiplier=0.0, max_grad_norm=1.5, expected_batch_size=4)
        assert opt.pre_step()
        grads.append(torch.cat([p.grad.flatten() for p in params]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)
    if n == 0:
        assert torch.count_nonzero(grads[1]) == 0


def test_flat_optimizer_noise_has_std_sigma_times_clip_over_the_expected_batch_and_an_empty_batch_still_steps():
    params = _params_with_grad_samples([torch.zeros(0, 100, 100), torch.zeros(0, 100)])
    before = [p.detach().clone() for p in params]
    opt = FlatDPOptimizer(
        torch.optim.SGD(params, lr=1.0), noise_multiplier=1.3, max_grad_norm=2.0, expected_batch_size=8,
        generator=torch.Generator().manual_seed(0),
    )
    opt.step()
    noise = torch.cat([p.grad.flatten() for p in params])
    assert noise.numel() == 10_100
    assert abs(noise.mean().item()) < 6 * (1.3 * 2.0 / 8) / math.sqrt(noise.numel())
    assert noise.std().item() == pytest.approx(1.3 * 2.0 / 8, rel=0.03)
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before)])
    torch.testing.assert_close(moved, -noise)  # the noise-only step was taken


def test_flat_optimizer_refuses_to_step_twice_on_the_same_per_sample_gradients():
    params = _params_with_grad_samples([torch.randn(4, 3)])
    opt = FlatDPOptimizer(torch.optim.SGD(params, lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0,
                                    expected_batch_size=4)
    opt.step()
    with pytest.raises(ValueError, match="Per sample gradient"):
        opt.step()


def test_dp_training_with_many_empty_poisson_batches_gives_finite_weights_and_full_accounting():
    # N=60, B=1: q=1/60, so about a third of the 60 batches are empty (noise-only steps, no forward pass).
    x, y = _data(60)
    config = TrainingConfig(local_epochs=1, batch_size=1, lr=0.05)
    empty = sum(len(idx) == 0 for idx in poisson_batches(60, sample_rate=1 / 60, steps=60,
                                                         generator=torch.Generator().manual_seed(1)))
    assert empty > 10
    result = train_local(_cnn(), x, y, config=config, dp=POLICY, seed=3)
    assert result.steps == 60 and result.history == [(POLICY.noise_multiplier, 1 / 60, 60)]
    assert all(np.isfinite(v).all() for v in result.state.values())


@pytest.mark.parametrize("mode", ["hooks", "functorch"])
def test_every_grad_sample_mode_trains_the_same_weights_from_the_same_seed(monkeypatch, mode):
    x, y = _data()
    config = TrainingConfig(local_epochs=1, batch_size=16, lr=0.05, proximal_mu=0.5)
    pinned = train_local(_cnn(), x, y, config=config, dp=POLICY, seed=9).state
    monkeypatch.setattr(clipping, "GRAD_SAMPLE_MODE", mode)
    other = train_local(_cnn(), x, y, config=config, dp=POLICY, seed=9).state
    for key in pinned:  # same batches, same noise: only float rounding of the per-sample gradients differs
        np.testing.assert_allclose(other[key], pinned[key], rtol=1e-4, atol=1e-5)


def test_same_seed_gives_the_same_dp_weights_for_a_conv_net_and_another_seed_different_ones():
    x, y = _data()
    config = TrainingConfig(local_epochs=1, batch_size=16, lr=0.05)
    a, b, c = (train_local(_cnn(), x, y, config=config, dp=POLICY, seed=s).state for s in (2, 2, 3))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a[k], c[k]) for k in a)
