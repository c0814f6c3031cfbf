"""The job's pipeline applied with MONAI (fedbroker.datasets.transforms): a prepared sample has the shape the
kernel predicts, windows map to [0, 1], a mask moves with its image, and one seed gives one batch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fedbroker.datasets.transforms import augment, prepare
from fedbroker.job.pipeline import parse_pipeline

GEOMETRIC = {"augment": [{"flip": {"axes": [1, 2], "p": 0.5}}, {"rotate90": {"p": 0.5}},
                         {"random_crop": {"size": [16, 16], "pad": 3}}]}


def _masks(n: int, size: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 4, size=(n, size, size)))


@pytest.mark.parametrize("raw", [
    {"preprocess": [{"window": {"center": 40, "width": 400}}, {"resize": [32, 24]}, {"channels": 3},
                    {"normalize": "per_image"}]},
    {"preprocess": [{"crop": [20, 20]}, {"normalize": {"mean": [0.5], "std": [0.25]}}]},
    {"preprocess": [{"pad": [70, 70]}, {"channels": 3}]},
    {"preprocess": [{"resize": [9, 9]}, {"crop": [7, 5]}, {"pad": [8, 8]}]},
])
@pytest.mark.parametrize("site", [(1, 21, 33), (1, 64, 64), (1, 5, 70), (1, 70, 5)])
def test_a_prepared_sample_has_the_predicted_shape(raw: dict[str, Any], site: tuple[int, ...]) -> None:
    pipeline = parse_pipeline(raw)
    for_varying = (site[0], 0, 0)  # what a site whose files differ registers
    sample = np.random.default_rng(1).normal(size=site).astype(np.float32) * 100
    mask = (sample[0] > 0).astype(np.int64)
    problems = pipeline.shape_problems(site)
    if problems:  # a crop larger (or a pad smaller) than these files: refused before any file is read
        assert [p.field for p in problems] == ["data.preprocess[0].crop"] and min(site[1:]) < 20
        return
    expected = pipeline.output_shape(site)
    assert expected == pipeline.output_shape(for_varying)
    prepared = prepare(pipeline, sample)
    assert prepared.shape == expected and prepared.dtype == np.float32
    prepared_mask = prepare(pipeline, mask, mask=True)
    assert prepared_mask.shape == expected[1:] and prepared_mask.dtype == np.int64
    assert set(np.unique(prepared_mask)) <= {0, 1}   # nearest neighbour: no class in between


@pytest.mark.parametrize("site", [(1, 12, 20, 16), (1, 40, 8, 8)])
def test_a_prepared_volume_has_the_predicted_shape(site: tuple[int, ...]) -> None:
    pipeline = parse_pipeline({"preprocess": [{"resize_volume": [8, 16, 16]}, {"crop": [8, 12, 12]}]})
    sample = np.random.default_rng(2).normal(size=site).astype(np.float32)
    assert prepare(pipeline, sample).shape == pipeline.output_shape(site) == (1, 8, 12, 12)
    assert prepare(pipeline, (sample[0] > 0).astype(np.int64), mask=True).shape == (8, 12, 12)


def test_a_window_maps_its_range_to_zero_one_and_clips_outside() -> None:
    center, width = 40.0, 400.0
    pipeline = parse_pipeline({"preprocess": [{"window": {"center": center, "width": width}}]})
    raw = np.array([[[-1000.0, center - width / 2, center, center + width / 2, 3000.0, center + width / 4]]],
                   dtype=np.float32)
    np.testing.assert_allclose(prepare(pipeline, raw)[0, 0], [0.0, 0.0, 0.5, 1.0, 1.0, 0.75], atol=1e-6)


def test_normalize_per_image_and_with_fixed_statistics() -> None:
    x = np.random.default_rng(3).normal(5.0, 3.0, size=(3, 16, 16)).astype(np.float32)
    raw = x.copy()
    per_image = prepare(parse_pipeline({"preprocess": [{"normalize": "per_image"}]}), x)
    np.testing.assert_allclose(per_image.mean(axis=(1, 2)), 0.0, atol=1e-5)
    np.testing.assert_allclose(per_image.std(axis=(1, 2)), 1.0, atol=1e-3)
    fixed = prepare(parse_pipeline({"preprocess": [{"normalize": {"mean": [1, 2, 3], "std": [2, 4, 8]}}]}), x)
    np.testing.assert_allclose(fixed, (x - np.array([1, 2, 3])[:, None, None]) / np.array([2, 4, 8])[:, None, None],
                               rtol=1e-5)
    assert np.array_equal(x, raw)   # the raw sample is never written into


def test_channels_repeat_the_grey_channel() -> None:
    x = np.random.default_rng(4).random((1, 6, 6)).astype(np.float32)
    out = prepare(parse_pipeline({"preprocess": [{"channels": 3}]}), x)
    assert out.shape == (3, 6, 6) and all(np.array_equal(out[c], x[0]) for c in range(3))


def test_a_certain_flip_flips_image_and_mask_alike() -> None:
    pipeline = parse_pipeline({"augment": [{"flip": {"axes": [2], "p": 1.0}}]})
    xb, yb = torch.randn(4, 2, 16, 16), _masks(4)
    out_x, out_y = augment(pipeline, xb, yb, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out_x, torch.flip(xb, dims=[3])) and out_y is not None
    assert torch.equal(out_y, torch.flip(yb, dims=[2]))


def test_a_mask_gets_the_same_geometric_change_as_its_image() -> None:
    pipeline = parse_pipeline(GEOMETRIC)
    yb = _masks(32)
    xb = yb.unsqueeze(1).to(torch.float32).repeat(1, 2, 1, 1)  # an image that shows its mask, two channels
    out_x, out_y = augment(pipeline, xb, yb, generator=torch.Generator().manual_seed(5))
    assert out_y is not None and out_y.dtype == torch.int64 and out_y.shape == yb.shape
    assert torch.equal(out_x[:, 0].round().to(torch.int64), out_y) and torch.equal(out_x[:, 0], out_x[:, 1])
    assert not torch.equal(out_y, yb)   # something moved


def test_one_seed_gives_one_batch_and_another_seed_another() -> None:
    pipeline = parse_pipeline({**GEOMETRIC, "augment": [*GEOMETRIC["augment"],
                                                        {"intensity": {"scale": 0.2, "shift": 0.2, "p": 0.5}}]})
    xb, yb = torch.randn(16, 1, 16, 16), _masks(16)
    x_raw, y_raw = xb.clone(), yb.clone()
    first = augment(pipeline, xb, yb, generator=torch.Generator().manual_seed(7))
    again = augment(pipeline, xb, yb, generator=torch.Generator().manual_seed(7))
    other = augment(pipeline, xb, yb, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first[0], again[0]) and first[1] is not None and again[1] is not None
    assert torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])
    assert torch.equal(xb, x_raw) and torch.equal(yb, y_raw)   # the caller's batch is never written into


def test_intensity_jitter_leaves_masks_and_shapes_alone() -> None:
    pipeline = parse_pipeline({"augment": [{"intensity": {"scale": 0.5, "shift": 0.5, "p": 1.0}}]})
    xb, yb = torch.ones(8, 1, 16, 16), _masks(8)
    out_x, out_y = augment(pipeline, xb, yb, generator=torch.Generator().manual_seed(0))
    assert out_y is not None and torch.equal(out_y, yb) and out_x.shape == xb.shape
    values = out_x.flatten(1)
    assert torch.allclose(values, values[:, :1]) and not torch.allclose(out_x, xb)  # one change per image
    assert float(values.min()) >= 0.5 * 1 - 0.5 - 1e-6 and float(values.max()) <= 1.5 * 1 + 0.5 + 1e-6


def test_a_random_crop_smaller_than_the_sample_is_resized_back() -> None:
    pipeline = parse_pipeline({"augment": [{"random_crop": {"size": [12, 12], "pad": 2}}]})
    xb, yb = torch.randn(4, 3, 16, 16), _masks(4)
    out_x, out_y = augment(pipeline, xb, yb, generator=torch.Generator().manual_seed(1))
    assert out_x.shape == xb.shape and out_y is not None and out_y.shape == yb.shape
    assert set(out_y.unique().tolist()) <= set(yb.unique().tolist())


def test_augment_is_the_identity_without_steps_and_keeps_class_labels() -> None:
    xb, labels = torch.randn(4, 1, 8, 8), torch.tensor([0, 1, 2, 1])
    same_x, same_y = augment(parse_pipeline({"preprocess": [{"resize": [8, 8]}]}), xb, labels,
                             generator=torch.Generator().manual_seed(0))
    assert same_x is xb and same_y is labels
    flipped, kept = augment(parse_pipeline({"augment": [{"flip": {"p": 1.0}}]}), xb, labels,
                            generator=torch.Generator().manual_seed(0))
    assert torch.equal(flipped, torch.flip(xb, dims=[3])) and kept is labels


def test_a_volume_batch_is_augmented_with_its_masks() -> None:
    pipeline = parse_pipeline({"preprocess": [{"resize_volume": [8, 8, 8]}],
                               "augment": [{"flip": {"axes": [1, 3], "p": 0.5}}, {"rotate90": {"p": 0.5}}]})
    yb = torch.from_numpy(np.random.default_rng(9).integers(0, 3, size=(6, 8, 8, 8)))
    out_x, out_y = augment(pipeline, yb.unsqueeze(1).float(), yb, generator=torch.Generator().manual_seed(2))
    assert out_y is not None and torch.equal(out_x[:, 0].round().long(), out_y)
