"""A job with a data pipeline, judged against the sites' registered sample shapes: a site whose files differ in size
registers 0 for those spatial sizes (never for channels), and only a job that resizes, crops or pads takes it;
the others are refused at submission, naming the sites."""

from __future__ import annotations

import pytest

from fedbroker.config import DPPolicy
from fedbroker.coordinator.control import InvalidControlMessage, check_control
from fedbroker.coordinator.participants import data_fit_problems
from fedbroker.coordinator.records import WorkerRecord
from fedbroker.job.pipeline import DataPipeline, parse_pipeline
from fedbroker.job.spec import parse_model
from fedbroker.proto import fedbroker_pb2 as pb

MODEL = parse_model({"input_shape": [3, 32, 32], "layers": [
    {"type": "Conv2d", "in_channels": 3, "out_channels": 4, "kernel_size": 3, "padding": 1},
    {"type": "AdaptiveAvgPool2d", "output_size": 1}, {"type": "Flatten"},
    {"type": "Linear", "in_features": 4, "out_features": 2}]})
RESIZING = parse_pipeline({"preprocess": [{"resize": [32, 32]}, {"channels": 3}]})


def record(worker_id: str, shape: tuple[int, ...]) -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, categories=("c",), histogram=(), dp=DPPolicy(enabled=False),
                        epsilon_spent=0.0, device="cpu", num_samples=10, last_seen=0.0, input_shape=shape,
                        num_classes=2)


def registration(shape: list[int]) -> pb.Envelope:
    return pb.Envelope(registration=pb.Registration(
        worker_id="w1", categories=["c"], num_samples=10, input_shape=shape, num_classes=2, device="cpu",
        label_histogram=[5, 5]))


@pytest.mark.parametrize("shape", [[1, 0, 0], [1, 0, 512], [1, 0, 0, 0], [3, 64, 64], [30]])
def test_a_site_registers_zero_for_a_spatial_size_its_files_vary_in(shape: list[int]) -> None:
    check_control(registration(shape))


@pytest.mark.parametrize("shape", [[0, 64, 64], [0], [8, 0], [1, 0, 0, 0, 0], [1, 70000, 64]])
def test_zero_channels_or_a_zero_outside_an_image_is_refused(shape: list[int]) -> None:
    with pytest.raises(InvalidControlMessage, match="input_shape"):
        check_control(registration(shape))


def test_a_resizing_pipeline_takes_every_site_it_can_prepare() -> None:
    sites = [record("varying", (1, 0, 0)), record("big", (1, 512, 512)), record("rgb", (3, 20, 30)),
             record("old", ())]
    assert data_fit_problems(MODEL, sites, category="c", pipeline=RESIZING) == []


def test_sites_the_pipeline_cannot_take_are_named_with_the_step() -> None:
    sites = [record("ok", (1, 0, 0)), record("two", (2, 32, 32)), record("vol-a", (1, 8, 32, 32)),
             record("vol-b", (1, 8, 32, 32))]
    problems = data_fit_problems(MODEL, sites, category="c", pipeline=RESIZING)
    by_field = {p.field: str(p) for p in problems}
    assert set(by_field) == {"data.preprocess[1].channels", "data.preprocess[0].resize"}
    assert "worker two (category 'c')" in by_field["data.preprocess[1].channels"]
    assert "workers vol-a, vol-b (category 'c')" in by_field["data.preprocess[0].resize"]


def test_a_pipeline_that_prepares_another_shape_is_refused_naming_the_sites() -> None:
    grey = parse_pipeline({"preprocess": [{"resize": [32, 32]}]})
    problems = data_fit_problems(MODEL, [record("a", (1, 0, 0)), record("b", (3, 40, 40))], category="c",
                                 pipeline=grey)
    assert [p.field for p in problems] == ["model.input_shape"]
    assert "prepares the samples of worker a (category 'c') to shape [1, 32, 32]" in str(problems[0])


def test_without_a_resizing_step_sites_of_varying_files_are_refused_by_name() -> None:
    sites = [record("fixed", (3, 32, 32)), record("varying", (3, 0, 0))]
    for pipeline in (None, DataPipeline(), parse_pipeline({"preprocess": [{"normalize": "per_image"}]})):
        problems = data_fit_problems(MODEL, sites, category="c", pipeline=pipeline)
        assert len(problems) == 1 and "varying" in str(problems[0]) and "fixed" not in str(problems[0])
        assert "resize, crop or pad" in str(problems[0])


def test_without_a_pipeline_the_check_is_todays() -> None:
    sites = [record("a", (3, 32, 32)), record("b", (1, 32, 32))]
    problems = data_fit_problems(MODEL, sites, category="c")
    assert [p.field for p in problems] == ["model.input_shape"]
    assert str(problems[0]) == ("model.input_shape: is [3, 32, 32] but the samples of worker b (category 'c') have "
                                "shape [1, 32, 32]")
