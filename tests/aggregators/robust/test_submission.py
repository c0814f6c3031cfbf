"""Submission refuses a robust rule where it cannot work, and bad rule parameters, every problem at once, each
named by its field: a rule beside asynchronous mode, an alignment or secure aggregation, a root set the model
cannot read."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.algorithms.catalogue import aggregation_settings
from fedbroker.errors import ConfigError
from fedbroker.job.spec import AggregationConfig
from fedbroker.job.submission import accept_job
from tests.aggregators.test_async_book import AGG, config
from tests.aggregators.test_rounds import SPEC, weights
from tests.kernel.test_every_problem import JOB, refused


def job(**aggregation: Any) -> dict[str, Any]:
    out = copy.deepcopy(JOB)
    out["aggregation"] = aggregation
    return out


def test_every_rule_is_accepted_with_its_parameters_and_turns_the_running_mean_off() -> None:
    for rule, params in [("median", {}), ("trimmed_mean", {"beta": 0.2}), ("multi_krum", {"f": 2, "m": 5}),
                         ("geometric_median", {"iterations": 4}), ("norm_bound", {"max_norm": 3.0}),
                         ("fltrust", {"probe_dataset": "digits"})]:
        spec = accept_job(job(robust=rule, robust_params=params))
        settings = aggregation_settings(spec.aggregation)
        assert settings.robust.name == rule and not settings.incremental
    assert aggregation_settings(AggregationConfig()).incremental  # robust: none keeps the running mean


def test_bad_rule_parameters_are_all_named_at_once() -> None:
    found = refused(job(robust="multi_krum", robust_params={"f": -1, "m": 0, "z": 3}))
    assert set(found) == {"aggregation.robust_params.z"}  # an unknown parameter first: the rest is not guessed
    found = refused(job(robust="multi_krum", robust_params={"f": -1, "m": 0}))
    assert set(found) == {"aggregation.robust_params.f", "aggregation.robust_params.m"}
    found = refused(job(robust="norm_bound"))
    assert set(found) == {"aggregation.robust_params.max_norm"} and "required" in found["aggregation.robust_params.max_norm"]
    found = refused(job(robust="krum"))
    assert "multi_krum" in found["aggregation.robust"] and "unknown robust algorithm" in found["aggregation.robust"]


def test_a_rule_is_refused_with_async_mode_an_alignment_and_secure_aggregation_saying_why() -> None:
    asynchronous = job(robust="median")
    asynchronous["schedule"] = {"mode": "async"}
    assert "schedule.mode async folds each update" in refused(asynchronous)["aggregation.robust"]
    assert "permutes" in refused(job(robust="median", alignment="feddna"))["aggregation.robust"]
    assert "only their sum" in refused(job(robust="median", secure=True))["aggregation.robust"]


def test_fltrust_s_root_set_must_fit_the_model() -> None:
    found = refused(job(robust="fltrust", robust_params={"probe_dataset": "iris"}))
    assert "aggregation.robust_params.probe_dataset" in found
    assert "samples of shape" in found["aggregation.robust_params.probe_dataset"]
    found = refused(job(robust="fltrust", robust_params={"probe_dataset": "imagenet", "lr": -1}))
    assert set(found) == {"aggregation.robust_params.probe_dataset", "aggregation.robust_params.lr"}


def test_the_service_refuses_an_asynchronous_buffer_with_a_rule_naming_the_field() -> None:
    book = RoundBook(max_update_bytes=10_000)
    book.put_global("j", 1, SPEC.to_json(), weights(0.0))
    with pytest.raises(ConfigError) as info:
        book.open_buffer("j", config(aggregation={**AGG, "robust": "median"}))
    assert info.value.field == "aggregation.robust" and "schedule.mode async" in info.value.problem
