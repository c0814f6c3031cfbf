"""The demo's training plan: every bundled set's default demo fits its ε budget, checked by the workers' own
accountant before anything starts, and the demo's own options are named by their flags."""

from __future__ import annotations

import pytest

from fedbroker.app.demo import DemoOptions, fit_training, planned_epsilon, run_demo, shard_sizes
from fedbroker.datasets import load_dataset
from fedbroker.errors import ConfigError


@pytest.mark.parametrize("dataset", ["digits", "breast_cancer", "wine", "iris"])
def test_every_bundled_sets_default_demo_fits_its_epsilon_budget(dataset):
    options = DemoOptions(dataset=dataset)
    shards = shard_sizes(options, load_dataset(dataset))
    fitted = fit_training(options, shards)
    assert fitted.rounds == 5 and fitted.local_epochs >= 1
    assert planned_epsilon(fitted, shards) <= options.epsilon_budget
    # the plan is the accountant's: the old one-size settings did not fit the small sets
    if dataset in ("iris", "wine"):
        assert planned_epsilon(options, shards) > options.epsilon_budget


@pytest.mark.parametrize("variant", [{"workers": 5}, {"alpha": 0.1}, {"partition": "classes"}])
def test_the_readmes_demo_variants_fit_on_iris(variant):
    options = DemoOptions(dataset="iris", **variant)
    shards = shard_sizes(options, load_dataset("iris"))
    assert planned_epsilon(fit_training(options, shards), shards) <= options.epsilon_budget


def test_the_digits_demo_keeps_the_settings_its_readme_numbers_came_from():
    options = DemoOptions()
    shards = shard_sizes(options, load_dataset("digits"))
    fitted = fit_training(options, shards)
    assert (fitted.batch_size, fitted.local_epochs, fitted.noise_multiplier) == (32, 3, 1.0)
    assert planned_epsilon(fitted, shards) == pytest.approx(7.617, abs=1e-3)


def test_rounds_the_budget_cannot_afford_are_refused_before_a_run_folder_exists(tmp_path):
    with pytest.raises(ConfigError, match="--rounds.*--epsilon-budget"):
        run_demo(DemoOptions(dataset="iris", rounds=500, out=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("option", "flag"), [({"workers": 0}, "--workers"), ({"alpha": 0.0}, "--alpha"),
                                              ({"rounds": 0}, "--rounds")])
def test_the_demos_own_options_are_named_before_a_run_folder_exists(tmp_path, option, flag):
    with pytest.raises(ConfigError) as raised:
        run_demo(DemoOptions(out=str(tmp_path), **option))
    assert str(raised.value).startswith(flag)
    assert list(tmp_path.iterdir()) == []
