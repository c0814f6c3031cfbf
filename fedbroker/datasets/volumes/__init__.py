"""Volumes on a site's disk: a folder of NIfTI files (`worker.dataset: nifti`, `nifti`) or of DICOM series
(`dicom`, `dicom`), with masks (`worker.data.masks`, NIfTI) or a labels CSV (`worker.data.labels_csv`), served
as lazy samples (`samples`): a whole volume (C, X, Y, Z) a sample, or with `worker.data.slices` one plane
(C, a, b) a sample, keyed "<file>#<index>". Every volume is delivered in RAS; its spacing and orientation are
read at start and checked against a job's `data.expect` (`geometry`).

Refused at the door, before the worker registers or spends ε, every problem at once, each naming its file: a
header declaring an absurd shape (shape × dtype checked against the limits of `fedbroker.datasets.dataset`
before a byte of data is read), a data type no model takes, a .nii.gz inflating beyond what its header
declares (a bounded reader: at most one byte past the declared size), a truncated file, NaN or infinite
voxels, a file that is no volume, a degenerate or oblique affine, an inconsistent DICOM series (mixed grids or
orientations, duplicate or missing slices), masks of another shape or affine or out of 0..num_classes−1, a
folder of more than `MAX_ENTRIES` entries (the listing stops there). Each volume is decoded once at start, one
at a time (memory: one volume and its mask), to find what only its data shows.
"""

from __future__ import annotations

import os

from fedbroker.config import DataSection
from fedbroker.datasets.dataset import Dataset
from fedbroker.datasets.volumes.geometry import CANONICAL, Geometry, VolumeExpectation, expectation, geometry_problems
from fedbroker.datasets.volumes.nifti import MAX_ENTRIES
from fedbroker.datasets.volumes.samples import Volume, VolumeSamples, volume_dataset
from fedbroker.errors import ConfigError

__all__ = ["CANONICAL", "MAX_ENTRIES", "Geometry", "VolumeExpectation", "VolumeSamples", "expectation",
           "geometry_problems", "load_volumes"]


def load_volumes(source: DataSection, kind: str) -> Dataset:
    """`worker.dataset` nifti or dicom: the volumes under `worker.data.path`, checked, as lazy samples."""
    if not source.path or not os.path.isdir(source.path):
        raise ConfigError("worker.data.path", f"dataset {kind} needs the folder of its volumes (worker.data.path); "
                                              f"{source.path!r} is not a folder")
    volumes: list[Volume]
    if kind == "nifti":
        from fedbroker.datasets.volumes.nifti import nifti_volumes

        found, problems = nifti_volumes(source.path, setting="worker.data.path")
        volumes = list(found)
    else:
        from fedbroker.datasets.volumes.dicom import dicom_series

        series, problems = dicom_series(source.path)
        volumes = list(series)
    return volume_dataset(source, kind, volumes, problems)
