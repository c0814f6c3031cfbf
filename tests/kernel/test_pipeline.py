"""A job's preprocessing and augmentation as data (fedbroker.job.pipeline): every bad step named at its path, all at
once; the shape a site's samples come out at; a canonical form and digest."""

from __future__ import annotations

from typing import Any

import pytest

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.pipeline import MAX_SAMPLE_VALUES, DataPipeline, parse_pipeline, pipeline_from_json

FULL: dict[str, Any] = {
    "preprocess": [{"window": {"center": 40, "width": 400}}, {"resize": [64, 64]}, {"channels": 3},
                   {"normalize": "per_image"}],
    "augment": [{"flip": {"axes": [2], "p": 0.5}}, {"rotate90": {"p": 0.5}}, {"random_crop": {"size": [56, 56], "pad": 4}},
                {"intensity": {"scale": 0.1, "shift": 0.1, "p": 0.5}}],
}


def _fields(exc: ConfigError) -> list[str]:
    return [e.field for e in exc.errors] if isinstance(exc, ConfigErrors) else [exc.field]


@pytest.mark.parametrize(("raw", "field", "words"), [
    ({"preprocess": [{"blur": 3}]}, "data.preprocess[0].blur", "unknown preprocess step"),
    ({"preprocess": [{"flip": {}}]}, "data.preprocess[0].flip", "is an augment step"),
    ({"augment": [{"resize": [8, 8]}]}, "data.augment[0].resize", "is a preprocess step"),
    ({"preprocess": [{"resize": [64, 64]}, {"resize": [0, 64]}]}, "data.preprocess[1].resize", "integers in [1, 65536]"),
    ({"preprocess": [{"resize": [65536, 65536]}]}, "data.preprocess[0].resize", "above the limit"),
    ({"preprocess": [{"resize": [64]}]}, "data.preprocess[0].resize", "2 or 3 integers"),
    ({"preprocess": [{"resize_volume": [64, 64]}]}, "data.preprocess[0].resize_volume", "3 integers"),
    ({"preprocess": [{"resize": "64x64"}]}, "data.preprocess[0].resize", "integers"),
    ({"preprocess": [{"window": {"center": float("nan"), "width": 10}}]}, "data.preprocess[0].window.center", "finite"),
    ({"preprocess": [{"window": {"center": 0, "width": 0}}]}, "data.preprocess[0].window.width", "(0,"),
    ({"preprocess": [{"window": {"center": 0}}]}, "data.preprocess[0].window", "needs width"),
    ({"preprocess": [{"window": {"center": 0, "width": 1, "level": 2}}]}, "data.preprocess[0].window.level", "unknown"),
    ({"preprocess": [{"channels": 0}]}, "data.preprocess[0].channels", "[1, 64]"),
    ({"preprocess": [{"channels": True}]}, "data.preprocess[0].channels", "integer"),
    ({"preprocess": [{"normalize": "zscore"}]}, "data.preprocess[0].normalize", "per_image"),
    ({"preprocess": [{"normalize": {"mean": [0.5], "std": [0]}}]}, "data.preprocess[0].normalize.std[0]", "(0,"),
    ({"preprocess": [{"normalize": {"mean": [0.5, 0.5], "std": [1.0]}}]}, "data.preprocess[0].normalize", "2 means"),
    ({"preprocess": [{"resize": [8, 8], "crop": [4, 4]}]}, "data.preprocess[0]", "must be one step"),
    ({"preprocess": [{"resize": [8, 8]}] * 33}, "data.preprocess", "at most 32"),
    ({"preprocess": {"resize": [8, 8]}}, "data.preprocess", "a list of steps"),
    ({"augment": [{"flip": {"p": 1.5}}]}, "data.augment[0].flip.p", "[0, 1]"),
    ({"augment": [{"flip": {"p": float("inf")}}]}, "data.augment[0].flip.p", "finite"),
    ({"augment": [{"flip": {"axes": [0]}}]}, "data.augment[0].flip.axes", "[1, 3]"),
    ({"augment": [{"flip": {"axes": [2, 2]}}]}, "data.augment[0].flip.axes", "twice"),
    ({"augment": [{"rotate90": {"axes": [1, 1]}}]}, "data.augment[0].rotate90.axes", "two different"),
    ({"augment": [{"random_crop": {"pad": 4}}]}, "data.augment[0].random_crop.size", "required"),
    ({"augment": [{"random_crop": {"size": [8, 8], "pad": -1}}]}, "data.augment[0].random_crop.pad", "[0, 1024]"),
    ({"augment": [{"intensity": {"p": 0.5}}]}, "data.augment[0].intensity", "scale or shift"),
    ({"augment": [{"intensity": {"scale": 100}}]}, "data.augment[0].intensity.scale", "[0, 10]"),
    ({"expect": {"spacing": [1, 1]}}, "data.expect.spacing", "3 numbers"),
    ({"expect": {"spacing": [1, 1, -1]}}, "data.expect.spacing[2]", "(0,"),
    ({"expect": {"orientation": "RAX"}}, "data.expect.orientation", "RAS"),
    ({"expect": {"spacing_tolerance": 2}}, "data.expect.spacing_tolerance", "[0, 1]"),
    ({"expect": {"spacing_tolerance": 1}}, "data.expect.spacing_tolerance", "[0, 1)"),
    ({"preprocess": [{"resize": [8, 8]}], "augment": [{"random_crop": {"size": [4, 4, 4]}}]},
     "data.augment[0].random_crop.size", "2-D or 3-D"),
])
def test_a_bad_step_is_refused_at_its_path(raw: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_pipeline(raw)
    errors = caught.value.errors if isinstance(caught.value, ConfigErrors) else [caught.value]
    assert any(e.field == field and words in e.problem for e in errors), [str(e) for e in errors]


def test_every_problem_is_named_at_once() -> None:
    raw = {"preprocess": [{"resize": [10**6, 64]}, {"blur": 1}, {"window": {"center": float("nan"), "width": -1}}],
           "augment": [{"flip": {"p": 2}}, {"intensity": {"scale": -1}}], "expect": {"orientation": "XYZ"}}
    with pytest.raises(ConfigErrors) as caught:
        parse_pipeline(raw)
    assert _fields(caught.value) == [
        "data.preprocess[0].resize", "data.preprocess[1].blur", "data.preprocess[2].window.center",
        "data.preprocess[2].window.width", "data.augment[0].flip.p", "data.augment[1].intensity.scale",
        "data.expect.orientation"]


def test_a_pipeline_round_trips_through_its_dict_and_json_with_one_digest() -> None:
    pipeline = parse_pipeline(FULL)
    assert parse_pipeline(pipeline.to_dict()) == pipeline
    assert pipeline_from_json(pipeline.to_json()) == pipeline
    reordered = {"augment": FULL["augment"], "preprocess": [
        {"window": {"width": 400.0, "center": 40.0}}, *FULL["preprocess"][1:]]}
    assert parse_pipeline(reordered).digest() == pipeline.digest()
    changed = parse_pipeline({**FULL, "preprocess": [{"resize": [64, 65]}]})
    assert changed.digest() != pipeline.digest()
    assert parse_pipeline(None) == DataPipeline() == pipeline_from_json("")


def test_defaults_of_flip_and_rotate_follow_the_pipelines_rank() -> None:
    two = parse_pipeline({"preprocess": [{"resize": [8, 8]}], "augment": [{"flip": {}}, {"rotate90": {}}]})
    three = parse_pipeline({"preprocess": [{"resize_volume": [8, 8, 8]}], "augment": [{"flip": {}}, {"rotate90": {}}]})
    assert [s.args["axes"] for s in two.augment] == [(2,), (1, 2)]
    assert [s.args["axes"] for s in three.augment] == [(3,), (2, 3)]


@pytest.mark.parametrize(("site", "out"), [
    ((1, 512, 512), (3, 64, 64)),
    ((1, 0, 0), (3, 64, 64)),        # files of any size: the resize fixes them
    ((3, 30, 40), (3, 64, 64)),
])
def test_output_shape_of_the_full_pipeline(site: tuple[int, ...], out: tuple[int, ...]) -> None:
    assert parse_pipeline(FULL).output_shape(site) == out


@pytest.mark.parametrize(("raw", "site", "out"), [
    ({}, (1, 28, 28), (1, 28, 28)),
    ({"preprocess": [{"crop": [20, 20]}]}, (1, 0, 28), (1, 20, 20)),
    ({"preprocess": [{"pad": [32, 32]}]}, (1, 28, 0), (1, 32, 32)),
    ({"preprocess": [{"resize_volume": [16, 32, 32]}]}, (1, 0, 0, 0), (1, 16, 32, 32)),
    ({"preprocess": [{"channels": 3}, {"normalize": {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.2, 0.2]}}]},
     (1, 8, 8), (3, 8, 8)),
])
def test_output_shape(raw: dict[str, Any], site: tuple[int, ...], out: tuple[int, ...]) -> None:
    assert parse_pipeline(raw).output_shape(site) == out


