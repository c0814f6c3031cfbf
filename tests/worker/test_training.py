import json
import math
from dataclasses import asdict

import numpy as np
import pytest
import torch
from opacus.accountants import RDPAccountant
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.datasets import load_dataset, train_test_split
from fedbroker.errors import BudgetExceeded, ConfigError
from fedbroker.evaluation import evaluate
from fedbroker.job.spec import TrainingConfig, parse_job, training_from_json
from fedbroker.privacy import dp_sample_rate, planned_steps, project_epsilon
from fedbroker.worker.training import pick_device, train_local

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

POLICY = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)


def _mlp(in_features: int = 64, num_classes: int = 10, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, num_classes))


def _params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.fixture(scope="module")
def digits():
    return train_test_split(load_dataset("digits"), test_fraction=0.2, seed=0)


@pytest.fixture(scope="module")
def small(digits):
    train, _ = digits
    return train.x[:300], train.y[:300]


def test_plain_training_on_digits_reaches_85_percent_test_accuracy(digits):
    train, test = digits
    model = _mlp()
    result = train_local(
        model, train.x, train.y, config=TrainingConfig(local_epochs=3, batch_size=32, lr=0.1, momentum=0.9), dp=None
    )
    accuracy, loss = evaluate(model, test.x, test.y)
    assert accuracy > 0.85
    assert math.isfinite(loss) and result.epsilon is None and result.history == []
    assert result.num_samples == len(train) and result.steps == planned_steps(len(train), TrainingConfig(local_epochs=3))
    assert result.samples_per_second > 0 and result.seconds > 0


def test_dp_epsilon_equals_a_fresh_rdp_accountant_given_the_same_history(small):
    x, y = small
    config = TrainingConfig(local_epochs=2, batch_size=32)
    result = train_local(_mlp(), x, y, config=config, dp=POLICY)
    q = dp_sample_rate(len(y), config)
    assert result.history == [(POLICY.noise_multiplier, q, planned_steps(len(y), config))]
    fresh = RDPAccountant()
    fresh.history = [tuple(e) for e in json.loads(json.dumps(result.history))]
    assert result.epsilon == fresh.get_epsilon(delta=POLICY.delta)
    assert result.epsilon > 0


def test_epsilon_grows_when_the_history_is_carried_across_rounds(small):
    x, y = small
    config = TrainingConfig(local_epochs=1, batch_size=32)
    model = _mlp()
    first = train_local(model, x, y, config=config, dp=POLICY, seed=1)
    second = train_local(model, x, y, config=config, dp=POLICY, history=first.history, seed=2)
    alone = train_local(model, x, y, config=config, dp=POLICY, seed=3)
    assert second.epsilon > first.epsilon
    assert alone.epsilon == first.epsilon  # without the history nothing composes
    assert second.history[-1][2] == 2 * first.history[-1][2]


def test_projected_epsilon_equals_the_epsilon_spent_training_the_planned_steps():
    # N=185, B=2: ceil(N/B)=93 batches, but Opacus takes int(1/(1/93)) = 92 steps per epoch and its
    # accountant records q = 1/92; the prior history ends with that entry, so the new steps merge.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(185, 4)).astype(np.float32), rng.integers(0, 3, size=185)
    config = TrainingConfig(local_epochs=2, batch_size=2, lr=0.05)
    prior = [(2.0, 0.01, 50), (POLICY.noise_multiplier, dp_sample_rate(185, config), 10)]
    projected = project_epsilon(
        prior,
        noise_multiplier=POLICY.noise_multiplier,
        sample_rate=dp_sample_rate(185, config),
        steps=planned_steps(185, config),
        delta=POLICY.delta,
    )
    result = train_local(_mlp(4, 3), x, y, config=config, dp=POLICY, history=prior)
    assert planned_steps(185, config) == 2 * 92 == result.steps and dp_sample_rate(185, config) == 1 / 92
    assert result.history == [(2.0, 0.01, 50), (POLICY.noise_multiplier, 1 / 92, 10 + 2 * 92)]
    assert abs(result.epsilon - projected) <= 1e-9
    assert all(np.isfinite(v).all() for v in result.state.values())  # Poisson's empty batches included


def test_a_task_over_the_owners_budget_is_refused_before_training(small):
    x, y = small
    model = _mlp()
    before = _params(model).clone()
    tight = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=0.5)
    with pytest.raises(BudgetExceeded, match="budget"):
        train_local(model, x, y, config=TrainingConfig(local_epochs=1), dp=tight)
    assert torch.equal(_params(model), before)


