"""Small synthetic volumes written as a scanner or a hospital's export would: NIfTI images through nibabel, DICOM
series through pydicom (one file a slice, file meta, uncompressed transfer syntax), for the volume readers'
tests. Nothing here is read from elsewhere."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import nibabel as nib
import numpy as np
from pydicom import dcmwrite
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import UID, CTImageStorage, ExplicitVRLittleEndian, ImplicitVRLittleEndian, generate_uid

LPS = np.diag([-1.0, -1.0, 1.0, 1.0])


def write_nifti(path: Path, data: np.ndarray, affine: np.ndarray | None = None) -> Path:
    """`data` as a NIfTI-1 file (.nii or .nii.gz by the name) with `affine` (default: 1 mm, RAS)."""
    nib.save(nib.Nifti1Image(data, np.eye(4) if affine is None else affine), str(path))
    return path


def write_series(folder: Path, stored: np.ndarray, *, spacing: Sequence[float] = (0.5, 0.5),
                 positions: Sequence[float] | None = None, slope: float = 1.0, intercept: float = -1024.0,
                 orientation: Sequence[float] = (1, 0, 0, 0, 1, 0), syntax: UID = ExplicitVRLittleEndian,
                 names: Sequence[str] | None = None) -> Path:
    """A CT series: `stored` (slices, rows, columns) int16 values, one file a slice, each at z = `positions[k]`
    (default 2 mm apart) along the plane's normal; written in reverse order under shuffled names so a reader
    must sort by position, not by name."""
    folder.mkdir(parents=True, exist_ok=True)
    count, rows, columns = stored.shape
    positions = [2.0 * k for k in range(count)] if positions is None else list(positions)
    series = generate_uid()
    row, col = np.array(orientation[:3], float), np.array(orientation[3:], float)
    normal = np.cross(row, col)
    for k in range(count):
        meta = FileMetaDataset()
        meta.MediaStorageSOPClassUID = CTImageStorage
        meta.MediaStorageSOPInstanceUID = generate_uid()
        meta.TransferSyntaxUID = syntax
        ds = Dataset()
        ds.file_meta = meta
        ds.SOPClassUID, ds.SOPInstanceUID = CTImageStorage, meta.MediaStorageSOPInstanceUID
        ds.Modality, ds.SeriesInstanceUID, ds.InstanceNumber = "CT", series, k + 1
        ds.Rows, ds.Columns = rows, columns
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 1
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.PixelSpacing = [float(s) for s in spacing]
        ds.ImageOrientationPatient = [float(v) for v in orientation]
        ds.ImagePositionPatient = [float(v) for v in normal * positions[k]]
        ds.SliceThickness = 2.0
        ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
        ds.PixelData = np.ascontiguousarray(stored[k], dtype="<i2").tobytes()
        name = names[k] if names is not None else f"IM{(count - k) * 7919 % 10007:05d}"
        dcmwrite(str(folder / name), ds, enforce_file_format=True,
                 implicit_vr=syntax == ImplicitVRLittleEndian, little_endian=True)
    return folder


def series_files(folder: Path) -> list[Path]:
    """A series folder's files by name."""
    return sorted(folder / n for n in os.listdir(folder))
