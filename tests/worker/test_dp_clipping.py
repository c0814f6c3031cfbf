"""The trainer's three clipping modes ("bk": our one-pass book-keeping, `fedbroker.worker.one_pass_clipping`; "ghost":
Opacus's fast gradient clipping; "ew": materialised per-sample gradients) and its virtual steps: each must
release exactly the update of Opacus's reference DP-SGD step.

With the noise switched off (which a DPPolicy never allows, so the engine is driven directly), the update
is compared with Opacus's own per-sample clipping: GradSampleModule's materialised per-sample gradients
clipped, summed and averaged by Opacus's stock DPOptimizer.
"""

import numpy as np
import pytest
import torch
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.errors import ConfigError
from fedbroker.job.spec import TrainingConfig
from fedbroker.privacy import dp_sample_rate, epsilon_of, planned_steps
from fedbroker.worker import one_pass_clipping
from fedbroker.worker.clipping import GHOST_MIN_FLOATS, clipping_mode, dp_engine, ghost_supported
from fedbroker.worker.dp_optimizer import FlatDPOptimizer, FlatGhostDPOptimizer, FlatSumDPOptimizer
from fedbroker.worker.training import train_local

POLICY = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16, 10),
    )


class _Residual(nn.Module):
    """A small ResNet-style CNN: bias-free convolutions, GroupNorm, a strided 1×1 shortcut, a second stage whose
    convolutions have few positions (so "bk" takes their ghost norms, and the first stage's per-sample gradients)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1, bias=False), nn.GroupNorm(2, 4), nn.ReLU())
        self.conv1, self.norm1 = nn.Conv2d(4, 8, 3, 2, 1, bias=False), nn.GroupNorm(2, 8)
        self.conv2, self.norm2 = nn.Conv2d(8, 8, 3, 1, 1), nn.GroupNorm(4, 8)
        self.shortcut = nn.Conv2d(4, 8, 1, 2, bias=False)
        self.stage2 = nn.Sequential(nn.Conv2d(8, 32, 3, 2, 1), nn.GroupNorm(4, 32), nn.ReLU(),
                                    nn.Conv2d(32, 32, 3, 2, 1, dilation=1))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = torch.relu(self.norm2(self.conv2(torch.relu(self.norm1(self.conv1(h))))) + self.shortcut(h))
        return self.head(self.stage2(h).mean((2, 3)))


class _Tokens(nn.Module):
    """Linear layers on sequences (8 tokens of 8 features), LayerNorm, and one Linear called twice in a forward
    pass: its per-sample gradient is the sum of both calls' (10 positions: formed); `mix` sees 2 positions, and
    2·(64 + 8) < 64·8 takes its ghost norm."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.embed, self.norm, self.mix = nn.Linear(8, 64), nn.LayerNorm(64), nn.Linear(8, 64)
        self.act = nn.ReLU(inplace=inplace)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(len(x), 8, 8)
        h = self.act(self.norm(self.embed(tokens))).mean(1)
        return self.head(h + self.embed(tokens[:, :2]).sum(1) + self.mix(tokens[:, 6:]).mean(1))