def test_state_names_have_no_opacus_prefix_and_match_the_model_state_dict(small):
    x, y = small
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 64, 10)
    )
    result = train_local(model, x, y, config=TrainingConfig(local_epochs=1, batch_size=64), dp=POLICY)
    reference = model.state_dict()
    assert list(result.state) == list(reference)
    assert not any("_module" in k for k in result.state)
    for key, value in reference.items():
        np.testing.assert_array_equal(result.state[key], value.numpy())  # trained weights copied back
        assert result.state[key].dtype == np.float32
    assert not hasattr(model, "_module") and not any(hasattr(p, "grad_sample") for p in model.parameters())


def test_training_the_same_model_object_twice_never_double_wraps(small):
    x, y = small
    model = _mlp()
    for _ in range(2):
        result = train_local(model, x, y, config=TrainingConfig(local_epochs=1, batch_size=64), dp=POLICY)
        assert list(result.state) == list(model.state_dict())


def test_an_opacus_wrapped_model_is_refused_rather_than_wrapped_twice(small):
    from opacus import GradSampleModule

    x, y = small
    wrapped = GradSampleModule(_mlp())
    for candidate in (wrapped, wrapped._module):
        with pytest.raises(ConfigError, match="already wrapped"):
            train_local(candidate, x, y, config=TrainingConfig(local_epochs=1, batch_size=64), dp=POLICY)


def test_history_read_back_from_json_composes_like_the_original(small, tmp_path):
    from fedbroker.worker.ledger import PrivacyLedger

    x, y = small
    config = TrainingConfig(local_epochs=1, batch_size=32)
    ledger = PrivacyLedger(str(tmp_path / "ledger.json"))
    first = train_local(_mlp(), x, y, config=config, dp=POLICY)
    ledger.record("job", history=first.history, epsilon=first.epsilon)
    stored = PrivacyLedger(ledger.path).history("job")
    projected = project_epsilon(
        stored, noise_multiplier=POLICY.noise_multiplier, sample_rate=dp_sample_rate(len(y), config),
        steps=planned_steps(len(y), config), delta=POLICY.delta,
    )
    second = train_local(_mlp(), x, y, config=config, dp=POLICY, history=json.loads(json.dumps(stored)))
    assert second.epsilon == projected > first.epsilon


def test_a_batchnorm_model_is_refused_under_dp_with_a_clear_message(small):
    x, y = small
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 36, 10))
    with pytest.raises(ConfigError, match="GroupNorm") as info:
        train_local(model, x, y, config=TrainingConfig(), dp=POLICY)
    assert info.value.field == "model" and "BatchNorm" in str(info.value)
    # Without DP the same model trains (and its running statistics are part of the state).
    result = train_local(model, x, y, config=TrainingConfig(), dp=None)
    assert list(result.state) == list(model.state_dict())


@pytest.mark.parametrize("dp", [None, POLICY], ids=["plain", "dp"])
def test_same_seed_gives_the_same_weights_and_another_seed_different_ones(small, dp):
    x, y = small
    config = TrainingConfig(local_epochs=1, batch_size=32, optimizer="adam", lr=0.01)
    a, b, c = (train_local(_mlp(), x, y, config=config, dp=dp, seed=s).state for s in (5, 5, 6))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not all(np.array_equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("dp", [None, POLICY], ids=["plain", "dp"])
def test_proximal_term_keeps_local_weights_closer_to_the_global_model(small, dp):
    x, y = small
    start = _params(_mlp())
    drift = []
    for mu in (0.0, 5.0):
        model = _mlp()
        train_local(model, x, y, config=TrainingConfig(local_epochs=2, batch_size=32, lr=0.1, proximal_mu=mu), dp=dp, seed=0)
        drift.append(float((_params(model) - start).norm()))
    assert drift[1] < 0.8 * drift[0]


def test_progress_reports_every_step(small):
    x, y = small
    seen = []
    config = TrainingConfig(local_epochs=2, batch_size=64)
    result = train_local(_mlp(), x, y, config=config, dp=POLICY, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(i, result.steps) for i in range(1, result.steps + 1)]


def test_evaluate_counts_correct_predictions():
    model = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.eye(2))
    x = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    accuracy, loss = evaluate(model, x, np.array([0, 1, 1, 1]), batch_size=3)
    assert accuracy == 0.75
    expected = -np.mean(np.log(np.array([np.e, np.e, 1.0, np.e]) / (np.e + 1)))
    assert loss == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"optimizer": "rmsprop"}, "training.optimizer"),
        ({"local_epochs": 0}, "training.local_epochs"),
        ({"batch_size": 0}, "training.batch_size"),
        ({"lr": -1.0}, "training.lr"),
        ({"proximal_mu": -0.1}, "training.proximal_mu"),
        ({"optimizer": "adam", "momentum": 0.9}, "training.momentum"),
    ],
)
def test_bad_training_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError) as info:
        TrainingConfig(**kwargs)
    assert info.value.field == field


