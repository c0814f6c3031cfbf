"""Hostile volumes are refused at the door: a ConfigError naming the setting and the file, read at start, before
a worker registers or spends ε; every problem at once; never a traceback, a MemoryError or a NaN met in round 2.
One test per row of the hostile-volume table (docs/data.md, deploy/SECURITY.md). Each writes its own small
files; none asserts a time."""

from __future__ import annotations

import gzip
import os
import re
import struct
import subprocess
import sys
import tracemalloc

import nibabel as nib
import numpy as np
import pytest
from pydicom.uid import RLELossless

from fedbroker.bus import delete_topology
from fedbroker.config import DataSection, WorkerConfig
from fedbroker.datasets import load_worker_data
from fedbroker.datasets.volumes import nifti as nifti_module
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.pipeline import parse_pipeline
from fedbroker.job.spec import parse_model
from fedbroker.job.task import TaskConfig
from fedbroker.worker.global_model import fit_problem
from tests.source_roots import PYTHONPATH
from tests.volume_files import series_files, write_nifti, write_series

pytestmark = pytest.mark.timeout(300)  # a hang guard only


def worker(dataset: str = "nifti", **data: object) -> WorkerConfig:
    data.setdefault("labels", "mask")
    data.setdefault("num_classes", 2)
    return WorkerConfig(dataset=dataset, data=DataSection(**data))  # type: ignore[arg-type]


def problems_of(config: WorkerConfig) -> list[ConfigError]:
    with pytest.raises(ConfigError) as info:
        load_worker_data(config)
    return info.value.errors if isinstance(info.value, ConfigErrors) else [info.value]


def refused(config: WorkerConfig, field: str, message: str) -> None:
    """One of the problems is on `field` and says `message` (a regular expression's literal text)."""
    found = problems_of(config)
    assert any(p.field == field and re.search(re.escape(message), p.problem) for p in found), \
        [str(p) for p in found]


def site(tmp_path, *, count: int = 2, shape=(6, 5, 4)):
    """A folder of honest volumes (float32) and masks: the hostile file is added beside them."""
    images, masks = tmp_path / "img", tmp_path / "msk"
    images.mkdir()
    masks.mkdir()
    for i in range(count):
        write_nifti(images / f"ok{i}.nii.gz", np.ones(shape, np.float32))
        write_nifti(masks / f"ok{i}.nii.gz", np.zeros(shape, np.uint8))
    return images, masks


def patched(path, *, dims=None, datatype=None, slope=None, sform=None) -> None:
    """Rewrite fields of an uncompressed NIfTI-1 header in place: `dim` (8 int16 at byte 40), `datatype`
    (int16 at 70), `scl_slope` (float32 at 112), the sform (3 rows of 4 float32 at 280; qform_code 0 and
    sform_code 1 at 252)."""
    with open(path, "r+b") as fh:
        if sform is not None:
            fh.seek(252)
            fh.write(struct.pack("<2h", 0, 1))
            fh.seek(280)
            fh.write(struct.pack("<12f", *np.asarray(sform, float)[:3].ravel()))
        if dims is not None:
            fh.seek(40)
            fh.write(struct.pack("<8h", *dims))
        if datatype is not None:
            fh.seek(70)
            fh.write(struct.pack("<h", datatype))
        if slope is not None:
            fh.seek(112)
            fh.write(struct.pack("<f", slope))


# ----- headers: sizes and types checked before any data is read -----


@pytest.mark.parametrize(("dims", "message"), [
    ((3, 30000, 5, 4, 1, 1, 1, 1), "declares the shape [30000, 5, 4]: at most 4096 voxels an axis"),
    ((3, 6, -5, 4, 1, 1, 1, 1), "declares the shape [6, -5, 4]: a volume is (X, Y, Z)"),
    ((9, 6, 5, 4, 1, 1, 1, 1), "declares 9 dimensions"),
    ((3, 4096, 4096, 4096, 1, 1, 1, 1), "declares [4096, 4096, 4096] float32 voxels: more than the 268435456 values"),
    ((5, 6, 5, 4, 2, 3, 1, 1), "declares the shape [6, 5, 4, 2, 3]"),
])
def test_an_absurd_header_is_refused_from_the_header_alone(tmp_path, dims, message):
    images, masks = site(tmp_path)
    bad = write_nifti(images / "bad.nii", np.ones((6, 5, 4), np.float32))
    patched(bad, dims=dims)
    refused(worker(path=str(images), masks=str(masks)), "worker.data.path", f"{bad} {message}")


