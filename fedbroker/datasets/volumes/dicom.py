"""DICOM series (pydicom): `worker.data.path` holds one sub-folder per series, each a stack of single-frame
slices. Every slice's header is read first (`dcmread(stop_before_pixels=True)`, large values deferred) and
checked: uncompressed transfer syntax, one sample a pixel, Rows/Columns/BitsAllocated, PixelSpacing,
ImagePositionPatient and ImageOrientationPatient finite and sane and the same across the series (one series,
one orientation, one grid); the slices are sorted along the plane's normal, and duplicates, gaps and uneven
spacing are refused. Pixel values go through RescaleSlope/RescaleIntercept (CT in Hounsfield units). The
series' voxel-to-world affine is built in DICOM's LPS, turned to RAS, and the volume reoriented to RAS as a
NIfTI's is (`fedbroker.datasets.volumes.geometry`)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pydicom
from pydicom.errors import InvalidDicomError
from pydicom.uid import ExplicitVRBigEndian, ExplicitVRLittleEndian, ImplicitVRLittleEndian

from fedbroker.datasets.dataset import MAX_ARRAY_BYTES, MAX_VALUES
from fedbroker.datasets.volumes.geometry import Geometry, ras_affine, reorient, to_ras
from fedbroker.datasets.volumes.nifti import MAX_SIDE, scaled, scan
from fedbroker.errors import ConfigError

SYNTAXES = (ImplicitVRLittleEndian, ExplicitVRLittleEndian, ExplicitVRBigEndian)  # uncompressed: size known
MAX_SLICE_BYTES = (1 << 26) + (1 << 20)     # one slice file: 4096² × 4 bytes of pixels and 1 MiB of header
SPACING_TOLERANCE = 0.01                    # slice gaps may differ from their median by 1 %
_LPS_TO_RAS = np.diag([-1.0, -1.0, 1.0, 1.0])


@dataclass(frozen=True)
class Slice:
    """One slice's header facts the series needs."""

    path: str
    rows: int
    columns: int
    bits: int
    signed: int
    spacing: tuple[float, float]
    position: tuple[float, float, float]
    orientation: tuple[float, ...]
    slope: float
    intercept: float
    series: str


@dataclass(frozen=True, eq=False)
class DicomSeries:
    """A checked series: its slices in order along the normal, its affine, geometry and reorientation."""

    name: str
    path: str
    slices: tuple[Slice, ...]
    affine: np.ndarray           # voxel (column, row, slice) → world RAS, mm
    ornt: np.ndarray
    geometry: Geometry

    @property
    def channels(self) -> int:
        """One: a series is grey values."""
        return 1

    def decode(self) -> np.ndarray:
        """(1, X, Y, Z) float32 in RAS, each slice's stored values × slope + intercept (Hounsfield units for CT)."""
        first = self.slices[0]
        out = np.empty((first.columns, first.rows, len(self.slices)), dtype=np.float32)
        for k, piece in enumerate(self.slices):
            try:
                pixels = pydicom.dcmread(piece.path).pixel_array
            except (OSError, ValueError, AttributeError, KeyError, TypeError, InvalidDicomError) as exc:
                raise ValueError(f"slice {os.path.basename(piece.path)}: its pixel data cannot be read: {exc}") from None
            if pixels.shape != (first.rows, first.columns):
                raise ValueError(f"slice {os.path.basename(piece.path)}: its pixels are {list(pixels.shape)}, its "
                                 f"header declares {[first.rows, first.columns]}")
            out[:, :, k] = scaled(pixels, piece.slope, piece.intercept, where=_pixel_place(piece.path)).T
        return np.ascontiguousarray(reorient(out, self.ornt)[None])

    def plane(self, axis: int, index: int) -> np.ndarray | None:
        """Cut from a decoded series (the caller's cache)."""
        return None

    def world(self) -> np.ndarray:
        """The voxel-to-world affine of the series in RAS (mm)."""
        return ras_affine(self.affine, self.stored_shape, self.ornt)

    @property
    def stored_shape(self) -> tuple[int, int, int]:
        """(Columns, Rows, slices): the voxel axes of `affine`."""
        first = self.slices[0]
        return first.columns, first.rows, len(self.slices)