def _residual(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return _Residual()


def _tokens(seed: int = 0, inplace: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    return _Tokens(inplace)


def _frozen_stem(seed: int = 0) -> nn.Module:
    model = _residual(seed)
    model.stem.requires_grad_(False)  # a frozen layer has no per-sample gradient to clip
    return model


MODELS = {"mlp": _mlp, "cnn": _cnn, "residual": _residual, "tokens": _tokens, "frozen stem": _frozen_stem}
OPACUS_MODES = {"mlp": ("ghost", "ew"), "cnn": ("ghost", "ew")}  # beside "bk", on the models both run


def _data(n: int = 200, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, size=n)


def _reference_update(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, clip: float, expected: int):
    """Opacus's reference: materialised per-sample gradients (hooks), its DPOptimizer's clip, sum and mean."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    wrapped = GradSampleModule(model, batch_first=True, loss_reduction="mean")
    optimizer = DPOptimizer(torch.optim.SGD(wrapped.parameters(), lr=1.0), noise_multiplier=0.0,
                            max_grad_norm=clip, expected_batch_size=expected)
    nn.functional.cross_entropy(wrapped(x), y).backward()
    per_sample = torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in optimizer.params], dim=1).norm(dim=1)
    assert optimizer.pre_step()
    update = torch.cat([p.grad.flatten() for p in optimizer.params])
    wrapped.cleanup()
    return update, per_sample


def _engine_update(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, clipping: str, clip: float,
                   expected: int, physical: int | None) -> torch.Tensor:
    """The trainer's engine on one Poisson batch, noise off, in chunks of `physical` (virtual steps) when given."""
    wrapped, optimizer, backward = dp_engine(model, torch.optim.SGD(model.parameters(), lr=1.0), clipping=clipping,
                                             noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=expected,
                                             generator=None)
    chunks = torch.arange(len(y)).split(physical or len(y))
    optimizer.zero_grad(set_to_none=True)
    for i, chunk in enumerate(chunks):
        if i:
            optimizer.signal_skip_step(do_skip=True)
            assert optimizer.pre_step() is False  # a virtual step: accumulated, not released
            optimizer.zero_grad(set_to_none=True)
        backward(x[chunk], y[chunk])
    assert optimizer.pre_step()
    update = torch.cat([p.grad.flatten() for p in optimizer.params])
    wrapped.cleanup()
    return update


@pytest.mark.parametrize("physical", [None, 4], ids=["one pass", "virtual steps of 4"])
@pytest.mark.parametrize(("name", "clipping"), [(name, mode) for name in MODELS
                                                for mode in ("bk", *OPACUS_MODES.get(name, ()))])
def test_noise_free_update_equals_opacus_reference_per_sample_clipping(name, clipping, physical):
    x_np, y_np = _data(11, seed=3)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    _, norms = _reference_update(MODELS[name](), x, y, clip=1e9, expected=8)
    clip = float(norms.median())  # about half the samples are clipped, half pass unchanged
    assert (norms > clip * 1.01).sum() >= 3 and (norms < clip * 0.99).sum() >= 3
    reference, _ = _reference_update(MODELS[name](), x, y, clip=clip, expected=8)
    ours = _engine_update(MODELS[name](), x, y, clipping=clipping, clip=clip, expected=8, physical=physical)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-6)
    unclipped, _ = _reference_update(MODELS[name](), x, y, clip=1e9, expected=8)
    assert not torch.allclose(ours, unclipped, rtol=1e-2)  # the clipping did bite


@pytest.mark.parametrize("chunk_floats", [1, one_pass_clipping.CHUNK_FLOATS], ids=["one sample per chunk", "default"])
@pytest.mark.parametrize("n", [1, 2, 7])
@pytest.mark.parametrize("name", list(MODELS))
def test_bk_equals_opacus_reference_at_any_batch_size_and_chunking(name, n, chunk_floats, monkeypatch):
    monkeypatch.setattr(one_pass_clipping, "CHUNK_FLOATS", chunk_floats)
    x_np, y_np = _data(n, seed=5)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    _, norms = _reference_update(MODELS[name](), x, y, clip=1e9, expected=4)
    clip = float(norms.min()) * 0.9  # every sample clipped: the factors, not only the sum, must be right
    reference, _ = _reference_update(MODELS[name](), x, y, clip=clip, expected=4)
    ours = _engine_update(MODELS[name](), x, y, clipping="bk", clip=clip, expected=4, physical=None)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["residual", "tokens"])
def test_bk_takes_ghost_norms_and_per_sample_gradients_where_each_is_cheaper(name, monkeypatch):
    """Both models have layers of each kind (stage 1 / stage 2; the first / second call of `embed`), so the
    reference tests above pin both ways of taking a per-sample norm."""
    choices: list[bool] = []
    real = one_pass_clipping.ghost_norm_cheaper
    monkeypatch.setattr(one_pass_clipping, "ghost_norm_cheaper", lambda *a: choices.append(real(*a)) or choices[-1])
    x, y = (torch.from_numpy(v) for v in _data(3))
    _engine_update(MODELS[name](), x, y, clipping="bk", clip=1.0, expected=4, physical=None)
    assert set(choices) == {True, False}