@pytest.mark.parametrize(("raw", "site", "field", "words"), [
    ({}, (1, 0, 28), "data.preprocess", "differ in size along axes [1]"),
    ({"preprocess": [{"resize": [8, 8]}]}, (1, 4, 8, 8), "data.preprocess[0].resize", "2-D"),
    ({"preprocess": [{"crop": [64, 64]}]}, (1, 32, 0), "data.preprocess[0].crop", "larger"),
    ({"preprocess": [{"pad": [16, 16]}]}, (1, 32, 32), "data.preprocess[0].pad", "smaller"),
    ({"preprocess": [{"channels": 3}]}, (2, 8, 8), "data.preprocess[0].channels", "2 channels"),
    ({"preprocess": [{"normalize": {"mean": [0, 0], "std": [1, 1]}}]}, (3, 8, 8), "data.preprocess[0].normalize",
     "3 channels"),
    ({"augment": [{"rotate90": {}}]}, (1, 8, 16), "data.augment[0].rotate90.axes", "square"),
    ({"augment": [{"flip": {"axes": [3]}}]}, (1, 8, 8), "data.augment[0].flip.axes", "1 to 2"),
    ({"augment": [{"random_crop": {"size": [12, 12], "pad": 1}}]}, (1, 8, 8), "data.augment[0].random_crop.size",
     "larger"),
    ({"preprocess": [{"channels": 64}]}, (1, 4096, 4096), "data.preprocess", f"at most {MAX_SAMPLE_VALUES:,}"),
    ({}, (0, 8, 8), "data", "channels"),
])
def test_output_shape_refuses_samples_the_pipeline_cannot_take(raw: dict[str, Any], site: tuple[int, ...],
                                                                field: str, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_pipeline(raw).output_shape(site)
    assert caught.value.field == field and words in caught.value.problem, str(caught.value)


def test_describe_says_each_step_in_a_sentence() -> None:
    lines = parse_pipeline({**FULL, "expect": {"orientation": "RAS"}}).describe()
    volume = parse_pipeline({"preprocess": [{"resize_volume": [8, 8, 8]}], "expect": {"spacing": [1, 1, 2]}})
    text = "\n".join(lines + volume.describe())
    assert "clipped to [-160, 240] and scaled linearly to [0, 1]" in text
    assert "Resized to 64 × 64" in text and "repeated to 3 channels" in text
    assert "In training only" in text and "random 56 × 56 window" in text
    assert "spacing 1 × 1 × 2 mm" in text and "RAS orientation" in text
    assert len(lines) == 1 + 4 + 1 + 4 + 1
