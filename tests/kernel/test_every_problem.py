"""Every problem at once, each named by its full path: a job with several wrong layers or algorithm parameters,
a worker config and a coordinator config with several bad values. One pass fixes the file."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from fedbroker.config import DPPolicy, load_config
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.submission import accept_job

JOB: dict[str, Any] = {
    "name": "j", "category": "digits",
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 32}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 32, "out_features": 16}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 16, "out_features": 10}]},
    "training": {"rounds": 10},
}


def problems(exc: ConfigError) -> dict[str, str]:
    errors = exc.errors if isinstance(exc, ConfigErrors) else [exc]
    return {e.field: e.problem for e in errors}


def refused(job: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        accept_job(job)
    return problems(info.value)


def with_layers(**changes: dict[str, Any]) -> dict[str, Any]:
    job = copy.deepcopy(JOB)
    for index, change in changes.items():
        job["model"]["layers"][int(index[1:])].update(change)
    return job


def test_two_wrong_layers_are_both_named_and_neither_is_echoed_by_the_layers_after_it() -> None:
    found = refused(with_layers(l1={"in_features": 60}, l5={"in_features": 15}))
    assert found == {"model.layers[1].in_features": "is 60 but the previous layer outputs 64",
                     "model.layers[5].in_features": "is 15 but the previous layer outputs 16"}
    # one wrong width: the layer after it (which reads the wrong layer's declared output) is not blamed
    assert refused(with_layers(l3={"in_features": 31})) == {
        "model.layers[3].in_features": "is 31 but the previous layer outputs 32"}


def test_a_linear_without_flatten_and_a_later_wrong_width_are_both_named() -> None:
    job = copy.deepcopy(JOB)
    job["model"]["layers"][0] = {"type": "ReLU"}  # the Linear now receives (1, 8, 8)
    job["model"]["layers"][3]["in_features"] = 30
    found = refused(job)
    assert set(found) == {"model.layers[1]", "model.layers[3].in_features"}, found
    assert "add a Flatten before it" in found["model.layers[1]"]
    assert found["model.layers[3].in_features"] == "is 30 but the previous layer outputs 32"


def test_conv_and_group_norm_widths_are_each_named() -> None:
    job = copy.deepcopy(JOB)
    job["model"]["layers"] = [
        {"type": "Conv2d", "in_channels": 3, "out_channels": 4, "kernel_size": 3, "padding": 1},
        {"type": "GroupNorm", "num_groups": 2, "num_channels": 6},
        {"type": "Flatten"}, {"type": "Linear", "in_features": 256, "out_features": 10}]
    assert refused(job) == {"model.layers[0].in_channels": "is 3 but the input has 1 channels",
                            "model.layers[1].num_channels": "is 6 but the input has 4 channels",
                            "model.layers[3].in_features": "is 256 but the previous layer outputs 384"}


def test_every_bad_parameter_of_an_algorithm_is_named_by_its_path() -> None:
    job = copy.deepcopy(JOB)
    job["aggregation"] = {
        "alignment": "nafi", "alignment_params": {"sigma2": 0, "lam": -1, "output_weighting": "even"},
        "selection": "ga", "selection_params": {"m": 2, "population": 1, "mutation_rate": 2, "fitness": "vibes",
                                                "colour": "red"}}
    found = refused(job)
    assert set(found) == {
        "aggregation.alignment_params.sigma2", "aggregation.alignment_params.lam",
        "aggregation.alignment_params.output_weighting", "aggregation.selection_params.colour"}, found
    job["aggregation"]["selection_params"].pop("colour")  # unknown names first; then the values, every one
    found = refused(job)
    assert {"aggregation.selection_params.population", "aggregation.selection_params.mutation_rate",
            "aggregation.selection_params.fitness"} <= set(found), found
    assert found["aggregation.selection_params.population"].startswith("ga: population must be an integer in [2, 1000]")


def test_a_ga_job_whose_rounds_never_reach_a_ga_round_is_refused_with_both_numbers() -> None:
    job = copy.deepcopy(JOB)
    job["training"]["rounds"] = 9
    job["aggregation"] = {"selection": "ga", "selection_params": {"m": 2, "fitness": "reported_loss"}}
    assert refused(job) == {"aggregation.selection_params.ga_gap": (
        "the genetic algorithm runs every ga_gap = 10 rounds (rounds 10, 20, …), but training.rounds is 9: every "
        "round would choose 2 update(s) at random. Set ga_gap to at most 9, training.rounds to at least 10, or use "
        "selection: random")}
    job["training"]["rounds"] = 10  # round 10 is a GA round
    assert accept_job(job).aggregation.selection == "ga"
    job["training"]["rounds"] = 3
    job["aggregation"]["selection_params"]["ga_gap"] = 3
    assert accept_job(job).training.rounds == 3


def test_a_bad_training_section_is_not_echoed_as_a_ga_problem() -> None:
    job = copy.deepcopy(JOB)
    job["training"]["rounds"] = "many"
    job["aggregation"] = {"selection": "ga", "selection_params": {"m": 2, "fitness": "reported_loss"}}
    assert set(refused(job)) == {"training.rounds"}


def test_a_worker_config_with_several_bad_values_names_each_by_its_full_path(tmp_path: Any) -> None:
    path = tmp_path / "worker.yaml"
    path.write_text("worker:\n  id: site-a\n  dp:\n    noise_multiplier: -1\n    delta: 2\n  heartbeat: 3\n"
                    "  partition: {num_clients: many}\nbroker: {max_attempts: x}\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), environ={})
    found = problems(info.value)
    assert set(found) == {"worker.dp.noise_multiplier", "worker.dp.delta", "worker.heartbeat",
                          "worker.partition.num_clients", "broker.max_attempts"}, found
    assert found["worker.dp.delta"] == "must lie strictly between 0 and 1, got 2.0"
    # the environment's values are checked with the file's
    with pytest.raises(ConfigError) as info:
        load_config(str(path), environ={"FEDBROKER__WORKER__DP__EPSILON_BUDGET": "0"})
    assert "worker.dp.epsilon_budget" in problems(info.value)
    # a DP policy built directly still names its fields from its own section
    with pytest.raises(ConfigErrors) as direct:
        DPPolicy(noise_multiplier=0.0, epsilon_budget=-1.0)
    assert set(problems(direct.value)) == {"dp.noise_multiplier", "dp.epsilon_budget"}


def test_a_coordinator_config_with_several_bad_values_names_each(tmp_path: Any) -> None:
    path = tmp_path / "coordinator.yaml"
    path.write_text("coordinator:\n  max_running_jobs: 0\n  safety_poll_s: 0\n  metrics_port: 70000\n"
                    "  strict_categories: maybe\n  listen_on: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(str(path), environ={})
    found = problems(info.value)
    assert set(found) == {"coordinator.max_running_jobs", "coordinator.safety_poll_s", "coordinator.metrics_port",
                          "coordinator.strict_categories", "coordinator.listen_on"}, found
    assert found["coordinator.max_running_jobs"] == "must be an integer >= 1, got 0"
    assert found["coordinator.strict_categories"] == "must be bool, got str 'maybe'"
    good = load_config(None, environ={"FEDBROKER__COORDINATOR__STRICT_CATEGORIES": "true"})
    assert good.coordinator.strict_categories is True


def test_an_async_jobs_staleness_problems_come_with_every_other_problem() -> None:
    job = copy.deepcopy(JOB)
    job["training"]["rounds"] = 0
    job["schedule"] = {"mode": "async", "staleness": "hinge", "staleness_params": {"a": -1, "b": "x", "c": 1}}
    found = refused(job)
    assert set(found) == {"training.rounds", "schedule.staleness_params.a", "schedule.staleness_params.b",
                          "schedule.staleness_params.c"}, found
    assert found["schedule.staleness_params.c"] == "is not a parameter of 'hinge' (it takes: a, b)"
