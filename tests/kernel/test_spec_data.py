"""A job's `data` section (fedbroker.job.spec_data): every problem named with its full path, all at once, and the
section in the job's one wire form."""

from __future__ import annotations

from typing import Any

import pytest

from fedbroker.algorithms.catalogue import needs_histograms
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.spec import AggregationConfig, job_from_json, parse_job
from fedbroker.job.spec_data import DataConfig

MODEL = {"input_shape": [2, 2], "layers": [{"type": "Flatten"}, {"type": "Linear", "in_features": 4, "out_features": 3}]}


def job(data: Any, **extra: Any) -> dict[str, Any]:
    return {"name": "j", "category": "c", "model": MODEL, "data": data, **extra}


def problems(raw: dict[str, Any]) -> dict[str, str]:
    with pytest.raises((ConfigError, ConfigErrors)) as info:
        parse_job(raw)
    errors = info.value.errors if isinstance(info.value, ConfigErrors) else [info.value]
    return {e.field: e.problem for e in errors}


@pytest.mark.parametrize("data", [
    {"standardize": "federated", "bounds": [0, 16]},
    {"standardize": "federated", "bounds": [[0, 1], [-1, 1], [0, 255], [2.5, 3]]},
    {"standardize": "none"},
    None,
])
def test_the_section_travels_in_the_jobs_wire_form(data: Any) -> None:
    spec = parse_job(job(data))
    assert job_from_json(spec.to_json()) == spec
    assert spec.to_dict()["data"] == (data or {"standardize": "none"})


def test_a_single_pair_bounds_every_feature_and_a_list_names_each_one() -> None:
    one = parse_job(job({"standardize": "federated", "bounds": [0, 16]})).data
    assert one.feature_bounds(4) == ([0.0] * 4, [16.0] * 4)
    each = parse_job(job({"standardize": "federated", "bounds": [[0, 1], [-1, 1], [0, 255], [2, 3]]})).data
    assert each.feature_bounds(4) == ([0.0, -1.0, 0.0, 2.0], [1.0, 1.0, 255.0, 3.0])
    assert parse_job(job(None)).data == DataConfig()


def test_every_problem_of_the_section_is_named_at_once_with_its_path() -> None:
    found = problems(job({"standardize": "federated", "bounds": [[0, 1], [0, "a"], [3, 1], [0, float("inf")]],
                          "scale": 2}, seed=-1))
    assert set(found) == {"seed", "data.scale", "data.bounds[1]", "data.bounds[2]", "data.bounds[3]"}
    assert found["data.bounds[2]"] == "lo must be below hi, got [3, 1]"
    assert "two finite numbers" in found["data.bounds[3]"]
    assert "required with standardize federated" in problems(job({"standardize": "federated"}))["data.bounds"]
    assert problems(job({"bounds": [0, 1]}))["data.bounds"] == "applies only with standardize federated"
    assert "worker data.standardize" in problems(job({"standardize": "site"}))["data.standardize"]
    assert problems(job("raw"))["data"] == "must be a mapping, got str"
    assert "[lo, hi] or a list" in problems(job({"standardize": "federated", "bounds": "0..1"}))["data.bounds"]
    huge = problems(job({"standardize": "federated", "bounds": [0, 10**400]}))
    assert "two finite numbers" in huge["data.bounds"]


def test_per_feature_bounds_must_number_the_models_input_features() -> None:
    found = problems(job({"standardize": "federated", "bounds": [[0, 1]] * 3}))
    assert found["data.bounds"].startswith("has 3 [lo, hi] pairs but the model takes 4 input features")


def test_a_direct_construction_is_checked_as_a_parsed_one() -> None:
    with pytest.raises(ConfigErrors):
        DataConfig(standardize="federated", bounds=((1.0, 0.0), (0.0, float("nan"))))
    with pytest.raises(ConfigError, match="data.standardize"):
        DataConfig(standardize="z")


def test_a_job_needs_histograms_when_any_of_its_algorithms_declares_it() -> None:
    assert needs_histograms(AggregationConfig(weighting="dwfed"))
    assert needs_histograms(AggregationConfig(alignment="pfnm")) and needs_histograms(AggregationConfig(alignment="nafi"))
    assert not needs_histograms(AggregationConfig())
    assert not needs_histograms(AggregationConfig(alignment="feddna", selection="ga", weighting="uniform"))
    assert not needs_histograms(AggregationConfig(weighting="magic"))  # unknown: refused at submission, not here


def test_a_federated_job_refuses_a_model_that_standardises_itself_already() -> None:
    model = {"input_shape": [4], "layers": [{"type": "standardize", "mean": 0.0, "std": 1.0},
                                            {"type": "Linear", "in_features": 4, "out_features": 2}]}
    found = problems({"name": "j", "category": "c", "model": model,
                      "data": {"standardize": "federated", "bounds": [0, 1]}})
    assert "puts the agreed standardize layer in front of the model" in found["model.layers[0].type"]
    assert parse_job({"name": "j", "category": "c", "model": model}).model.layers[0].type == "standardize"


def test_a_standardize_layers_values_must_be_float32_numbers() -> None:
    model = {"input_shape": [2], "layers": [{"type": "standardize", "mean": [0.0, 10**400], "std": [1.0, 0.0]},
                                            {"type": "Linear", "in_features": 2, "out_features": 2}]}
    found = problems({"name": "j", "category": "c", "model": model})
    assert "within float32's range" in found["model.layers[0].mean[1]"] and "> 0" in found["model.layers[0].std[1]"]