def _pixel_place(path: str) -> Callable[[tuple[int, ...]], str]:
    return lambda at: f"{path} pixel {list(at)}"


def _numbers(value: Any, count: int) -> tuple[float, ...] | None:
    """`count` finite numbers from a header value (one number or a multi-valued element), or None."""
    try:
        items = [float(v) for v in (value if isinstance(value, (list, tuple, Sequence)) else [value])]
    except (TypeError, ValueError):
        return None
    return tuple(items) if len(items) == count and all(map(math.isfinite, items)) else None


def read_slice(path: str) -> Slice:
    """One slice's header, without its pixels; ValueError saying what is wrong."""
    size = os.path.getsize(path)
    if size > MAX_SLICE_BYTES:
        raise ValueError(f"is {size} bytes, more than the {MAX_SLICE_BYTES} one uncompressed slice may take")
    try:
        ds = pydicom.dcmread(path, stop_before_pixels=True, defer_size=1 << 16)
    except InvalidDicomError:
        raise ValueError("is not a DICOM file (no DICM preamble)") from None
    except (OSError, ValueError, EOFError, KeyError, TypeError) as exc:
        raise ValueError(f"has an unreadable DICOM header: {exc}") from None
    syntax = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", None)
    if syntax not in SYNTAXES:
        raise ValueError(f"uses the transfer syntax {syntax!r}; read are the uncompressed ones "
                         f"({', '.join(s.name for s in SYNTAXES)})")
    rows, columns = int(ds.get("Rows", 0) or 0), int(ds.get("Columns", 0) or 0)
    bits, signed = int(ds.get("BitsAllocated", 0) or 0), int(ds.get("PixelRepresentation", 0) or 0)
    frames, samples = int(ds.get("NumberOfFrames", 1) or 1), int(ds.get("SamplesPerPixel", 1) or 1)
    if not (1 <= rows <= MAX_SIDE and 1 <= columns <= MAX_SIDE):
        raise ValueError(f"declares {rows}×{columns} pixels (Rows×Columns: each in [1, {MAX_SIDE}])")
    if bits not in (8, 16, 32) or signed not in (0, 1):
        raise ValueError(f"declares BitsAllocated {bits}, PixelRepresentation {signed} (read: 8, 16 or 32 bits, "
                         f"unsigned or signed)")
    if frames != 1 or samples != 1:
        raise ValueError(f"declares {frames} frames of {samples} samples a pixel: a series is read as single-frame, "
                         f"one-sample slices")
    spacing = _numbers(ds.get("PixelSpacing"), 2)
    position = _numbers(ds.get("ImagePositionPatient"), 3)
    orientation = _numbers(ds.get("ImageOrientationPatient"), 6)
    if spacing is None or min(spacing) <= 0:
        raise ValueError(f"has no valid PixelSpacing (two sizes in mm > 0): {ds.get('PixelSpacing')!r}")
    if position is None or orientation is None:
        raise ValueError("lacks a finite ImagePositionPatient (3 numbers) or ImageOrientationPatient (6 numbers)")
    row, col = np.array(orientation[:3]), np.array(orientation[3:])
    if abs(np.linalg.norm(row) - 1) > 1e-3 or abs(np.linalg.norm(col) - 1) > 1e-3 or abs(row @ col) > 1e-3:
        raise ValueError(f"has an ImageOrientationPatient {list(orientation)} that is not two orthogonal unit vectors")
    slope, intercept = _numbers(ds.get("RescaleSlope", 1.0), 1), _numbers(ds.get("RescaleIntercept", 0.0), 1)
    if slope is None or intercept is None or slope[0] == 0:
        raise ValueError(f"has an invalid RescaleSlope {ds.get('RescaleSlope')!r} or RescaleIntercept "
                         f"{ds.get('RescaleIntercept')!r}")
    return Slice(path, rows, columns, bits, signed, (spacing[0], spacing[1]), (position[0], position[1], position[2]),
                 orientation, slope[0], intercept[0], str(ds.get("SeriesInstanceUID", "")))


