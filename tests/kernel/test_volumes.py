"""NIfTI files and DICOM series read as a site's data set: every volume in RAS (checked against nibabel's own
reorientation and against DICOM's world coordinates), planes cut as the volume's, masks alike, CT values in
Hounsfield units, labels from a CSV, the geometry a job's `data.expect` is checked against."""

from __future__ import annotations

import os

import nibabel as nib
import numpy as np
import pytest

from fedbroker.config import DataSection, WorkerConfig
from fedbroker.datasets import load_worker_data, train_test_split
from fedbroker.datasets.volumes import VolumeExpectation, expectation, geometry_problems
from fedbroker.datasets.volumes.geometry import Geometry
from fedbroker.datasets.volumes.nifti import NiftiFile
from fedbroker.errors import ConfigError
from tests.volume_files import LPS, write_nifti, write_series

# three stored orientations: RAS, LPS (DICOM's), and axes permuted (P, S, R) with 0.8/1.5/2.5 mm voxels
AFFINES = {
    "ras.nii": np.diag([0.8, 1.5, 2.5, 1.0]),
    "lps.nii.gz": LPS @ np.diag([0.8, 1.5, 2.5, 1.0]),
    "psr.nii": np.array([[0, 0, 2.5, 0], [-0.8, 0, 0, 0], [0, 1.5, 0, 0], [0, 0, 0, 1.0]]),
}


def nifti(**data: object) -> WorkerConfig:
    return WorkerConfig(dataset="nifti", data=DataSection(**data))  # type: ignore[arg-type]


def folder_of_volumes(tmp_path, *, masks: bool = True):
    rng = np.random.default_rng(3)
    (tmp_path / "img").mkdir()
    (tmp_path / "msk").mkdir()
    for name, affine in AFFINES.items():
        write_nifti(tmp_path / "img" / name, rng.normal(size=(5, 4, 3)).astype(np.float32), affine)
        if masks:
            write_nifti(tmp_path / "msk" / name, rng.integers(0, 3, size=(5, 4, 3)).astype(np.uint8), affine)
    return tmp_path / "img", tmp_path / "msk"


def canonical(path) -> np.ndarray:
    """nibabel's own reorientation of a file: the reference the reader must match."""
    return np.asarray(nib.as_closest_canonical(nib.load(str(path))).get_fdata(), dtype=np.float32)


def test_each_nifti_volume_is_one_sample_in_ras_as_nibabel_reorients_it(tmp_path):
    images, masks = folder_of_volumes(tmp_path)
    ds = load_worker_data(nifti(path=str(images), masks=str(masks), labels="mask", num_classes=3))
    names = ("lps.nii.gz", "psr.nii", "ras.nii")
    assert ds.x.keys == tuple(str(images / n) for n in names) and ds.labels == "mask" and ds.num_classes == 3
    assert ds.y.keys == tuple(str(masks / n) for n in names)  # paths: the stream's cache fingerprints them
    for i, name in enumerate(names):
        want = canonical(images / name)
        assert ds.x.read([i])[0, 0].shape == want.shape and np.array_equal(ds.x.read([i])[0, 0], want)
        assert np.array_equal(ds.y.read([i])[0], canonical(masks / name).astype(np.int64))
    geometry = {g.file: g for g in ds.x.geometries}
    assert [geometry[n].stored for n in ("ras.nii", "lps.nii.gz", "psr.nii")] == ["RAS", "LPS", "PSR"]
    assert geometry["ras.nii"].spacing == pytest.approx((0.8, 1.5, 2.5)) == geometry["lps.nii.gz"].spacing
    # in RAS order: psr's stored axes (P 0.8, S 1.5, R 2.5 mm) become x 2.5, y 0.8, z 1.5
    assert geometry["psr.nii"].spacing == pytest.approx((2.5, 0.8, 1.5)) and geometry["psr.nii"].shape == (3, 5, 4)
    assert ds.x.shape == (3, 1, 0, 0, 0)  # the permuted file's RAS shape (3, 5, 4) differs from the others'


@pytest.mark.parametrize(("slices", "axis"), [("axial", 2), ("coronal", 1), ("sagittal", 0)])
def test_slices_are_the_ras_volumes_planes_and_masks_are_sliced_alike(tmp_path, slices, axis):
    images, masks = folder_of_volumes(tmp_path)
    ds = load_worker_data(nifti(path=str(images), masks=str(masks), labels="mask", num_classes=3, slices=slices))
    volumes = {name: canonical(images / name) for name in AFFINES}
    labels = {name: canonical(masks / name) for name in AFFINES}
    expected = [(f"{images / n}#{k}", np.take(volumes[n], k, axis=axis), np.take(labels[n], k, axis=axis))
                for n in sorted(AFFINES) for k in range(volumes[n].shape[axis])]
    assert list(ds.x.keys) == [key for key, _, _ in expected]
    for i, (_key, plane, mask) in enumerate(expected):
        assert np.array_equal(ds.x.read([i])[0, 0], plane)
        assert np.array_equal(ds.y.read([i])[0], mask.astype(np.int64))
    train, test = train_test_split(ds, test_fraction=0.25, seed=1)  # views keep the geometry
    assert len(train) + len(test) == len(ds) and train.x.geometries == ds.x.geometries


