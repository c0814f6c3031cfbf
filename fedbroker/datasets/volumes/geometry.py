"""Where a volume's voxels lie: spacing (mm) and orientation, read from every NIfTI header and DICOM series at
start, and checked against what a job expects (`data.expect`) where the worker judges whether a job fits.

Decision: every volume is delivered in one canonical orientation, RAS (nibabel's axis codes name where
each voxel axis points: the first to the patient's Right, the second Anterior, the third Superior).
A file stored otherwise (DICOM's LPS, a NIfTI written LAS or PSR) is turned into RAS by permuting and flipping
its axes: lossless, no voxel is interpolated. A volume whose axes lie more than `MAX_OBLIQUE_DEGREES` off the world's axes would need
resampling to be RAS; it is refused at start, naming the file and its angle (the owner resamples it with the
tool of their choice). So a job's `expect.orientation` can only be met as RAS: any other is refused as a
misfit, saying so; `expect.spacing` is compared per axis of the RAS volume within a relative tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import nibabel.orientations
import numpy as np

from fedbroker.errors import ConfigError

CANONICAL = "RAS"              # the orientation every volume is delivered in
MAX_OBLIQUE_DEGREES = 5.0      # an axis further off the world's axes would need resampling: refused
_SHOWN = 3                     # files named per problem before "and N more"
_CODES = ("LR", "PA", "IS")    # each axis code pair: a valid orientation names one of each, once
_ORIENT: Any = nibabel.orientations  # untyped: its functions return plain arrays and tuples


@dataclass(frozen=True)
class Geometry:
    """One volume's geometry: its file, its spatial shape and voxel spacing (mm) in RAS axis order, the axis
    codes it was stored in (e.g. 'LPS' for DICOM) and how far its axes lie off the world's (degrees)."""

    file: str
    shape: tuple[int, int, int]
    spacing: tuple[float, float, float]
    stored: str
    oblique_degrees: float = 0.0


@dataclass(frozen=True)
class VolumeExpectation:
    """What a job expects of a site's volumes (`data.expect`): the voxel spacing in mm per RAS axis (empty: any),
    its relative tolerance, and the orientation ('' : any)."""

    spacing: tuple[float, ...] = ()
    spacing_tolerance: float = 0.05
    orientation: str = ""


