"""Image folders (worker.dataset: images), the honest path: each test writes its own few small PNG or JPEG files
and a labels CSV, and reads back exactly the pixels and labels it wrote, decoded only when a batch asks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedbroker.config import DataSection, WorkerConfig
from fedbroker.datasets import OWN_FORMATS, load_worker_data, train_test_split
from fedbroker.datasets.stream import FileSamples
from fedbroker.errors import ConfigError


def images(**data: object) -> WorkerConfig:
    return WorkerConfig(dataset="images", data=DataSection(**data))  # type: ignore[arg-type]


def grey(seed: int, shape: tuple[int, int] = (6, 5)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def save(array: np.ndarray, path: Path, mode: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(array)
    (image.convert(mode) if mode else image).save(path)


def test_images_is_one_of_the_owners_formats():
    assert "images" in OWN_FORMATS


def test_grey_pngs_with_named_classes_read_lazily_as_their_pixels_over_255(tmp_path):
    pixels = [grey(i) for i in range(4)]
    for i, p in enumerate(pixels):
        save(p, tmp_path / "scans" / "a" / f"{i}.png")
    (tmp_path / "labels.csv").write_text("file,finding\n" + "".join(
        f"a/{i}.png,{'normal' if i % 2 else 'effusion'}\n" for i in range(4)))
    ds = load_worker_data(images(path=str(tmp_path / "scans"), labels_csv=str(tmp_path / "labels.csv"),
                                 label_column="finding", classes=("normal", "effusion")))
    assert isinstance(ds.x, FileSamples) and ds.x.shape == (4, 1, 6, 5) and ds.x.dtype == np.float32
    assert ds.y.tolist() == [1, 0, 1, 0] and ds.num_classes == 2 and ds.labels == "class"
    batch = ds.x.read([2, 0])
    assert batch.shape == (2, 1, 6, 5)
    np.testing.assert_array_equal(batch[0, 0], pixels[2].astype(np.float32) / 255)
    np.testing.assert_array_equal(batch[1, 0], pixels[0].astype(np.float32) / 255)


def test_16_bit_greyscale_reads_over_65535_and_rgb_as_three_channels(tmp_path):
    xray = np.random.default_rng(1).integers(0, 65536, (7, 4), dtype=np.uint16)
    save(xray, tmp_path / "x" / "a.png")
    colour = np.random.default_rng(2).integers(0, 256, (7, 4, 3), dtype=np.uint8)
    save(colour, tmp_path / "c" / "a.png")
    (tmp_path / "l.csv").write_text("file,label\na.png,0\n")
    csv = str(tmp_path / "l.csv")
    assert Image.open(tmp_path / "x" / "a.png").mode == "I;16"
    one = load_worker_data(images(path=str(tmp_path / "x"), labels_csv=csv, num_classes=2))
    np.testing.assert_allclose(one.x.read([0])[0, 0], xray / 65535.0, rtol=1e-6)
    three = load_worker_data(images(path=str(tmp_path / "c"), labels_csv=csv, num_classes=2))
    assert three.x.shape == (1, 3, 7, 4)
    np.testing.assert_array_equal(three.x.read([0])[0], colour.transpose(2, 0, 1) / np.float32(255))


def test_a_palette_image_reads_as_its_colours_and_an_opaque_alpha_is_dropped(tmp_path):
    colour = np.random.default_rng(3).integers(0, 256, (5, 5, 3), dtype=np.uint8)
    save(colour, tmp_path / "f" / "p.png", "P")
    rgba = np.concatenate([colour, np.full((5, 5, 1), 255, np.uint8)], axis=2)
    save(rgba, tmp_path / "f" / "q.png")
    (tmp_path / "l.csv").write_text("file,label\np.png,0\nq.png,1\n")
    ds = load_worker_data(images(path=str(tmp_path / "f"), labels_csv=str(tmp_path / "l.csv")))
    palette = np.asarray(Image.open(tmp_path / "f" / "p.png").convert("RGB"))
    batch = ds.x.read([0, 1])
    np.testing.assert_array_equal(batch[0], palette.transpose(2, 0, 1) / np.float32(255))
    np.testing.assert_array_equal(batch[1], colour.transpose(2, 0, 1) / np.float32(255))


def test_jpegs_of_different_sizes_leave_0_in_the_sample_shape_for_the_jobs_resize(tmp_path):
    save(np.random.default_rng(4).integers(0, 256, (8, 12, 3), dtype=np.uint8), tmp_path / "f" / "a.jpg")
    save(np.random.default_rng(5).integers(0, 256, (10, 12, 3), dtype=np.uint8), tmp_path / "f" / "b.jpeg")
    (tmp_path / "l.csv").write_text("file,label\na.jpg,0\nb.jpeg,1\n")
    ds = load_worker_data(images(path=str(tmp_path / "f"), labels_csv=str(tmp_path / "l.csv")))
    assert ds.x.shape == (2, 3, 0, 12)
    assert ds.x.read([1]).shape == (1, 3, 10, 12)
    with pytest.raises(ConfigError, match="different shapes"):
        ds.x.read([0, 1])


def test_multilabel_findings_and_regression_targets_come_from_their_columns(tmp_path):
    for i in range(3):
        save(grey(i), tmp_path / "f" / f"{i}.png")
    (tmp_path / "l.csv").write_text("file,age,effusion,nodule\n0.png,61.5,1,0\n1.png,40,0,0\n2.png,72,1,1\n")
    common = {"path": str(tmp_path / "f"), "labels_csv": str(tmp_path / "l.csv")}
    multi = load_worker_data(images(labels="multilabel", label_columns=("effusion", "nodule"), **common))
    assert multi.y.dtype == np.float32 and multi.y.tolist() == [[1, 0], [0, 0], [1, 1]]
    assert multi.num_classes == 2 and multi.labels == "multilabel"
    target = load_worker_data(images(labels="target", label_column="age", **common))
    assert target.y.tolist() == [61.5, 40.0, 72.0] and target.num_classes == 1


@pytest.mark.parametrize("with_csv", [False, True])
def test_masks_pair_by_name_and_read_as_int64_class_indices(tmp_path, with_csv):
    masks = [np.random.default_rng(i).integers(0, 3, (6, 5), dtype=np.uint8) for i in range(3)]
    for i, mask in enumerate(masks):
        save(grey(i), tmp_path / "f" / f"s{i}.jpg")
        save(mask, tmp_path / "m" / f"s{i}.png", "P" if i == 2 else None)  # a palette mask: its indices count
    (tmp_path / "notes.txt").write_text("not a sample")
    csv = {"labels_csv": str(tmp_path / "l.csv")} if with_csv else {}
    (tmp_path / "l.csv").write_text("file\ns2.jpg\ns0.jpg\ns1.jpg\n")
    ds = load_worker_data(images(path=str(tmp_path / "f"), labels="mask", masks=str(tmp_path / "m"), num_classes=3,
                                 **csv))
    order = [2, 0, 1] if with_csv else [0, 1, 2]
    assert isinstance(ds.y, FileSamples) and ds.y.shape == (3, 6, 5) and ds.y.dtype == np.int64
    assert ds.x.shape == (3, 1, 6, 5) and ds.num_classes == 3 and ds.labels == "mask"
    got = ds.y.read([0, 1, 2])
    for k, i in enumerate(order):
        np.testing.assert_array_equal(got[k], masks[i])


def test_an_image_folder_splits_without_decoding_and_keeps_images_with_their_labels(tmp_path):
    for i in range(10):
        save(np.full((3, 3), i * 20, np.uint8), tmp_path / "f" / f"{i}.png")
    (tmp_path / "l.csv").write_text("file,label\n" + "".join(f"{i}.png,{i % 2}\n" for i in range(10)))
    ds = load_worker_data(images(path=str(tmp_path / "f"), labels_csv=str(tmp_path / "l.csv")))
    train, test = train_test_split(ds, test_fraction=0.2, seed=0)
    assert isinstance(train.x, FileSamples) and len(train) == 8 and len(test) == 2
    for part in (train, test):
        values = part.x.read()[:, 0, 0, 0] * 255 / 20
        assert (np.rint(values).astype(int) % 2).tolist() == part.y.tolist()


def test_a_relative_folder_is_read_the_same_after_the_working_directory_changes(tmp_path, monkeypatch):
    save(grey(0), tmp_path / "site" / "f" / "a.png")
    (tmp_path / "site" / "l.csv").write_text("file,label\na.png,1\n")
    monkeypatch.chdir(tmp_path / "site")
    ds = load_worker_data(images(path="f", labels_csv="l.csv", num_classes=2))
    monkeypatch.chdir(tmp_path)
    assert ds.x.keys == (str(tmp_path / "site" / "f" / "a.png"),)
    np.testing.assert_array_equal(ds.x.read([0])[0, 0], grey(0) / np.float32(255))