def test_an_uncompressed_slice_is_read_alone_and_a_gz_volume_is_decoded_once_for_its_slices(tmp_path, monkeypatch):
    images, _ = folder_of_volumes(tmp_path, masks=False)
    (tmp_path / "labels.csv").write_text("file,label\nras.nii,0\nlps.nii.gz,1\npsr.nii,1\n")
    ds = load_worker_data(nifti(path=str(images), labels_csv=str(tmp_path / "labels.csv"), slices="axial"))
    decoded: list[str] = []
    real = NiftiFile.decode

    def counting(self: NiftiFile) -> np.ndarray:
        decoded.append(self.name)
        return real(self)

    monkeypatch.setattr(NiftiFile, "decode", counting)
    gz = [i for i, key in enumerate(ds.x.keys) if key.startswith(f"{images / 'lps.nii.gz'}#")]
    plain = [i for i, key in enumerate(ds.x.keys) if not key.startswith(f"{images / 'lps.nii.gz'}#")]
    for i in plain:  # psr's planes have another shape than ras's: read one at a time
        ds.x.read([i])
    assert decoded == []  # each plane of a .nii read through nibabel's proxy: no whole volume decoded
    ds.x.read(gz)
    ds.x.read(gz[::-1])
    assert decoded == ["lps.nii.gz"]  # the cache: one decode for all its slices, twice over
    assert list(ds.y) == [1] * 3 + [1] * 4 + [0] * 3  # a volume's label on each of its slices (lps, psr, ras)


def test_a_dicom_series_is_sorted_by_position_in_hounsfield_units_at_its_world_coordinates(tmp_path):
    stored = np.random.default_rng(4).integers(-100, 2000, size=(4, 3, 5)).astype(np.int16)
    write_series(tmp_path / "ct" / "patient-a", stored, spacing=(0.7, 0.6), positions=[10, 12, 14, 16],
                 slope=1.0, intercept=-1024.0)
    write_series(tmp_path / "ct" / "patient-b", stored[::-1].copy(), slope=2.0, intercept=-1000.0)
    (tmp_path / "labels.csv").write_text("file,finding\npatient-a,sick\npatient-b,well\n")
    ds = load_worker_data(WorkerConfig(dataset="dicom", data=DataSection(
        path=str(tmp_path / "ct"), labels_csv=str(tmp_path / "labels.csv"), label_column="finding",
        classes=("well", "sick"))))
    assert list(ds.y) == [1, 0] and ds.num_classes == 2
    a, b = ds.x.read([0])[0, 0], ds.x.read([1])[0, 0]
    assert a.shape == (5, 3, 4)  # RAS: columns (x), rows (y), slices (z)
    assert float(a.min()) == float(stored.min()) - 1024 and float(b.max()) == 2.0 * float(stored.max()) - 1000
    series = ds.x.geometries[0]
    assert series.spacing == pytest.approx((0.6, 0.7, 2.0)) and series.stored == "LPS"
    # each stored pixel (slice k, row r, column c) lies, in DICOM's LPS, at position_k + c·0.6·row + r·0.7·col
    from fedbroker.datasets.volumes.dicom import dicom_series
    world = dicom_series(str(tmp_path / "ct"))[0][0].world()
    for k, r, c in [(0, 0, 0), (3, 2, 4), (1, 2, 0), (2, 0, 3)]:
        lps = np.array([c * 0.6, r * 0.7, 10 + 2 * k])
        ras = np.array([-lps[0], -lps[1], lps[2], 1.0])
        voxel = np.linalg.solve(world, ras)[:3]
        i, j, z = (round(float(v)) for v in voxel)
        assert np.allclose(voxel, (i, j, z), atol=1e-6)
        assert a[i, j, z] == stored[k, r, c] - 1024


