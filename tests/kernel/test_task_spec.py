"""A job's `task:` section: what the model's output must be is the task's rule, checked at submission with the
path of what is wrong; a job without the section is the classification job it always was."""

from __future__ import annotations

from typing import Any

import pytest

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.settings import parse_settings, settings_message
from fedbroker.job.spec import job_from_json, parse_job
from fedbroker.job.task import TaskConfig


def _job(task: Any, layers: list[dict[str, Any]], input_shape: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": "t", "category": "c", "model": {"input_shape": input_shape, "layers": layers}}
    if task is not None:
        out["task"] = task
    return out


MLP = [{"type": "Linear", "in_features": 4, "out_features": 8}, {"type": "ReLU"},
       {"type": "Linear", "in_features": 8, "out_features": 3}]
SEG = [{"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": 3, "padding": 1}, {"type": "ReLU"},
       {"type": "Conv2d", "in_channels": 4, "out_channels": 3, "kernel_size": 1}]


def _problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_job(raw)
    errors = exc.value.errors if isinstance(exc.value, ConfigErrors) else [exc.value]
    return [f"{e.field}: {e.problem}" for e in errors]


def test_a_job_without_a_task_is_classification_as_before() -> None:
    job = parse_job(_job(None, MLP, [4]))
    assert job.task == TaskConfig() and job.task.metric == "accuracy"


def test_each_task_takes_the_output_it_needs() -> None:
    assert parse_job(_job({"type": "multilabel", "labels": 3}, MLP, [4])).task.labels == 3
    assert parse_job(_job({"type": "regression", "loss": "huber", "huber_delta": 2}, MLP, [4])).task.huber_delta == 2.0
    assert parse_job(_job("classification", MLP, [4])).task.type == "classification"
    seg = parse_job(_job({"type": "segmentation", "classes": 3}, SEG, [1, 8, 8]))
    assert seg.task.classes == 3 and seg.model.num_outputs == 3


def test_an_output_that_does_not_fit_the_task_is_refused_naming_the_last_layer() -> None:
    (problem,) = _problems(_job({"type": "multilabel", "labels": 5}, MLP, [4]))
    assert problem.startswith("model.layers[2]: the model outputs [3]: multilabel with task.labels 5")
    (problem,) = _problems(_job({"type": "segmentation", "classes": 2}, SEG, [1, 8, 8]))
    assert "needs one score per class and pixel, [2, 8, 8]" in problem
    (problem,) = _problems(_job(None, SEG, [1, 8, 8]))
    assert "classification needs class scores, a flat vector, not [3, 8, 8]" in problem
    (problem,) = _problems(_job({"class_weights": [1, 2]}, MLP, [4]))
    assert "task.class_weights has 2 weights but the model outputs 3 class scores" in problem


def test_every_problem_of_the_task_section_is_named_at_once() -> None:
    problems = _problems(_job({"type": "classification", "class_weights": [1, -1, "x"], "label_smoothing": 1.5,
                               "labels": 3}, MLP, [4]))
    assert {p.split(":")[0] for p in problems} == {"task.labels", "task.class_weights[1]", "task.class_weights[2]",
                                                   "task.label_smoothing"}
    assert _problems(_job({"type": "ranking"}, MLP, [4]))[0].startswith("task.type: must be")
    assert _problems(_job({"type": "segmentation"}, SEG, [1, 8, 8]))[0].startswith("task.classes: is required")


def test_the_task_travels_in_the_job_and_in_its_settings() -> None:
    job = parse_job(_job({"type": "classification", "class_weights": [1, 2, 3], "label_smoothing": 0.1}, MLP, [4]))
    assert job_from_json(job.to_json()).task == job.task
    assert parse_settings(settings_message("job-1", job)).task == job.task
