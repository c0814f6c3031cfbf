"""Hostile image folders are refused at the door: a ConfigError naming every bad file at once (the first few of
each kind and their count), raised while the worker reads its data at start, before it registers or spends ε.
Sizes are read from the headers before any pixel is decoded; each test crafts its own small file (a PNG header
declaring 100000 × 100000 is 33 bytes)."""

from __future__ import annotations

import dataclasses
import logging
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedbroker.bus import delete_topology
from fedbroker.config import DataSection, WorkerConfig
from fedbroker.datasets import images as images_module
from fedbroker.datasets import load_worker_data
from fedbroker.datasets.images import load_images
from fedbroker.errors import ConfigError, ConfigErrors
from tests.source_roots import PYTHONPATH

pytestmark = pytest.mark.timeout(300)  # a hang guard only: a FIFO opened or a bomb decoded would never return


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares `width` × `height` 8-bit grey pixels, with a few bytes of data behind it."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


def encoded(array: np.ndarray, fmt: str, mode: str | None = None) -> bytes:
    import io

    out = io.BytesIO()
    image = Image.fromarray(array)
    (image.convert(mode) if mode else image).save(out, format=fmt)
    return out.getvalue()


def noise(shape: tuple[int, ...]) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)


def folder(tmp_path: Path, files: dict[str, bytes], *, rows: list[str] | None = None, **data: object) -> WorkerConfig:
    """A folder holding `files` and a labels CSV naming `rows` (default: every file, class 0)."""
    root = tmp_path / "images"
    root.mkdir(exist_ok=True)
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content)
    csv = tmp_path / "labels.csv"
    csv.write_text("file,label\n" + "".join(f"{r},0\n" for r in (rows if rows is not None else files)))
    settings: dict[str, object] = {"path": str(root), "labels_csv": str(csv), "num_classes": 2, **data}
    return WorkerConfig(dataset="images", data=DataSection(**settings))  # type: ignore[arg-type]


