"""DP training of a library network (MONAI's UNet, as a model node names it) under the worker's own clipping.

MONAI's UNet (ReLU, GroupNorm in place of BatchNorm) is all Conv2d, ConvTranspose2d and GroupNorm, which our
one-pass clipping ("bk") knows, so the worker picks "bk". With PReLU (MONAI's default activation, a parameter no
fast path knows) it picks "ew", and inside it Opacus's "hooks" mode, whose samplers fall back to torch.func for
such layers (torch's ExpandedWeights knows neither ConvTranspose2d nor PReLU). The per-sample gradients are
pinned against the definition (each sample's own backward pass) and against Opacus's GradSampleModule; the
released update of either mode against the clipped sum of those.
"""

import numpy as np
import pytest
import torch
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.job.model_spec import parameter_shapes, parse_model
from fedbroker.job.spec import TrainingConfig
from fedbroker.layers.library import check_params
from fedbroker.layers.monai_nets import build
from fedbroker.model import build_model
from fedbroker.worker.clipping import clipping_mode, dp_engine, grad_sample_mode
from fedbroker.worker.training import train_local

TINY_UNET = {"spatial_dims": 2, "in_channels": 1, "out_channels": 2, "channels": [4, 8, 16], "strides": [2, 2],
             "num_res_units": 1, "num_groups": 2}


def _unet(seed: int = 0, **overrides: object) -> nn.Module:
    params, problems = check_params("monai.UNet", {**TINY_UNET, **overrides})
    assert not problems
    torch.manual_seed(seed)
    return build("monai.UNet", params)


def _batch(n: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 16, 16, generator=gen), torch.randint(0, 2, (n, 16, 16), generator=gen)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y, reduction="sum")  # the "ew" engine's loss: a sample's pixels summed


def _per_sample_by_definition(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """Each sample's gradient from its own backward pass, flattened over the parameters in order."""
    rows = []
    for i in range(len(y)):
        model.zero_grad(set_to_none=True)
        _loss(model(x[i:i + 1]), y[i:i + 1]).backward()
        rows.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    return rows


def test_the_worker_clips_a_monai_unet_in_one_pass_and_with_prelu_through_opacus_hooks():
    model = _unet()
    assert any(isinstance(m, nn.ConvTranspose2d) for m in model.modules())
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    assert clipping_mode(model, expected_batch_size=32) == "bk"
    with_prelu = _unet(act="prelu")
    assert clipping_mode(with_prelu, expected_batch_size=32) == "ew"
    assert grad_sample_mode(with_prelu) == "hooks"


def test_opacus_per_sample_gradients_of_a_monai_unet_match_each_samples_own_backward_pass():
    from opacus import GradSampleModule

    model = _unet(seed=1, act="prelu").double()  # PReLU's weight too: only torch.func's fallback samples it
    x, y = _batch(seed=1)
    x = x.double()
    expected = _per_sample_by_definition(model, x, y)
    wrapped = GradSampleModule(model, batch_first=True, loss_reduction="sum")
    _loss(wrapped(x), y).backward()
    got = torch.cat([p.grad_sample.flatten(1) for p in model.parameters()], dim=1)
    wrapped.cleanup()
    torch.testing.assert_close(got, torch.stack(expected), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(("act", "clipping"), [("relu", "bk"), ("prelu", "ew")])
def test_the_workers_update_of_a_monai_unet_is_the_clipped_sum_of_its_per_sample_gradients(act, clipping):
    clip, expected_batch = 0.5, 4
    x, y = _batch(seed=2)
    rows = _per_sample_by_definition(_unet(seed=2, act=act), x, y)
    norms = torch.stack([r.norm() for r in rows])
    assert (norms > clip).all()  # every sample is clipped: the test would see a missing or wrong clip
    reference = sum(r * min(1.0, clip / (float(n) + 1e-6)) for r, n in zip(rows, norms)) / expected_batch

    model = _unet(seed=2, act=act)
    wrapped, optimizer, backward = dp_engine(model, torch.optim.SGD(model.parameters(), lr=1.0), clipping=clipping,
                                             noise_multiplier=0.0, max_grad_norm=clip,
                                             expected_batch_size=expected_batch, generator=None)
    optimizer.zero_grad(set_to_none=True)
    backward(x, y)
    assert optimizer.pre_step()
    update = torch.cat([p.grad.flatten() for p in optimizer.params])
    wrapped.cleanup()
    torch.testing.assert_close(update, reference, rtol=1e-4, atol=1e-5)


def test_noised_dp_steps_on_a_tiny_monai_unet_move_every_weight_and_keep_it_finite():
    model = _unet(seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = _batch(n=8, seed=3)
    wrapped, optimizer, backward = dp_engine(model, torch.optim.SGD(model.parameters(), lr=0.05), clipping="bk",
                                             noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=8,
                                             generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        optimizer.zero_grad(set_to_none=True)
        backward(x, y)
        optimizer.step()
    wrapped.cleanup()
    for name, value in model.state_dict().items():
        assert torch.isfinite(value).all(), name
        assert not torch.equal(value, before[name]), name  # noised: every trained weight moves


def test_a_library_classifier_from_a_job_spec_trains_under_dp_through_train_local():
    """The whole kernel path: the job's model names monai.DenseNet121 (small widths), the spec is parsed, the
    torch model built, and the worker's trainer runs DP-SGD with the clipping it picks ("bk": every layer is a
    Conv2d, GroupNorm or Linear once BatchNorm is swapped)."""
    spec = parse_model({"input_shape": [1, 32, 32], "layers": [
        {"type": "monai.DenseNet121", "spatial_dims": 2, "in_channels": 1, "out_channels": 3, "init_features": 8,
         "growth_rate": 4, "num_groups": 4}]})
    model = build_model(spec, seed=4)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(8, 1, 32, 32)).astype(np.float32)
    y = rng.integers(0, 3, size=8)
    policy = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)
    result = train_local(model, x, y, config=TrainingConfig(local_epochs=1, batch_size=8, lr=0.1), dp=policy, seed=4)
    assert result.clipping == "bk" and result.epsilon is not None and result.epsilon > 0
    assert set(result.state) == set(parameter_shapes(spec))
    assert all(np.isfinite(v).all() for v in result.state.values())