@pytest.mark.parametrize("inplace", [False, True])
def test_bk_captures_layer_outputs_before_an_in_place_activation_changes_them(inplace):
    x, y = (torch.from_numpy(v) for v in _data(9, seed=2))
    reference, _ = _reference_update(_tokens(inplace=False), x, y, clip=0.05, expected=4)
    ours = _engine_update(_tokens(inplace=inplace), x, y, clipping="bk", clip=0.05, expected=4, physical=None)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-6)


def test_bk_empty_batch_releases_zero_without_noise_and_noise_only_with_it():
    model = _residual()
    _, optimizer, _ = dp_engine(model, torch.optim.SGD(model.parameters(), lr=1.0), clipping="bk",
                                noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=4, generator=None)
    optimizer.zero_grad(set_to_none=True)
    assert optimizer.pre_step()  # no forward pass at all: the clipped sum is zeros
    assert all(torch.count_nonzero(p.grad) == 0 for p in optimizer.params)
    model = _residual()
    _, optimizer, _ = dp_engine(model, torch.optim.SGD(model.parameters(), lr=1.0), clipping="bk",
                                noise_multiplier=1.3, max_grad_norm=2.0, expected_batch_size=8,
                                generator=torch.Generator().manual_seed(0))
    optimizer.zero_grad(set_to_none=True)
    assert optimizer.pre_step()
    noise = torch.cat([p.grad.flatten() for p in optimizer.params])
    assert noise.std().item() == pytest.approx(1.3 * 2.0 / 8, rel=0.05)


@pytest.mark.parametrize("name", ["mlp", "cnn", "residual"])
def test_every_mode_trains_the_same_weights_and_spends_the_same_epsilon_from_the_same_seed(name):
    x, y = _data()
    config = TrainingConfig(local_epochs=2, batch_size=16, lr=0.05, proximal_mu=0.5)
    modes = ("bk", *OPACUS_MODES.get(name, ("ew",)))
    runs = {clipping: train_local(MODELS[name](), x, y, config=config, dp=POLICY, seed=9, clipping=clipping)
            for clipping in modes}
    chunked = {clipping: train_local(MODELS[name](), x, y, config=config, dp=POLICY, seed=9, clipping=clipping,
                                     physical_batch_size=3) for clipping in ("bk", modes[1])}
    assert {mode: result.clipping for mode, result in runs.items()} == {mode: mode for mode in modes}
    planned = [(POLICY.noise_multiplier, dp_sample_rate(len(y), config), planned_steps(len(y), config))]
    for result in (*runs.values(), *chunked.values()):  # one accountant step per Poisson batch, however trained
        assert result.history == planned
        assert result.epsilon == epsilon_of(planned, delta=POLICY.delta)
    for key in runs["bk"].state:  # same batches, same noise: only float rounding of the clipped sums differs
        for other in (*runs.values(), *chunked.values()):
            np.testing.assert_allclose(other.state[key], runs["bk"].state[key], rtol=1e-4, atol=1e-5)
    assert not all(np.allclose(runs["bk"].state[k], MODELS[name]().state_dict()[k]) for k in runs["bk"].state)


@pytest.mark.parametrize("clipping", ["bk", "ghost", "ew"])
def test_virtual_steps_with_many_empty_poisson_batches_still_noise_every_step(clipping):
    x, y = _data(60)
    config = TrainingConfig(local_epochs=1, batch_size=2, lr=0.05)
    result = train_local(_cnn(), x, y, config=config, dp=POLICY, seed=3, clipping=clipping, physical_batch_size=1)
    assert result.steps == 30 and result.history == [(POLICY.noise_multiplier, 1 / 30, 30)]
    assert all(np.isfinite(v).all() for v in result.state.values())


