"""A site judges a job's model against its own samples as the job's pipeline prepares them, from the settings it
parsed itself (never the server's word), before any training step or evaluation."""

from __future__ import annotations

import numpy as np

from fedbroker.datasets.stream import FileSamples
from fedbroker.job.pipeline import parse_pipeline
from fedbroker.job.settings import parse_settings, settings_message
from fedbroker.job.spec import parse_job, parse_model
from fedbroker.worker.batches import job_pipeline
from fedbroker.worker.global_model import fit_problem

MODEL = {"input_shape": [3, 16, 16], "layers": [
    {"type": "Conv2d", "in_channels": 3, "out_channels": 2, "kernel_size": 3, "padding": 1},
    {"type": "AdaptiveAvgPool2d", "output_size": 1}, {"type": "Flatten"},
    {"type": "Linear", "in_features": 2, "out_features": 2}]}
DATA = {"preprocess": [{"resize": [16, 16]}, {"channels": 3}], "augment": [{"flip": {}}]}


def files(shape: tuple[int, ...]) -> FileSamples:
    return FileSamples(["a.png", "b.png"], lambda key: np.zeros((1, 20, 24), np.float32), sample_shape=shape)


def test_the_site_reads_the_pipeline_from_the_settings_it_parsed() -> None:
    job = parse_job({"name": "j", "category": "c", "model": MODEL, "data": DATA})
    installed = parse_settings(settings_message("job-1", job))
    assert job_pipeline(installed) == parse_pipeline(DATA)
    plain = parse_settings(settings_message("job-2", parse_job({"name": "j", "category": "c", "model": MODEL})))
    assert plain.pipeline is None and job_pipeline(plain) is None


def test_files_of_varying_size_fit_when_the_pipeline_resizes_them() -> None:
    spec = parse_model(MODEL)
    assert fit_problem(spec, files((1, 0, 0)), 2, holder="this worker's data", pipeline=parse_pipeline(DATA)) == ""


def test_files_of_varying_size_are_refused_without_a_resize() -> None:
    spec = parse_model(MODEL)
    problem = fit_problem(spec, files((1, 0, 0)), 2, holder="this worker's data")
    assert "does not fit this worker's data, whose samples have shape [1, 0, 0]" in problem
    problem = fit_problem(spec, files((1, 0, 0)), 2, holder="this worker's data",
                          pipeline=parse_pipeline({"preprocess": [{"channels": 3}]}))
    assert "the job's data pipeline cannot take this worker's data" in problem and "resize, crop or pad" in problem


def test_a_pipeline_preparing_another_shape_is_refused() -> None:
    spec = parse_model(MODEL)
    problem = fit_problem(spec, files((1, 0, 0)), 2, holder="this site's data",
                          pipeline=parse_pipeline({"preprocess": [{"resize": [16, 16]}]}))
    assert "prepares to shape [1, 16, 16]" in problem
