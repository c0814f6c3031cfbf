"""Every task's loss is a mean of per-sample losses: DP-SGD's per-sample clipping bounds one sample's influence
only if each sample's gradient depends on that sample alone. Pinned against Opacus's per-sample gradients (no
noise), and against a change of another sample of the batch."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from torch import nn

from fedbroker.job.task import TaskConfig
from fedbroker.tasks.losses import per_sample_loss
from fedbroker.worker.clipping import dp_engine

N = 6
TASKS = {
    "classification": TaskConfig(class_weights=(1.0, 3.0, 0.5), label_smoothing=0.1),
    "multilabel": TaskConfig(type="multilabel", labels=3),
    "regression_mse": TaskConfig(type="regression"),
    "regression_huber": TaskConfig(type="regression", loss="huber", huber_delta=0.5),
    "segmentation": TaskConfig(type="segmentation", classes=3, dice_weight=1.0),
}


def _case(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if name == "segmentation":
        model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 3, 1))
        x = torch.randn(N, 2, 6, 6, generator=g)
        y = torch.randint(0, 3, (N, 6, 6), generator=g)
        return model, x, y
    outputs = 2 if name.startswith("regression") else 3
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, outputs))
    x = torch.randn(N, 5, generator=g)
    if name == "classification":
        y = torch.randint(0, 3, (N,), generator=g)
    elif name == "multilabel":
        y = (torch.rand(N, 3, generator=g) < 0.5).float()
    else:
        y = torch.randn(N, 2, generator=g)
    return model, x, y


def _own_gradients(model: nn.Module, task: TaskConfig, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Each sample's gradient, computed on that sample alone: rows of (N, *param shape) per parameter."""
    rows: list[list[torch.Tensor]] = []
    for i in range(len(x)):
        model.zero_grad()
        per_sample_loss(task, model(x[i:i + 1]), y[i:i + 1]).sum().backward()
        rows.append([p.grad.detach().clone() for p in model.parameters()])
    return [torch.stack([r[k] for r in rows]) for k in range(len(rows[0]))]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_per_sample_gradients_of_each_task_loss_match_opacus(name: str) -> None:
    from opacus import GradSampleModule

    task = TASKS[name]
    model, x, y = _case(name)
    expected = _own_gradients(model, task, x, y)
    wrapped = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    per_sample_loss(task, wrapped(x), y).sum().backward()
    for p, want in zip(wrapped.parameters(), expected):
        assert torch.allclose(p.grad_sample, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_one_samples_gradient_does_not_change_when_another_sample_changes(name: str) -> None:
    from opacus import GradSampleModule

    task = TASKS[name]
    model, x, y = _case(name)
    wrapped = GradSampleModule(model, batch_first=True, loss_reduction="sum")

    def grads(xb: torch.Tensor, yb: torch.Tensor) -> list[torch.Tensor]:
        wrapped.zero_grad(set_to_none=True)
        for p in wrapped.parameters():
            p.grad_sample = None
        per_sample_loss(task, wrapped(xb), yb).sum().backward()
        return [p.grad_sample.detach().clone() for p in wrapped.parameters()]

    before = grads(x, y)
    x2, y2 = x.clone(), y.clone()
    x2[-1] = x2[-1] * 5 + 1
    y2[-1] = _case(name, seed=7)[2][-1]
    after = grads(x2, y2)
    for b, a in zip(before, after):
        assert torch.allclose(b[:-1], a[:-1], atol=1e-6)
        assert not torch.allclose(b[-1], a[-1])


def test_a_batch_wide_dice_would_couple_samples() -> None:
    """The control: MONAI's Dice over the whole batch (batch=True) makes a sample's gradient depend on the others,
    which is why the task's loss computes it per image."""
    from monai.losses import DiceLoss

    model, x, y = _case("segmentation")
    coupled = DiceLoss(softmax=True, to_onehot_y=True, batch=True)

    def first_gradient(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        out = model(xb)
        # the gradient of the batch loss with respect to sample 0's output
        out.retain_grad()
        coupled(out, yb.unsqueeze(1)).backward()
        return out.grad[0].clone()

    x2 = x.clone()
    x2[-1] = x2[-1] * 5 + 1
    assert not torch.allclose(first_gradient(x, y), first_gradient(x2, y), atol=1e-6)


@pytest.mark.parametrize("clipping", ["bk", "ghost", "ew"])
@pytest.mark.parametrize("name", ["multilabel", "regression_huber", "segmentation"])
def test_each_clipping_mode_sums_the_clipped_per_sample_gradients_of_the_task_loss(name: str, clipping: str) -> None:
    task = TASKS[name]
    model, x, y = _case(name)
    expected = _own_gradients(model, task, x, y)
    norms = torch.stack([g.flatten(1).norm(dim=1) ** 2 for g in expected]).sum(0).sqrt()
    clip = float(norms.median())
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    want = [(g * factor.view(-1, *[1] * (g.dim() - 1))).sum(0) / N for g in expected]
    work = _case(name)[0]
    _, optimizer, backward = dp_engine(work, torch.optim.SGD(work.parameters(), lr=1.0), clipping=clipping,
                                       noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=N,
                                       generator=None, loss=functools.partial(per_sample_loss, task))
    before = [p.detach().clone() for p in work.parameters()]
    backward(x, y)
    optimizer.step()
    for p0, p, w in zip(before, work.parameters(), want):
        assert torch.allclose(p0 - p.detach(), w, atol=1e-5, rtol=1e-3)


@pytest.mark.parametrize("name", ["segmentation", "multilabel", "regression_mse"])
def test_train_local_trains_each_task_under_dp_and_lowers_its_loss_without(name: str) -> None:
    from fedbroker.config import DPPolicy
    from fedbroker.job.spec import TrainingConfig
    from fedbroker.worker.training import train_local

    task = TASKS[name]
    g = torch.Generator().manual_seed(3)
    model, _, _ = _case(name)
    if name == "segmentation":
        x = torch.randn(64, 2, 6, 6, generator=g)
        y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    else:
        x = torch.randn(64, 5, generator=g)
        y = ((x[:, :3] > 0).float() if name == "multilabel" else x[:, :2] * 0.5)
    config = TrainingConfig(local_epochs=3, batch_size=16, lr=0.3)
    dp = DPPolicy(enabled=True, noise_multiplier=1.0, max_grad_norm=1.0, epsilon_budget=100.0)
    private = train_local(model, x.numpy(), y.numpy(), config=config, dp=dp, seed=1, task=task)
    assert private.epsilon is not None and private.epsilon > 0 and np.isfinite(private.train_loss)
    plain_model = _case(name)[0]
    with torch.no_grad():
        before = float(per_sample_loss(task, plain_model(x), y).mean())
    train_local(plain_model, x.numpy(), y.numpy(), config=config, dp=None, seed=1, task=task)
    with torch.no_grad():
        after = float(per_sample_loss(task, plain_model(x), y).mean())
    assert after < before
