"""The data pipeline inside a job: parsed with the `data:` section, checked against the model, carried in the job's
settings (DataSettings.pipeline_json) and checked again where they are read, as a site does."""

from __future__ import annotations

from typing import Any

import pytest

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.pipeline import DataPipeline, parse_pipeline
from fedbroker.job.settings import parse_settings, settings_message
from fedbroker.job.spec import job_from_json, job_from_text, parse_job

CNN = {"input_shape": [3, 32, 32], "layers": [
    {"type": "Conv2d", "in_channels": 3, "out_channels": 4, "kernel_size": 3, "padding": 1},
    {"type": "ReLU"}, {"type": "AdaptiveAvgPool2d", "output_size": 1}, {"type": "Flatten"},
    {"type": "Linear", "in_features": 4, "out_features": 2}]}
DATA: dict[str, Any] = {
    "preprocess": [{"window": {"center": 40, "width": 400}}, {"resize": [32, 32]}, {"channels": 3},
                   {"normalize": "per_image"}],
    "augment": [{"flip": {"axes": [2], "p": 0.5}}, {"rotate90": {"p": 0.5}},
                {"random_crop": {"size": [28, 28], "pad": 4}}, {"intensity": {"scale": 0.1, "shift": 0.1}}],
}
YAML = """
name: ct
category: c
model:
  input_shape: [3, 32, 32]
  layers:
    - {type: Conv2d, in_channels: 3, out_channels: 4, kernel_size: 3, padding: 1}
    - {type: ReLU}
    - {type: AdaptiveAvgPool2d, output_size: 1}
    - {type: Flatten}
    - {type: Linear, in_features: 4, out_features: 2}
data:
  preprocess:
    - {window: {center: 40, width: 400}}
    - {resize: [32, 32]}
    - {channels: 3}
    - {normalize: per_image}
  augment:
    - {flip: {axes: [2], p: 0.5}}
    - {rotate90: {p: 0.5}}
    - {random_crop: {size: [28, 28], pad: 4}}
    - {intensity: {scale: 0.1, shift: 0.1}}
"""


def job(data: Any, model: dict[str, Any] = CNN, **extra: Any) -> dict[str, Any]:
    return {"name": "j", "category": "c", "model": model, "data": data, **extra}


def problems(raw: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_job(raw)
    errors = info.value.errors if isinstance(info.value, ConfigErrors) else [info.value]
    return {e.field: e.problem for e in errors}


def test_the_yaml_section_parses_and_travels_in_the_jobs_wire_form() -> None:
    spec = job_from_text(YAML)
    assert spec.data.pipeline == parse_pipeline(DATA)
    assert job_from_json(spec.to_json()) == spec
    assert spec.to_dict()["data"] == {"standardize": "none", **parse_pipeline(DATA).to_dict()}


def test_the_pipeline_travels_in_the_settings_and_is_parsed_again() -> None:
    spec = parse_job(job(DATA))
    message = settings_message("job-1", spec)
    assert message.data.pipeline_json == spec.data.pipeline.to_json()
    assert parse_settings(message).data.pipeline == spec.data.pipeline


def test_a_job_without_a_pipeline_sends_what_it_sent_before() -> None:
    spec = parse_job(job(None))
    message = settings_message("job-1", spec)
    assert spec.data.pipeline == DataPipeline() and message.data.pipeline_json == ""
    assert b"pipeline" not in message.data.SerializeToString(deterministic=True)
    assert parse_settings(message).data.pipeline == DataPipeline()


@pytest.mark.parametrize(("pipeline_json", "field"), [
    ('{"preprocess":[{"resize":[65536,65536]}]}', "data.preprocess[0].resize"),          # a site's memory
    ('{"preprocess":[{"exec":"import os"}]}', "data.preprocess[0].exec"),                  # no code travels
    ('{"preprocess":[' + ",".join(['{"channels":1}'] * 1000) + "]}", "data.preprocess"),    # 10^3 steps
    ('{"augment":[{"flip":{"p":NaN}}]}', "data.augment[0].flip.p"),
    ('{"preprocess":[{"window":{"center":Infinity,"width":1}}]}', "data.preprocess[0].window.center"),
    ("[1, 2]", "data"),
    ("{not json", "data"),
    ('{"preprocess":[' + ",".join(['{"channels":1}'] * 10**6) + "]}", "data"),             # 10^6: the text's size
])
def test_a_hostile_pipeline_in_the_settings_is_refused_where_they_are_read(pipeline_json: str, field: str) -> None:
    """The server may be dishonest: a site checks the pipeline itself, before it reads a file."""
    message = settings_message("job-1", parse_job(job(None)))
    message.data.pipeline_json = pipeline_json
    with pytest.raises(ConfigError) as info:
        parse_settings(message)
    errors = info.value.errors if isinstance(info.value, ConfigErrors) else [info.value]
    assert field in [e.field for e in errors], str(info.value)


@pytest.mark.parametrize(("data", "model", "field", "words"), [
    ({"preprocess": [{"resize": [64, 64]}]}, CNN, "data.preprocess[0].resize", "model.input_shape is [3, 32, 32]"),
    ({"preprocess": [{"resize": [32, 32]}, {"channels": 1}]}, CNN, "data.preprocess[1].channels", "takes 3"),
    ({"preprocess": [{"resize_volume": [8, 32, 32]}]}, CNN, "data", "3-D but model.input_shape"),
    ({"augment": [{"random_crop": {"size": [40, 40]}}]}, CNN, "data.augment[0].random_crop.size", "larger"),
    ({"augment": [{"flip": {"axes": [3]}}]}, CNN, "data.augment[0].flip.axes", "1 to 2"),
    ({"preprocess": [{"normalize": "per_image"}]},
     {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]}, "data",
     "apply to images"),
    ({"standardize": "federated", "bounds": [0, 1], "preprocess": [{"resize": [32, 32]}]}, CNN, "data.standardize",
     "normalize"),
])
def test_a_pipeline_that_does_not_make_the_models_input_is_refused(data: dict[str, Any], model: dict[str, Any],
                                                                   field: str, words: str) -> None:
    found = problems(job(data, model))
    assert field in found and words in found[field], found


def test_the_coordinators_evaluation_sets_are_not_prepared_by_the_pipeline() -> None:
    found = problems(job({"preprocess": [{"resize": [32, 32]}]}, evaluation={"dataset": "digits"}))
    assert "is not prepared by the job's data.preprocess" in found["evaluation.dataset"]


def test_problems_of_the_pipeline_come_with_the_jobs_other_problems() -> None:
    found = problems(job({"preprocess": [{"blur": 2}], "bounds": "x"}, training={"lr": -1}))
    assert {"data.preprocess[0].blur", "data.bounds", "training.lr"} <= set(found)