def refused(config: WorkerConfig, field: str, *parts: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_worker_data(config)
    assert info.value.field == field, str(info.value)
    for part in parts:
        assert part in str(info.value), str(info.value)
    return info.value


GOOD = encoded(noise((8, 8)), "PNG")
JPEG = encoded(noise((64, 64, 3)), "JPEG")

# ----- the hostile-image table: one crafted file a row, each refused naming it -----

TABLE: dict[str, tuple[Callable[[], bytes], str]] = {
    "a PNG whose IHDR declares 100000 x 100000 (Pillow's DecompressionBombError)":
        (lambda: png_declaring(100_000, 100_000), "decompression bombs"),
    "a PNG declaring 10000 x 10000 (Pillow's DecompressionBombWarning, an error here)":
        (lambda: png_declaring(10_000, 10_000), "decompression bombs"),
    "a PNG declaring 9000 x 9000 (under Pillow's limit, over MAX_PIXELS)":
        (lambda: png_declaring(9_000, 9_000), "images over 67108864 pixels"),
    "a PNG declaring 40000 x 1 (a side no scanner makes)":
        (lambda: png_declaring(40_000, 1), "absurd dimensions"),
    "a PNG cut in half": (lambda: GOOD[: len(GOOD) // 2], "truncated or corrupt images"),
    "a JPEG cut in half": (lambda: JPEG[: len(JPEG) // 2], "truncated or corrupt images"),
    "a PNG whose data fail their checksum": (lambda: GOOD[:-20] + bytes(8) + GOOD[-12:], "truncated or corrupt"),
    "text renamed .png": (lambda: b"patient,finding\n1,none\n", "not PNG or JPEG images"),
    "an empty file": (lambda: b"", "not PNG or JPEG images"),
    "a CMYK JPEG": (lambda: encoded(noise((8, 8, 3)), "JPEG", "CMYK"), "not grey or RGB"),
    "an RGBA PNG with transparent pixels": (lambda: encoded(noise((8, 8, 4)), "PNG"), "transparent pixels"),
}


@pytest.mark.parametrize("row", list(TABLE))
def test_a_hostile_image_is_refused_at_start_naming_the_file(tmp_path, row):
    make, kind = TABLE[row]
    config = folder(tmp_path, {"ok.png": GOOD, "hostile.png": make()})
    error = refused(config, "worker.data.path", kind, str(tmp_path / "images" / "hostile.png"))
    assert "ok.png" not in str(error)


def test_sizes_are_checked_from_the_header_before_any_pixel_is_decoded(tmp_path, monkeypatch):
    decoded: list[str] = []
    real = images_module.check_image
    monkeypatch.setattr(images_module, "check_image", lambda path: decoded.append(path) or real(path))
    config = folder(tmp_path, {"ok.png": GOOD, "big.png": png_declaring(9_000, 9_000)})
    refused(config, "worker.data.path", "big.png (9000×9000)")
    assert decoded == [str(tmp_path / "images" / "ok.png")]  # the 9000 × 9000 one was never decoded


def test_a_folder_declaring_more_values_than_a_site_decodes_is_refused_before_decoding_any(tmp_path, monkeypatch):
    monkeypatch.setattr(images_module, "MAX_TOTAL_VALUES", 100)
    monkeypatch.setattr(images_module, "check_image", lambda path: pytest.fail(f"{path} decoded"))
    refused(folder(tmp_path, {"a.png": GOOD, "b.png": GOOD}), "worker.data.path", "declare 128 values in all")


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_a_pipe_or_a_folder_named_png_is_refused_without_being_opened(tmp_path, kind):
    config = folder(tmp_path, {"ok.png": GOOD}, rows=["ok.png", "odd.png"])
    odd = tmp_path / "images" / "odd.png"
    os.mkfifo(odd) if kind == "fifo" else odd.mkdir()  # opening a FIFO would block for ever
    refused(config, "worker.data.path", "not regular files", "line 3: 'odd.png'")


def test_a_file_this_process_may_not_read_is_refused_naming_it_whoever_runs_the_test(tmp_path, monkeypatch):
    config = folder(tmp_path, {"ok.png": GOOD, "locked.png": GOOD})
    locked = str(tmp_path / "images" / "locked.png")
    real = os.access
    monkeypatch.setattr("fedbroker.datasets.image_files.os.access", lambda path, mode: path != locked and real(path, mode))
    refused(config, "worker.data.path", "unreadable files", "line 3: 'locked.png' (permission denied)")


def test_a_folder_of_more_files_than_the_limit_is_counted_only_up_to_the_limit(tmp_path, monkeypatch):
    root = tmp_path / "f"
    (root).mkdir()
    (tmp_path / "m").mkdir()
    for i in range(9):
        (root / f"{i}.png").write_bytes(GOOD)
    yielded: list[str] = []
    real = os.scandir

    class Counting:
        def __init__(self, path: str) -> None:
            self.inner = real(path)

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.inner.close()

        def __iter__(self) -> Counting:
            return self

        def __next__(self) -> os.DirEntry[str]:
            entry = next(self.inner)
            yielded.append(entry.name)
            return entry

    monkeypatch.setattr("fedbroker.datasets.image_files.os.scandir", Counting)
    source = DataSection(path=str(root), labels="mask", masks=str(tmp_path / "m"), num_classes=2)
    with pytest.raises(ConfigError, match="holds more than 5 files") as info:
        load_images(source, most_files=5)
    assert info.value.field == "worker.data.path" and len(yielded) == 6


def test_a_labels_csv_of_more_rows_than_the_limit_is_refused(tmp_path):
    config = folder(tmp_path, {"a.png": GOOD}, rows=["a.png"] * 7)
    with pytest.raises(ConfigError, match="names more than 5 files") as info:
        load_images(config.data, most_files=5)
    assert info.value.field == "worker.data.labels_csv"


def test_rows_naming_missing_files_and_files_named_twice_are_refused_by_line(tmp_path):
    config = folder(tmp_path, {"a.png": GOOD, "b.png": GOOD}, rows=["a.png", "gone.png", "b.png", "./a.png"])
    error = refused(config, "worker.data.path", "missing files: ", "line 3: 'gone.png'",
                    "files named twice: ", "line 5: './a.png' (also ", "line 2: 'a.png'")
    assert isinstance(error, ConfigErrors) and len(error.errors) == 2


@pytest.mark.parametrize("row", ["../outside.png", "{abs}", "sub/../../outside.png", "escape.png", "C:/outside.png"])
def test_a_path_leaving_the_folder_is_refused_and_never_opened(tmp_path, row, monkeypatch):
    outside = tmp_path / "outside.png"
    outside.write_bytes(GOOD)
    opened: list[str] = []
    real = images_module.header
    monkeypatch.setattr(images_module, "header", lambda path, **kw: opened.append(path) or real(path, **kw))
    config = folder(tmp_path, {"ok.png": GOOD}, rows=["ok.png", row.format(abs=outside)])
    (tmp_path / "images" / "escape.png").symlink_to(outside)
    error = refused(config, "worker.data.path", "line 3")
    assert any(kind in str(error) for kind in ("absolute path", "leaving the folder", "link leading out"))
    assert opened == [str(tmp_path / "images" / "ok.png")]


def test_a_link_inside_the_folder_is_a_sample_like_any_file(tmp_path):
    config = folder(tmp_path, {"real.png": GOOD}, rows=["real.png", "alias/a.png"])
    (tmp_path / "images" / "alias").mkdir()
    (tmp_path / "images" / "alias" / "a.png").write_bytes(GOOD)
    assert len(load_worker_data(config)) == 2


def test_every_problem_is_named_at_once_and_long_lists_are_counted(tmp_path):
    files = {"bomb.png": png_declaring(100_000, 100_000), "cut.jpg": JPEG[:300], "ok.png": GOOD}
    rows = [*files, *(f"missing{i}.png" for i in range(8)), "../up.png"]
    error = refused(folder(tmp_path, files, rows=rows), "worker.data.path", "decompression bombs", "bomb.png",
                    "truncated or corrupt images", "cut.jpg", "missing files: ", "'missing4.png' (and 3 more)",
                    "leaving the folder", "'../up.png'")
    assert isinstance(error, ConfigErrors) and len(error.errors) == 4
    assert "missing5.png" not in str(error)


def test_a_folder_mixing_grey_and_rgb_is_refused_naming_the_minority(tmp_path):
    rgb = encoded(noise((8, 8, 3)), "PNG")
    error = refused(folder(tmp_path, {"a.png": GOOD, "b.png": GOOD, "c.png": rgb}), "worker.data.path",
                    "images with 3 channels among 2 with 1", "c.png")
    assert "a.png" not in str(error)


def test_bad_label_cells_are_named_with_the_bad_files_at_once(tmp_path):
    config = folder(tmp_path, {"a.png": GOOD, "b.png": GOOD}, rows=[], labels="multilabel",
                    label_columns=("effusion", "nodule"))
    (tmp_path / "labels.csv").write_text("file,effusion,nodule\na.png,1,2\nb.png,x,0\ngone.png,0,1\n")
    error = refused(config, "worker.data.path", "missing files", "line 4: 'gone.png'",
                    "line 3, column 'effusion': 'x' is not a number",
                    "multilabel labels must be 0 or 1", "line 2, column 'nodule'")
    assert isinstance(error, ConfigErrors) and len(error.errors) == 3


# ----- masks -----


def mask_folder(tmp_path: Path, masks: dict[str, bytes], num_classes: int = 3) -> WorkerConfig:
    images = tmp_path / "f"
    images.mkdir()
    for name in ("a", "b"):
        (images / f"{name}.png").write_bytes(GOOD)
    (tmp_path / "m").mkdir()
    for name, content in masks.items():
        (tmp_path / "m" / name).write_bytes(content)
    return WorkerConfig(dataset="images", data=DataSection(path=str(images), labels="mask", masks=str(tmp_path / "m"),
                                                           num_classes=num_classes))


def test_a_missing_mask_and_a_mask_of_another_size_are_refused_naming_both(tmp_path):
    config = mask_folder(tmp_path, {"a.png": encoded(np.zeros((8, 9), np.uint8), "PNG")})
    refused(config, "worker.data.masks", "masks of another size than their image", "a.png (9×8, the image is 8×8)",
            "missing masks (an image's mask is its name with .png", f"{tmp_path / 'm' / 'b.png'} (for 'b.png')")


def test_a_mask_is_not_examined_for_a_row_whose_image_was_refused(tmp_path):
    config = mask_folder(tmp_path, {"a.png": encoded(np.zeros((8, 8), np.uint8), "PNG"),
                                    "b.png": encoded(np.zeros((8, 8), np.uint8), "PNG")})
    csv = tmp_path / "l.csv"
    csv.write_text("file\na.png\nb.png\n../b.png\n")
    error = refused(WorkerConfig(dataset="images", data=dataclasses.replace(config.data, labels_csv=str(csv))),
                    "worker.data.path", "leaving the folder", "line 4: '../b.png'")
    assert isinstance(error, ConfigError) and not isinstance(error, ConfigErrors)  # one problem, named once


def test_a_0_255_mask_is_refused_with_a_hint(tmp_path):
    mask = np.where(noise((8, 8)) > 128, 255, 0).astype(np.uint8)
    config = mask_folder(tmp_path, {"a.png": encoded(mask, "PNG"), "b.png": encoded(mask // 255 * 2, "PNG")})
    error = refused(config, "worker.data.masks", "values outside 0..2", "a 0/255 mask", "a.png (0..255)")
    assert "b.png" not in str(error)


def test_an_rgb_mask_is_refused_as_not_class_indices(tmp_path):
    config = mask_folder(tmp_path, {"a.png": encoded(noise((8, 8, 3)) % 2, "PNG"),
                                    "b.png": encoded(np.zeros((8, 8), np.uint8), "PNG")})
    refused(config, "worker.data.masks", "not one channel of class indices", "a.png (RGB)")


def test_masks_without_a_class_count_are_refused(tmp_path):
    refused(mask_folder(tmp_path, {}, num_classes=0), "worker.data.num_classes", "required with labels mask")


def test_labels_other_than_masks_need_a_labels_csv(tmp_path):
    (tmp_path / "a.png").write_bytes(GOOD)
    refused(WorkerConfig(dataset="images", data=DataSection(path=str(tmp_path))), "worker.data.labels_csv",
            "need a labels CSV")


# ----- after the start: a file that changes under a running worker -----


def test_a_file_truncated_after_start_fails_its_batch_naming_it_only_in_the_sites_log(tmp_path, caplog):
    ds = load_worker_data(folder(tmp_path, {"patient-0042.png": GOOD, "b.png": GOOD}))
    (tmp_path / "images" / "patient-0042.png").write_bytes(GOOD[:40])
    with caplog.at_level(logging.ERROR, logger="fedbroker.datasets.images"), \
            pytest.raises(ConfigError, match="a file changed since the worker started") as info:
        ds.x.read([0, 1])
    assert "patient-0042" not in str(info.value)  # the error may leave the site as a task's failure reason
    assert "patient-0042.png changed since the worker started" in caplog.text


# ----- a real worker process refuses at start -----


@pytest.mark.integration
def test_a_worker_process_refuses_a_bomb_in_its_image_folder_at_start_before_registering(tmp_path, rabbitmq_url):
    config = folder(tmp_path, {"ok.png": GOOD, "bomb.png": png_declaring(100_000, 100_000)})
    ledger = tmp_path / "ledger.json"
    namespace = f"hostile-images-{os.getpid()}"
    settings = {
        "broker.url": rabbitmq_url, "broker.namespace": namespace, "worker.id": "hostile-img",
        "worker.dataset": "images", "worker.data.path": config.data.path, "worker.data.labels_csv":
        config.data.labels_csv, "worker.data.num_classes": "2", "worker.ledger_path": str(ledger),
        "worker.device": "cpu", "worker.dp.enabled": "true",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    env.update({"FEDBROKER__" + k.upper().replace(".", "__"): v for k, v in settings.items()})
    env["PYTHONPATH"] = PYTHONPATH
    try:
        done = subprocess.run([sys.executable, "-m", "fedbroker", "worker"], env=env, capture_output=True,
                              text=True, timeout=240, cwd=tmp_path)
    finally:  # were the worker to get past its data, it would leave its queues behind
        delete_topology(rabbitmq_url, namespace, ["hostile-img"])
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("fedbroker worker: config: worker.data.path: decompression bombs"), last
    assert str(tmp_path / "images" / "bomb.png") in last
    assert not ledger.exists()  # no ledger opened, so no ε could have been spent
    assert "register" not in done.stderr.lower()