@pytest.mark.parametrize(("datatype", "message"), [(32, "holds complex64 voxels"), (128, "holds [('R', 'u1'), "),
                                                   (1234, "declares the unknown data type code 1234")])
def test_a_data_type_no_model_takes_is_refused_naming_it(tmp_path, datatype, message):
    images, masks = site(tmp_path)
    bad = write_nifti(images / "bad.nii", np.ones((6, 5, 4), np.float32))
    patched(bad, datatype=datatype)
    refused(worker(path=str(images), masks=str(masks)), "worker.data.path", f"{bad} {message}")


def test_a_gz_that_inflates_beyond_its_header_is_refused_without_inflating_it(tmp_path):
    """A 4 KiB volume followed by 256 MiB of zeros (a 250 KiB file): read up to its declared end and one byte
    more, then refused; memory stays near the declared size."""
    images, masks = site(tmp_path)
    plain = write_nifti(tmp_path / "small.nii", np.ones((16, 16, 4), np.float32))
    bomb = images / "bomb.nii.gz"
    with gzip.open(bomb, "wb", compresslevel=1) as fh:
        fh.write(plain.read_bytes())
        zeros = bytes(1 << 20)
        for _ in range(256):
            fh.write(zeros)
    write_nifti(masks / "bomb.nii.gz", np.zeros((16, 16, 4), np.uint8))
    assert bomb.stat().st_size < 2 << 20
    tracemalloc.start()
    try:
        refused(worker(path=str(images), masks=str(masks)), "worker.data.path",
                f"{bomb} inflates beyond the {plain.stat().st_size} bytes its header declares")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak


def test_truncated_files_are_refused_plain_from_their_size_gz_while_read(tmp_path):
    images, masks = site(tmp_path)
    plain = write_nifti(images / "cut.nii", np.ones((6, 5, 4), np.float32))
    size = plain.stat().st_size
    plain.write_bytes(plain.read_bytes()[:-40])
    whole = write_nifti(tmp_path / "whole.nii", np.arange(600, dtype=np.float32).reshape(10, 10, 6))
    packed = gzip.compress(whole.read_bytes())
    (images / "cut.nii.gz").write_bytes(packed[: len(packed) // 2])
    for name in ("cut.nii", "cut.nii.gz"):
        write_nifti(masks / name, np.zeros((6, 5, 4) if name == "cut.nii" else (10, 10, 6), np.uint8))
    found = problems_of(worker(path=str(images), masks=str(masks)))
    text = [str(p) for p in found]
    assert f"worker.data.path: {plain} is truncated: it holds {size - 40} bytes, its header declares {size}" in text
    assert any(t.startswith(f"worker.data.path: {images / 'cut.nii.gz'} ") and ("truncated" in t or "ended" in t)
               for t in text), text


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_voxel_is_refused_naming_the_file_and_voxel(tmp_path, value):
    images, masks = site(tmp_path)
    data = np.ones((6, 5, 4), np.float32)
    data[1, 2, 3] = value
    bad = write_nifti(images / "nan.nii.gz", data)
    write_nifti(masks / "nan.nii.gz", np.zeros((6, 5, 4), np.uint8))
    refused(worker(path=str(images), masks=str(masks)), "worker.data.path",
            f"{bad} voxel [1, 2, 3]: {float(value)!r} is not a finite number")


def test_a_scale_that_overflows_float32_is_refused_naming_the_voxel(tmp_path):
    images, masks = site(tmp_path)
    data = np.zeros((6, 5, 4), np.uint8)
    data[0, 0, 1] = 200
    bad = write_nifti(images / "scaled.nii", data)
    patched(bad, slope=3e38)
    write_nifti(masks / "scaled.nii", np.zeros((6, 5, 4), np.uint8))
    refused(worker(path=str(images), masks=str(masks)), "worker.data.path", f"{bad} voxel [0, 0, 1]: inf")


def test_files_that_are_no_volume_are_refused_naming_each(tmp_path):
    images, masks = site(tmp_path)
    (images / "README.txt").write_text("scans of 2024")
    (images / "fake.nii").write_text("not a header" * 50)
    (images / "folder.nii").mkdir()
    found = [str(p) for p in problems_of(worker(path=str(images), masks=str(masks)))]
    assert f"worker.data.path: {images / 'fake.nii'} is not a NIfTI file (its first bytes declare no NIfTI-1 or " \
           f"NIfTI-2 header)" in found
    assert f"worker.data.path: {images} holds entries that are not NIfTI volumes (.nii, .nii.gz): README.txt, " \
           f"folder.nii" in found


@pytest.mark.parametrize(("affine", "message"), [
    (np.array([[np.cos(0.5), -np.sin(0.5), 0, 0], [np.sin(0.5), np.cos(0.5), 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]),
     "its axes lie 28.6° off the world's axes"),
    (np.diag([1.0, 0.0, 1.0, 1.0]), "its voxel-to-world affine is singular"),
    (np.array([[1.0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]), "its voxel-to-world affine is singular"),
])
def test_an_oblique_or_degenerate_affine_is_refused_not_resampled(tmp_path, affine, message):
    images, masks = site(tmp_path)
    bad = write_nifti(images / "tilted.nii", np.ones((6, 5, 4), np.float32))
    patched(bad, sform=affine)
    refused(worker(path=str(images), masks=str(masks)), "worker.data.path", f"{bad} {message}")


def test_a_folder_of_a_million_entries_is_refused_after_reading_one_more_than_the_limit(tmp_path, monkeypatch):
    """The limit is lowered to 50 so the test writes 200 files, not 10^6: the listing stops at entry 51."""
    monkeypatch.setattr(nifti_module, "MAX_ENTRIES", 50)
    images = tmp_path / "img"
    images.mkdir()
    for i in range(200):
        (images / f"v{i}.nii").write_bytes(b"")
    listed = []
    real = os.scandir

    class Counting:
        def __init__(self, path):
            self.inner = real(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.inner.close()

        def __iter__(self):
            for entry in self.inner:
                listed.append(entry.name)
                yield entry

    monkeypatch.setattr(os, "scandir", Counting)
    refused(worker(path=str(images), masks=str(tmp_path)), "worker.data.path",
            f"{images} holds more than 50 entries")
    assert len(listed) == 51


# ----- masks -----


def test_masks_of_the_wrong_shape_place_or_values_are_refused_every_one_at_once(tmp_path):
    images, masks = site(tmp_path, count=0)
    for name in ("shape", "place", "value", "fraction", "missing"):
        write_nifti(images / f"{name}.nii.gz", np.ones((6, 5, 4), np.float32))
    write_nifti(masks / "shape.nii.gz", np.zeros((6, 5, 3), np.uint8))
    write_nifti(masks / "place.nii.gz", np.zeros((6, 5, 4), np.uint8), np.diag([1.0, 1.0, 1.0, 1.0]) + np.eye(4, k=3) * 5)
    outside = np.zeros((6, 5, 4), np.uint8)
    outside[2, 2, 2] = 7
    write_nifti(masks / "value.nii.gz", outside)
    write_nifti(masks / "fraction.nii.gz", np.full((6, 5, 4), 0.5, np.float32))
    found = [str(p) for p in problems_of(worker(path=str(images), masks=str(masks), num_classes=3))]
    assert f"worker.data.masks: {masks / 'shape.nii.gz'} has shape [6, 5, 3] with 1 channels, its image " \
           f"{images / 'shape.nii.gz'} [6, 5, 4]: a mask is one class index a voxel" in found
    assert any(t.startswith(f"worker.data.masks: {masks / 'place.nii.gz'} lies elsewhere in space") and "5 mm" in t
               for t in found), found
    assert f"worker.data.masks: {masks / 'value.nii.gz'}: mask values must lie in 0..2 (worker.data.num_classes " \
           f"3): at voxel [2, 2, 2]" in found
    assert any(t.startswith(f"worker.data.masks: {masks / 'fraction.nii.gz'}: mask values must be whole") for t in found)
    assert f"worker.data.masks: {masks} holds no mask for missing.nii.gz (a mask has its image's file name)" in found


# ----- DICOM series -----


def ct(tmp_path, **kwargs):
    stored = np.arange(4 * 3 * 5, dtype=np.int16).reshape(4, 3, 5)
    return write_series(tmp_path / "ct" / "s1", stored, **kwargs)


def dicom(tmp_path) -> WorkerConfig:
    (tmp_path / "labels.csv").write_text("file,label\ns1,0\n")
    return WorkerConfig(dataset="dicom", data=DataSection(path=str(tmp_path / "ct"),
                                                          labels_csv=str(tmp_path / "labels.csv")))


@pytest.mark.parametrize(("positions", "message"), [
    ([0, 2, 2, 4], "has two slices at the same position"),
    ([0, 2, 6, 8], "is not evenly spaced: 4 mm between"),
])
def test_a_series_with_duplicate_or_missing_slices_is_refused(tmp_path, positions, message):
    folder = ct(tmp_path, positions=positions)
    refused(dicom(tmp_path), "worker.data.path", f"series {folder} {message}")


def test_a_series_mixing_orientations_or_grids_is_refused(tmp_path):
    folder = ct(tmp_path)
    write_series(tmp_path / "other", np.zeros((1, 3, 5), np.int16), orientation=(0, 1, 0, 0, 0, -1),
                 names=["ZZ-sagittal"])
    (tmp_path / "other" / "ZZ-sagittal").rename(folder / "ZZ-sagittal")
    refused(dicom(tmp_path), "worker.data.path", f"series {folder} mixes slices of 2 SeriesInstanceUID values")
    write_series(tmp_path / "ct" / "s2", np.zeros((2, 3, 5), np.int16))
    write_series(tmp_path / "wide", np.zeros((1, 3, 6), np.int16), names=["ZZ-wide"])
    (tmp_path / "wide" / "ZZ-wide").rename(tmp_path / "ct" / "s2" / "ZZ-wide")
    (tmp_path / "labels.csv").write_text("file,label\ns1,0\ns2,1\n")
    config = WorkerConfig(dataset="dicom", data=DataSection(path=str(tmp_path / "ct"),
                                                            labels_csv=str(tmp_path / "labels.csv")))
    refused(config, "worker.data.path", f"series {tmp_path / 'ct' / 's2'} mixes slices of 2 Columns values (5, 6)")


def test_files_in_a_series_that_are_no_uncompressed_dicom_are_refused_naming_each(tmp_path):
    folder = ct(tmp_path)
    (folder / "notes.txt").write_text("patient notes")
    write_series(tmp_path / "rle", np.zeros((1, 3, 5), np.int16), names=["ZZ-rle"])
    raw = (tmp_path / "rle" / "ZZ-rle").read_bytes()  # the same bytes declared RLE-compressed (a UID as long)
    (folder / "ZZ-rle").write_bytes(raw.replace(b"1.2.840.10008.1.2.1\0", f"{RLELossless}\0".encode(), 1))
    found = [str(p) for p in problems_of(dicom(tmp_path))]
    assert any(f"{folder / 'notes.txt'} is not a DICOM file" in t for t in found), found
    assert any(f"{folder / 'ZZ-rle'} uses the transfer syntax '1.2.840.10008.1.2.5'" in t for t in found), found


def test_a_slice_with_truncated_pixel_data_is_refused_naming_it(tmp_path):
    folder = ct(tmp_path)
    last = series_files(folder)[-1]
    last.write_bytes(last.read_bytes()[:-10])
    refused(dicom(tmp_path), "worker.data.path", f"{folder} slice {last.name}: its pixel data cannot be read")


def test_a_file_beside_the_series_folders_is_refused(tmp_path):
    ct(tmp_path)
    (tmp_path / "ct" / "IM0001").write_bytes(b"\0" * 200)
    refused(dicom(tmp_path), "worker.data.path", "holds files beside its series folders (one sub-folder a series): "
                                                 "IM0001")


# ----- labels, every problem at once, the job's expectation, the worker process -----


def test_a_labels_csv_missing_rows_or_naming_strangers_is_refused_naming_each(tmp_path):
    images, _ = site(tmp_path)
    (tmp_path / "l.csv").write_text("file,label\nok0.nii.gz,1\nok0.nii.gz,0\nghost.nii,1\n")
    found = [str(p) for p in problems_of(WorkerConfig(dataset="nifti", data=DataSection(
        path=str(images), labels_csv=str(tmp_path / "l.csv"))))]
    assert found == [f"worker.data.labels_csv: {tmp_path / 'l.csv'} line 3 names 'ok0.nii.gz' again (line 2)",
                     f"worker.data.labels_csv: {tmp_path / 'l.csv'} has no row for ok1.nii.gz",
                     f"worker.data.labels_csv: {tmp_path / 'l.csv'} names volumes that are not in {images}: ghost.nii"]


def test_every_hostile_volume_of_a_folder_is_named_at_once(tmp_path):
    images, masks = site(tmp_path)
    nan = np.ones((6, 5, 4), np.float32)
    nan[0, 0, 0] = np.nan
    write_nifti(images / "a-nan.nii", nan)
    cut = write_nifti(images / "b-cut.nii", np.ones((6, 5, 4), np.float32))
    cut.write_bytes(cut.read_bytes()[:400])
    (images / "c.txt").write_text("x")
    for name in ("a-nan.nii", "b-cut.nii"):
        write_nifti(masks / name, np.zeros((6, 5, 4), np.uint8))
    found = problems_of(worker(path=str(images), masks=str(masks)))
    assert len(found) == 3
    assert [p.problem.split(" ")[0] for p in found] == [str(images / "b-cut.nii"), str(images),
                                                        str(images / "a-nan.nii")]


def test_a_job_expecting_other_spacing_is_refused_by_the_fit_check_without_naming_files(tmp_path):
    images, masks = site(tmp_path)
    write_nifti(images / "thick.nii.gz", np.ones((6, 5, 4), np.float32), np.diag([1.0, 1.0, 3.0, 1.0]))
    write_nifti(masks / "thick.nii.gz", np.zeros((6, 5, 4), np.uint8), np.diag([1.0, 1.0, 3.0, 1.0]))
    data = load_worker_data(worker(path=str(images), masks=str(masks)))
    spec = parse_model({"input_shape": [1, 6, 5, 4], "layers": [
        {"type": "Conv3d", "in_channels": 1, "out_channels": 2, "kernel_size": 1}]})
    def fit(expect: dict) -> str:
        return fit_problem(spec, data.x, 2, holder="this worker's data", task=TaskConfig(type="segmentation", classes=2),
                           labels="mask", pipeline=parse_pipeline({"expect": expect}))

    assert fit({}) == "" and fit({"orientation": "RAS"}) == ""
    problem = fit({"spacing": [1, 1, 1]})
    assert problem == ("this worker's data does not meet the job's data.expect: the job expects voxels of 1×1×1 mm "
                       "(±5%), 1 of this site's 3 volumes have 1×1×3")
    assert "thick" not in problem
    assert "delivers every volume in RAS" in fit({"orientation": "LPS"})


@pytest.mark.integration
def test_a_worker_process_refuses_a_nan_volume_at_start_before_registering(tmp_path, rabbitmq_url):
    images, masks = site(tmp_path, count=1)
    nan = np.ones((6, 5, 4), np.float32)
    nan[2, 1, 0] = np.nan
    bad = write_nifti(images / "nan.nii.gz", nan)
    write_nifti(masks / "nan.nii.gz", np.zeros((6, 5, 4), np.uint8))
    ledger = tmp_path / "ledger.json"
    namespace = f"hostile-volumes-{os.getpid()}"
    settings = {
        "broker.url": rabbitmq_url, "broker.namespace": namespace, "worker.id": "hostile-v",
        "worker.dataset": "nifti", "worker.data.path": str(images), "worker.data.masks": str(masks),
        "worker.data.labels": "mask", "worker.data.num_classes": "2",
        "worker.ledger_path": str(ledger), "worker.device": "cpu", "worker.dp.enabled": "true",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    env.update({"FEDBROKER__" + k.upper().replace(".", "__"): v for k, v in settings.items()})
    env["PYTHONPATH"] = PYTHONPATH
    try:
        done = subprocess.run([sys.executable, "-m", "fedbroker", "worker"], env=env, capture_output=True,
                              text=True, timeout=240, cwd=tmp_path)
    finally:
        delete_topology(rabbitmq_url, namespace, ["hostile-v"])
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"fedbroker worker: config: worker.data.path: {bad} voxel [2, 1, 0]: nan is not a finite number")
    assert not ledger.exists()
    assert "register" not in done.stderr.lower()


def test_nibabel_reads_what_the_bounded_reader_reads(tmp_path):
    """The reader's own header parsing and bounded read agree with nibabel's loader on an honest file."""
    path = write_nifti(tmp_path / "v.nii.gz", np.arange(120, dtype=np.int16).reshape(6, 5, 4),
                       np.diag([2.0, 1.0, 1.0, 1.0]))
    mine = nifti_module.nifti_file(str(path), "v.nii.gz").raw()
    assert np.array_equal(mine, np.asarray(nib.load(str(path)).get_fdata(), np.float32))