def expectation(raw: object) -> VolumeExpectation | None:
    """A job's `data.expect` as a `VolumeExpectation`: None, a mapping from YAML, or any object with the
    attributes `spacing`, `spacing_tolerance`, `orientation` (the pipeline's parsed section); checked."""
    if raw is None or isinstance(raw, VolumeExpectation):
        return raw
    get: Any = raw.get if isinstance(raw, Mapping) else (lambda key, default: getattr(raw, key, default))
    spacing = get("spacing", ()) or ()
    tolerance = get("spacing_tolerance", 0.05)
    orientation = str(get("orientation", "") or "").upper()
    if not isinstance(spacing, Sequence) or isinstance(spacing, str) or len(spacing) not in (0, 3) or not all(
            isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s > 0 for s in spacing):
        raise ConfigError("data.expect.spacing", f"must be three voxel sizes in mm (> 0), got {spacing!r}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ConfigError("data.expect.spacing_tolerance", f"must be a fraction in [0, 1), got {tolerance!r}")
    if orientation and (len(orientation) != 3 or sorted(
            next((i for i, pair in enumerate(_CODES) if c in pair), -1) for c in orientation) != [0, 1, 2]):
        raise ConfigError("data.expect.orientation", f"must be three axis codes, one of each of L/R, P/A, I/S "
                                                     f"(e.g. RAS), got {orientation!r}")
    return VolumeExpectation(tuple(float(s) for s in spacing), float(tolerance), orientation)


def geometry_problems(geometries: Sequence[Geometry], expect: object, *, name_files: bool = True) -> list[ConfigError]:
    """Every way the site's volumes miss the job's expectation (`expectation(expect)`), each naming the first
    files and their count (`name_files` False: only the count and the spacings, for a reason that leaves the
    site: a DICOM folder's name is often a patient's identifier); empty when they fit or nothing is expected."""
    wanted = expectation(expect)
    if wanted is None or not geometries:
        return []
    out: list[ConfigError] = []
    if wanted.orientation and wanted.orientation != CANONICAL:
        out.append(ConfigError("data.expect.orientation", f"this site delivers every volume in {CANONICAL} (each "
                                                          f"is reoriented when read), the job expects "
                                                          f"{wanted.orientation}"))
    if wanted.spacing:
        want = np.array(wanted.spacing)
        off = [g for g in geometries
               if np.any(np.abs(np.array(g.spacing) - want) > wanted.spacing_tolerance * want)]
        if off:
            shown = "; ".join(f"{g.file + ' ' if name_files else ''}{_mm(g.spacing)}" for g in off[:_SHOWN])
            more = f" (and {len(off) - _SHOWN} more)" if len(off) > _SHOWN else ""
            out.append(ConfigError("data.expect.spacing", f"the job expects voxels of {_mm(wanted.spacing)} mm "
                                                          f"(±{wanted.spacing_tolerance:.0%}), {len(off)} of this "
                                                          f"site's {len(geometries)} volumes have {shown}{more}"))
    return out


def _mm(values: Sequence[float]) -> str:
    return "×".join(f"{v:.4g}" for v in values)


def to_ras(affine: np.ndarray, shape: Sequence[int], *, file: str) -> tuple[np.ndarray, Geometry]:
    """The axis permutation and flips (nibabel's `ornt`) that turn a volume of this voxel-to-world affine into
    RAS, and its geometry; ValueError saying why when the affine is degenerate or too oblique."""
    affine = np.asarray(affine, dtype=np.float64)
    if affine.shape != (4, 4) or not np.isfinite(affine).all():
        raise ValueError("its voxel-to-world affine is not a finite 4×4 matrix")
    axes = affine[:3, :3]
    spacing = np.linalg.norm(axes, axis=0)
    if not (spacing > 0).all() or abs(np.linalg.det(axes)) < 1e-12 * float(np.prod(spacing)):
        raise ValueError("its voxel-to-world affine is singular (a zero voxel size or two parallel axes)")
    cosines = np.abs(axes / spacing).max(axis=0)
    oblique = float(np.degrees(np.arccos(np.clip(cosines.min(), -1.0, 1.0))))
    if oblique > MAX_OBLIQUE_DEGREES:
        raise ValueError(f"its axes lie {oblique:.1f}° off the world's axes (at most {MAX_OBLIQUE_DEGREES}° is "
                         f"reoriented without resampling; resample it to an axis-aligned grid first)")
    ornt = _ORIENT.io_orientation(affine)
    if np.isnan(ornt).any():
        raise ValueError("two of its axes point the same way")
    ras_shape = [0, 0, 0]
    ras_spacing = [0.0, 0.0, 0.0]
    for axis, (target, _flip) in enumerate(ornt):
        ras_shape[int(target)] = int(shape[axis])
        ras_spacing[int(target)] = float(spacing[axis])
    stored = "".join(_ORIENT.ornt2axcodes(ornt))
    return ornt, Geometry(file, (ras_shape[0], ras_shape[1], ras_shape[2]),
                          (ras_spacing[0], ras_spacing[1], ras_spacing[2]), stored, round(oblique, 3))


def reorient(array: np.ndarray, ornt: np.ndarray) -> np.ndarray:
    """A volume (its first three axes spatial, as stored) in RAS: a view, axes permuted and flipped."""
    return np.asarray(_ORIENT.apply_orientation(array, ornt))


def ras_affine(affine: np.ndarray, shape: Sequence[int], ornt: np.ndarray) -> np.ndarray:
    """The voxel-to-world affine of the reoriented volume (to compare an image's with its mask's)."""
    return np.asarray(np.asarray(affine, dtype=np.float64) @ _ORIENT.inv_ornt_aff(ornt, tuple(int(d) for d in shape[:3])))