def build_series(name: str, folder: str, slices: Sequence[Slice]) -> DicomSeries:
    """The slices as one volume: consistent, sorted along the normal, evenly spaced; ValueError saying why not."""
    if not slices:
        raise ValueError("holds no slices")
    first = slices[0]
    for field, label in (("rows", "Rows"), ("columns", "Columns"), ("bits", "BitsAllocated"),
                         ("signed", "PixelRepresentation"), ("series", "SeriesInstanceUID")):
        seen = sorted({str(getattr(s, field)) for s in slices})
        if len(seen) > 1:
            raise ValueError(f"mixes slices of {len(seen)} {label} values ({', '.join(seen[:3])}): one series a "
                             f"folder, one grid")
    if any(not np.allclose(s.orientation, first.orientation, atol=1e-4) for s in slices):
        raise ValueError("mixes slices of different ImageOrientationPatient: one series a folder, one orientation")
    if any(not np.allclose(s.spacing, first.spacing, rtol=1e-4) for s in slices):
        raise ValueError("mixes slices of different PixelSpacing")
    values = first.rows * first.columns * len(slices)
    if values > MAX_VALUES or values * 4 > MAX_ARRAY_BYTES:
        raise ValueError(f"declares {len(slices)} slices of {first.rows}×{first.columns}: more than the {MAX_VALUES} "
                         f"values a volume may hold")
    row, col = np.array(first.orientation[:3]), np.array(first.orientation[3:])
    normal = np.cross(row, col)
    ordered = sorted(slices, key=lambda s: float(np.dot(s.position, normal)))
    depth = np.array([np.dot(s.position, normal) for s in ordered])
    step = float(np.median(np.diff(depth))) if len(ordered) > 1 else 1.0
    gaps = np.diff(depth)
    if len(ordered) > 1 and gaps.min() < 1e-3:
        at = int(np.argmin(gaps))
        raise ValueError(f"has two slices at the same position ({os.path.basename(ordered[at].path)}, "
                         f"{os.path.basename(ordered[at + 1].path)}): duplicates")
    if len(ordered) > 1 and np.abs(gaps - step).max() > SPACING_TOLERANCE * step:
        at = int(np.argmax(np.abs(gaps - step)))
        raise ValueError(f"is not evenly spaced: {gaps[at]:.4g} mm between {os.path.basename(ordered[at].path)} and "
                         f"{os.path.basename(ordered[at + 1].path)}, {step:.4g} mm elsewhere (a missing slice?)")
    through = ((np.array(ordered[-1].position) - np.array(ordered[0].position)) / (len(ordered) - 1)
               if len(ordered) > 1 else normal * step)
    lps = np.eye(4)
    lps[:3, 0] = row * first.spacing[1]       # column index runs along the row direction (PixelSpacing[1])
    lps[:3, 1] = col * first.spacing[0]       # row index along the column direction (PixelSpacing[0])
    lps[:3, 2] = through
    lps[:3, 3] = ordered[0].position
    affine = _LPS_TO_RAS @ lps
    ornt, geometry = to_ras(affine, (first.columns, first.rows, len(ordered)), file=name)
    return DicomSeries(name, folder, tuple(ordered), affine, ornt, geometry)


def dicom_series(folder: str) -> tuple[list[DicomSeries], list[ConfigError]]:
    """Every series folder under `folder`, each checked from its headers; every problem, each naming its place."""
    found: list[DicomSeries] = []
    problems: list[ConfigError] = []
    strangers: list[str] = []
    for entry in scan(folder, setting="worker.data.path"):
        if not entry.is_dir():
            strangers.append(entry.name)
            continue
        slices: list[Slice] = []
        bad: list[str] = []
        for item in scan(entry.path, setting="worker.data.path"):
            try:
                if not item.is_file():
                    raise ValueError("is not a file")
                slices.append(read_slice(item.path))
            except ValueError as exc:
                bad.append(f"{item.path} {exc}")
        if bad:
            problems.append(ConfigError("worker.data.path", "; ".join(bad[:3]) + (
                f" (and {len(bad) - 3} more files of {entry.path})" if len(bad) > 3 else "")))
            continue
        try:
            found.append(build_series(entry.name, entry.path, slices))
        except ValueError as exc:
            problems.append(ConfigError("worker.data.path", f"series {entry.path} {exc}"))
    if strangers:
        problems.append(ConfigError("worker.data.path", f"{folder} holds files beside its series folders (one "
                                                        f"sub-folder a series): {', '.join(strangers[:5])}"))
    return found, problems
