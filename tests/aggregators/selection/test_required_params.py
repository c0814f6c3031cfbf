"""A selection (or any algorithm) whose required parameter is missing is refused at submission, naming it."""

from __future__ import annotations

import pytest

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.submission import accept_job

JOB = {"name": "ga", "category": "digits",
       "model": {"input_shape": [1, 8, 8], "layers": [{"type": "Flatten"},
                                                     {"type": "Linear", "in_features": 64, "out_features": 10}]},
       "aggregation": {"selection": "ga"}}


def fields(exc: ConfigError) -> list[str]:
    return [e.field for e in exc.errors] if isinstance(exc, ConfigErrors) else [exc.field]


def test_ga_without_m_names_the_missing_parameter_not_a_python_signature() -> None:
    with pytest.raises(ConfigError) as info:
        accept_job(JOB)
    assert "aggregation.selection_params.m" in fields(info.value)
    assert "__init__" not in str(info.value) and "required for selection 'ga'" in str(info.value)


def test_ga_with_m_is_accepted() -> None:
    job = accept_job({**JOB, "training": {"rounds": 10},  # ga_gap 10: round 10 is a GA round
                      "aggregation": {"selection": "ga", "selection_params": {"m": 2, "probe_dataset": "digits"}}})
    assert job.aggregation.selection == "ga"