def test_dicom_masks_are_niftis_named_after_their_series(tmp_path):
    stored = np.arange(3 * 4 * 5, dtype=np.int16).reshape(3, 4, 5)
    write_series(tmp_path / "ct" / "s1", stored, spacing=(0.5, 0.5))
    drawn = (stored % 3).astype(np.uint8)          # (slices, rows, columns)
    (tmp_path / "masks").mkdir()
    # the radiologist's tool wrote it in the series' own voxel order (columns, rows, slices) with its LPS→RAS affine
    affine = LPS @ np.array([[0.5, 0, 0, 0], [0, 0.5, 0, 0], [0, 0, 2.0, 0], [0, 0, 0, 1]])
    write_nifti(tmp_path / "masks" / "s1.nii.gz", drawn.transpose(2, 1, 0).copy(), affine)
    ds = load_worker_data(WorkerConfig(dataset="dicom", data=DataSection(
        path=str(tmp_path / "ct"), masks=str(tmp_path / "masks"), labels="mask", num_classes=3, slices="axial")))
    assert ds.x.shape == (3, 1, 5, 4) and ds.y.shape == (3, 5, 4)
    for k in range(3):  # the mask's value at each voxel is the class drawn on that pixel: stored % 3
        image, mask = ds.x.read([k])[0, 0], ds.y.read([k])[0]
        assert np.array_equal(mask, ((image + 1024).astype(np.int64)) % 3)


def test_multilabel_and_target_labels_come_from_their_columns(tmp_path):
    images, _ = folder_of_volumes(tmp_path, masks=False)
    (tmp_path / "l.csv").write_text("file,a,b,age\nras.nii,1,0,50.5\nlps.nii.gz,0,1,61\npsr.nii,1,1,70\n")
    multi = load_worker_data(nifti(path=str(images), labels_csv=str(tmp_path / "l.csv"), labels="multilabel",
                                   label_columns=("a", "b")))
    assert multi.num_classes == 2 and multi.y.tolist() == [[0, 1], [1, 1], [1, 0]]  # lps, psr, ras
    target = load_worker_data(nifti(path=str(images), labels_csv=str(tmp_path / "l.csv"), labels="target",
                                    label_column="age"))
    assert target.y.dtype == np.float32 and target.y.tolist() == [61.0, 70.0, 50.5]


def _geometry(name: str, spacing: tuple[float, float, float]) -> Geometry:
    return Geometry(name, (4, 4, 4), spacing, "LPS")


def test_geometry_problems_name_the_volumes_off_the_jobs_spacing_and_an_orientation_not_delivered():
    volumes = [_geometry("a.nii", (1.0, 1.0, 1.0)), _geometry("b.nii", (1.0, 1.0, 1.04)),
               _geometry("c.nii", (1.0, 1.0, 3.0))]
    assert geometry_problems(volumes[:2], {"spacing": [1, 1, 1], "spacing_tolerance": 0.05}) == []
    [problem] = geometry_problems(volumes, {"spacing": [1, 1, 1], "spacing_tolerance": 0.01, "orientation": "ras"})
    assert problem.field == "data.expect.spacing"
    assert "2 of this site's 3 volumes have b.nii 1×1×1.04; c.nii 1×1×3" in problem.problem
    orientation, spacing = geometry_problems(volumes, VolumeExpectation((1.0, 1.0, 1.0), 0.0, "LPS"))
    assert spacing.field == "data.expect.spacing" and orientation.field == "data.expect.orientation" and "delivers every volume in RAS" in orientation.problem
    unnamed = geometry_problems(volumes, {"spacing": [1, 1, 1]}, name_files=False)[0].problem
    assert "c.nii" not in unnamed and "1 of this site's 3 volumes have 1×1×3" in unnamed


@pytest.mark.parametrize(("raw", "field"), [({"spacing": [1, 0, 1]}, "data.expect.spacing"),
                                            ({"spacing": [1, 1]}, "data.expect.spacing"),
                                            ({"spacing_tolerance": 2}, "data.expect.spacing_tolerance"),
                                            ({"orientation": "RRS"}, "data.expect.orientation")])
def test_a_malformed_expectation_is_refused_naming_its_field(raw, field):
    with pytest.raises(ConfigError) as info:
        expectation(raw)
    assert info.value.field == field


def test_a_split_of_slices_keeps_each_volumes_slices_on_one_side(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "msk").mkdir()
    for i in range(10):
        write_nifti(tmp_path / "img" / f"v{i}.nii", np.full((4, 4, 3), float(i), np.float32))
        write_nifti(tmp_path / "msk" / f"v{i}.nii", np.zeros((4, 4, 3), np.uint8))
    ds = load_worker_data(nifti(path=str(tmp_path / "img"), masks=str(tmp_path / "msk"), labels="mask",
                                num_classes=2, slices="axial"))
    train, test = train_test_split(ds, test_fraction=0.2, seed=5)
    volume = {os.path.basename(key.split("#")[0]) for key in (train.x.key(i) for i in range(len(train)))}
    held = {os.path.basename(key.split("#")[0]) for key in (test.x.key(i) for i in range(len(test)))}
    assert len(held) == 2 and len(volume) == 8 and not volume & held and len(test) == 6
    assert set(np.unique(test.x.read(np.arange(len(test))))) == {float(v[1]) for v in held}