JOB = {"name": "j", "category": "digits",
       "model": {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 3}]}}


@pytest.mark.parametrize(
    "kwargs",
    [{"momentum": 0.9995}, {"momentum": 1.0}, {"lr": 20.0}, {"local_epochs": 1001}, {"batch_size": 70_000},
     {"proximal_mu": 101.0}, {"optimizer": "adam", "momentum": 0.5}, {"lr": float("nan")}, {"rounds": True}],
)
def test_a_job_and_the_trainer_refuse_the_same_settings_with_the_same_message(kwargs):
    with pytest.raises(ConfigError) as direct:
        TrainingConfig(**kwargs)
    with pytest.raises(ConfigError) as parsed:
        parse_job({**JOB, "training": kwargs})
    assert str(direct.value) == str(parsed.value)


def test_a_round_tasks_training_json_is_checked_again_by_the_worker():
    assert training_from_json(json.dumps(asdict(TrainingConfig(lr=0.2)))) == TrainingConfig(lr=0.2)
    with pytest.raises(ConfigError) as info:
        training_from_json('{"epochs": 3, "batch_size": 0}')
    assert [e.field for e in info.value.errors] == ["training.epochs", "training.batch_size"]
    with pytest.raises(ConfigError, match="training: must be a mapping"):
        training_from_json("[1, 2]")


def test_several_bad_training_settings_are_reported_at_once():
    with pytest.raises(ConfigError) as info:
        TrainingConfig(local_epochs=0, lr="fast", optimizer="lbfgs")
    assert [e.field for e in info.value.errors] == ["training.local_epochs", "training.optimizer", "training.lr"]


def test_an_integer_where_a_float_belongs_is_kept_as_that_float():
    config = TrainingConfig(lr=1, momentum=0)
    assert config.lr == 1.0 and isinstance(config.lr, float) and isinstance(config.momentum, float)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"noise_multiplier": 0.0}, "dp.noise_multiplier"),
        ({"max_grad_norm": -1.0}, "dp.max_grad_norm"),
        ({"delta": 1.0}, "dp.delta"),
        ({"epsilon_budget": 0.0}, "dp.epsilon_budget"),
    ],
)
def test_bad_dp_policy_names_the_field(kwargs, field):
    args = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-5, "epsilon_budget": 8.0} | kwargs
    with pytest.raises(ConfigError) as info:
        DPPolicy(**args)
    assert info.value.field == field
    DPPolicy(**args, enabled=False)  # a policy that is off is never used, so its numbers are not checked


def test_a_disabled_policy_trains_without_dp(small):
    x, y = small
    config = TrainingConfig(local_epochs=1, batch_size=64)
    off = DPPolicy(enabled=False, noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=1e-9)
    result = train_local(_mlp(), x, y, config=config, dp=off, seed=1)
    assert result.epsilon is None and result.history == []
    plain = train_local(_mlp(), x, y, config=config, dp=None, seed=1)
    assert all(np.array_equal(result.state[k], plain.state[k]) for k in plain.state)


def test_pick_device_matches_cuda_availability():
    assert pick_device() == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("clipping", ["ew", "ghost"])
def test_dp_training_runs_on_cuda_and_returns_host_arrays(small, clipping):
    x, y = small
    result = train_local(_mlp(), x, y, config=TrainingConfig(local_epochs=1), dp=POLICY, device="cuda",
                         clipping=clipping, physical_batch_size=16)
    assert all(isinstance(v, np.ndarray) for v in result.state.values()) and result.epsilon > 0
    assert result.clipping == clipping


def test_epsilon_of_a_history_is_bit_for_bit_what_opacus_accountant_reports():
    """`epsilon_of` reuses the RDP of one step per (σ, q); the accountant recomputes it per entry. Histories
    with repeated and distinct (σ, q), zero steps and large step counts: the same float, not just close."""
    from opacus.accountants import RDPAccountant

    from fedbroker.privacy import epsilon_of

    rng = np.random.default_rng(7)
    histories = [[(1.0, 1 / 4, 12)], [(0.8, 0.01, 10_000)], [(1.1, 0.2, 0), (1.1, 0.2, 5)],
                 [(1.0, 1 / 8, 16), (0.7, 1 / 8, 16), (1.0, 1 / 8, 16)]]
    histories += [[(float(rng.uniform(0.5, 3)), float(rng.uniform(0.001, 1)), int(rng.integers(0, 500)))
                   for _ in range(int(rng.integers(1, 6)))] for _ in range(12)]
    for history in histories:
        for delta in (1e-5, 1e-3):
            accountant = RDPAccountant()
            accountant.history = list(history)
            assert epsilon_of(history, delta=delta) == float(accountant.get_epsilon(delta)), history
    assert epsilon_of([], delta=1e-5) == 0.0