def test_automatic_choice_is_bk_where_it_runs_else_ghost_where_it_pays_else_ew():
    for name, make in MODELS.items():
        assert clipping_mode(make(), expected_batch_size=32) == "bk", name
    # A layer "bk" cannot clip (a grouped convolution): ghost once ew would form enough per-sample floats.
    grouped = nn.Sequential(nn.Conv2d(1, 4, 3, groups=1), nn.Conv2d(4, 4, 3, groups=2), nn.Flatten(),
                            nn.Linear(4 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))
    linear = sum(p.numel() for m in grouped if isinstance(m, nn.Linear) for p in m.parameters())
    assert not one_pass_clipping.supported(grouped) and ghost_supported(grouped)
    assert clipping_mode(grouped, expected_batch_size=GHOST_MIN_FLOATS // linear) == "ew"
    assert clipping_mode(grouped, expected_batch_size=GHOST_MIN_FLOATS // linear + 1) == "ghost"
    # A layer neither can clip (a dilated Conv1d), or a parameter shared by two layers, keeps "ew" at any batch.
    dilated_1d = nn.Sequential(nn.Conv1d(1, 4, 3, dilation=2), nn.Flatten(), nn.Linear(4 * 60, 10))
    tied = _mlp()
    tied.append(nn.Linear(10, 10))
    tied[-1].weight = nn.Parameter(torch.zeros(10, 10))
    tied.append(nn.Linear(10, 10))
    tied[-1].weight = tied[-2].weight
    frozen = nn.Sequential(nn.Flatten(), nn.Conv1d(1, 4, 3), nn.Linear(64, 32), nn.Linear(32, 10))
    frozen[1].requires_grad_(False)
    for model in (dilated_1d, tied):
        assert not one_pass_clipping.supported(model) and not ghost_supported(model)
        assert clipping_mode(model, expected_batch_size=1 << 20) == "ew"
    assert one_pass_clipping.supported(frozen)  # a layer with nothing to train needs no per-sample norm


def test_training_reports_the_automatic_choice_and_none_without_dp():
    x, y = _data(1000)
    small = train_local(_mlp(), x, y, config=TrainingConfig(local_epochs=1, batch_size=8), dp=POLICY)
    large = train_local(_mlp(), x, y, config=TrainingConfig(local_epochs=1, batch_size=500), dp=POLICY)
    plain = train_local(_mlp(), x, y, config=TrainingConfig(local_epochs=1, batch_size=500), dp=None)
    assert (small.clipping, large.clipping, plain.clipping) == ("bk", "bk", None)


def test_bad_clipping_arguments_are_refused_naming_the_field():
    x, y = _data()
    layer_norm = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.LayerNorm(32), nn.Linear(32, 10))
    with pytest.raises(ConfigError, match="clipping.*ghost clipping needs"):
        train_local(layer_norm, x, y, config=TrainingConfig(local_epochs=1), dp=POLICY, clipping="ghost")
    with pytest.raises(ConfigError, match=r"clipping.*bk clipping cannot clip the layers 3 \(Conv1d\)"):
        train_local(nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Unflatten(1, (1, 32)),
                                  nn.Conv1d(1, 2, 3, dilation=2), nn.Flatten(), nn.Linear(56, 10)),
                    x, y, config=TrainingConfig(local_epochs=1), dp=POLICY, clipping="bk")
    with pytest.raises(ConfigError, match="clipping.*auto, bk, ghost, ew"):
        train_local(_mlp(), x, y, config=TrainingConfig(local_epochs=1), dp=POLICY, clipping="fast")
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="physical_batch_size"):
            train_local(_mlp(), x, y, config=TrainingConfig(local_epochs=1), dp=POLICY, physical_batch_size=bad)


@pytest.mark.parametrize("cls", [FlatDPOptimizer, FlatGhostDPOptimizer, FlatSumDPOptimizer])
def test_a_clipped_sum_is_never_noised_and_released_twice(cls):
    param = nn.Parameter(torch.zeros(3))
    opt = cls(torch.optim.SGD([param], lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
    param.grad_sample = torch.randn(4, 3)
    param.grad = torch.randn(3)
    pending = [torch.randn(3)]
    opt.source = lambda: pending.pop() if pending else None  # (FlatSumDPOptimizer's feed: one sum, taken once)
    assert opt.pre_step()
    with pytest.raises(ValueError):  # no zero_grad and no new backward pass in between
        opt.pre_step()


def test_ghost_optimizer_noise_only_step_has_std_sigma_times_clip_over_the_expected_batch():
    params = [nn.Parameter(torch.zeros(100, 100)), nn.Parameter(torch.zeros(100))]
    opt = FlatGhostDPOptimizer(torch.optim.SGD(params, lr=1.0), noise_multiplier=1.3, max_grad_norm=2.0,
                               expected_batch_size=8, generator=torch.Generator().manual_seed(0))
    opt.zero_grad(set_to_none=True)
    opt.step()  # an empty Poisson batch: no backward pass, no .grad, noise only
    noise = torch.cat([p.grad.flatten() for p in params])
    assert noise.numel() == 10_100
    assert noise.std().item() == pytest.approx(1.3 * 2.0 / 8, rel=0.03)
    torch.testing.assert_close(torch.cat([p.detach().flatten() for p in params]), -noise)


def test_worker_physical_batch_size_comes_from_config_and_a_negative_one_is_refused(tmp_path):
    from fedbroker.bus import open_bus
    from fedbroker.config import WorkerConfig, load_config
    from fedbroker.worker.agent import WorkerAgent

    assert load_config(environ={"FEDBROKER__WORKER__PHYSICAL_BATCH_SIZE": "64"}).worker.physical_batch_size == 64
    assert load_config(environ={}).worker.physical_batch_size == 0  # default: the whole Poisson batch at once
    config = WorkerConfig(ledger_path=str(tmp_path / "ledger.json"), device="cpu", physical_batch_size=-1)
    with pytest.raises(ConfigError, match="worker.physical_batch_size"):
        WorkerAgent(config, open_bus(None, namespace=f"clipping-{tmp_path.name}"))


@pytest.mark.parametrize(("clipping", "limit"), [("ew", "EW_MAX_FLOATS"), ("bk", "BK_MAX_FLOATS")])
def test_batches_over_the_modes_pass_limit_are_split_into_virtual_steps(clipping, limit, monkeypatch):
    from fedbroker.worker import training_loops

    x, y = _data()
    config = TrainingConfig(local_epochs=1, batch_size=32, lr=0.05)
    whole = train_local(_cnn(), x, y, config=config, dp=POLICY, seed=4, clipping=clipping)
    passes: list[int] = []
    real_engine = training_loops.dp_engine

    def counting_engine(*args, **kwargs):
        wrapped, optimizer, backward = real_engine(*args, **kwargs)
        return wrapped, optimizer, lambda xb, yb: passes.append(len(yb)) or backward(xb, yb)

    params = sum(p.numel() for p in _cnn().parameters())
    monkeypatch.setattr(training_loops, limit, 5 * params)  # at most 5 samples per pass
    monkeypatch.setattr(training_loops, "dp_engine", counting_engine)
    split = train_local(_cnn(), x, y, config=config, dp=POLICY, seed=4, clipping=clipping)
    assert max(passes) == 5 and len(passes) > 4 * split.steps  # batches of ~32 went in several passes each
    assert split.history == whole.history and split.epsilon == whole.epsilon
    for key in whole.state:
        np.testing.assert_allclose(split.state[key], whole.state[key], rtol=1e-4, atol=1e-5)


def test_cpu_ew_training_forms_conv_per_sample_gradients_by_unfold_at_every_batch_size():
    from torch.nn.utils._expanded_weights import conv_utils

    x, y = _data(40)
    result = train_local(_cnn(), x, y, config=TrainingConfig(local_epochs=1, batch_size=8), dp=POLICY,
                         clipping="ew")
    assert result.clipping == "ew" and conv_utils.THRESHOLD == 0  # never the grouped convolution over the batch


def test_flat_sum_optimizer_overwrites_the_gradient_views_each_step_and_never_accumulates():
    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(3))]
    opt = FlatSumDPOptimizer(torch.optim.SGD(params, lr=1.0), noise_multiplier=0.0, max_grad_norm=1.0,
                             expected_batch_size=2, loss_reduction="mean")
    for step, flat in enumerate([torch.arange(9.0), torch.ones(9), None]):
        pending = [] if flat is None else [flat]
        opt.source = lambda: pending.pop() if pending else None
        opt.zero_grad(set_to_none=True)
        assert opt.pre_step()
        expected = torch.zeros(9) if flat is None else flat / 2  # an empty batch (no source): zeros
        torch.testing.assert_close(torch.cat([p.grad.flatten() for p in params]), expected, msg=f"step {step}")
    assert params[1].grad.data_ptr() == params[0].grad.data_ptr() + 6 * 4  # views of one buffer
