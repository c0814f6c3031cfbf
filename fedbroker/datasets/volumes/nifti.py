"""NIfTI volumes (.nii, .nii.gz; NIfTI-1 or NIfTI-2 single files): each header parsed from its first bytes
with nibabel's header classes and checked (shape × dtype against the limits, data type, data offset, affine)
before a byte of data is read; data read through a bounded reader (`read_exact`), never inflated past what
the header declares. nibabel's own loader is not used: it reads a header's extensions whole, and a .gz
extension can declare gigabytes."""

from __future__ import annotations

import gzip
import io
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nibabel.arrayproxy
import nibabel.nifti1
import nibabel.nifti2
import numpy as np
from nibabel.spatialimages import HeaderDataError

from fedbroker.datasets.dataset import MAX_ARRAY_BYTES, MAX_VALUES, check_values
from fedbroker.datasets.volumes.geometry import Geometry, ras_affine, reorient, to_ras
from fedbroker.errors import ConfigError

MAX_ENTRIES = 100_000          # entries a data folder (or a DICOM series) may hold; the listing stops past it
MAX_SIDE = 4096                # voxels along one axis
MAX_CHANNELS = 16              # a 4-D NIfTI's last axis: channels (modalities)
MAX_VOX_OFFSET = 1 << 20       # where a NIfTI's data may start (header and extensions, never read here)
NIFTI_DTYPES = ("uint8", "int8", "int16", "uint16", "int32", "uint32", "float32", "float64")
_CHUNK = 1 << 22
# nibabel is untyped: its header classes and proxy are used through these names
_PROXY: Any = nibabel.arrayproxy.ArrayProxy
_HEADERS: dict[int, Any] = {348: nibabel.nifti1.Nifti1Header, 540: nibabel.nifti2.Nifti2Header}


def scan(folder: str, *, setting: str) -> list[os.DirEntry[str]]:
    """A folder's entries by name; refused past MAX_ENTRIES without listing the rest (a folder of 10^6 files)."""
    found: list[os.DirEntry[str]] = []
    try:
        with os.scandir(folder) as listing:
            for entry in listing:
                if len(found) == MAX_ENTRIES:
                    raise ConfigError(setting, f"{folder} holds more than {MAX_ENTRIES} entries; split the data "
                                               f"over several sites or folders")
                found.append(entry)
    except OSError as exc:
        raise ConfigError(setting, f"{folder} cannot be listed: {exc.strerror}") from None
    return sorted(found, key=lambda e: e.name)


def _open(path: str, gz: bool) -> io.BufferedIOBase:
    """The file's bytes, inflated when it is a .gz (closed by the caller's `with`)."""
    return gzip.open(path, "rb") if gz else open(path, "rb")


def read_exact(path: str, *, gz: bool, offset: int, nbytes: int) -> bytearray:
    """The `nbytes` bytes of data after `offset`, through a bounded reader: a .gz is inflated at most one byte
    past them (a decompression bomb behind a small header is refused, never inflated); ValueError saying why."""
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    try:
        with _open(path, gz) as fh:
            if gz:
                skipped = len(fh.read(offset))
                if skipped < offset:
                    raise ValueError(f"is truncated: it ends inside its header ({skipped} of {offset} bytes)")
            else:
                fh.seek(offset)
            while got < nbytes:
                n = fh.readinto(view[got:got + _CHUNK])
                if not n:
                    break
                got += n
            if got < nbytes:
                raise ValueError(f"is truncated: it holds {got} of the {nbytes} bytes of data its header declares")
            if gz and fh.read(1):
                raise ValueError(f"inflates beyond the {offset + nbytes} bytes its header declares (a decompression "
                                 f"bomb, or a header that lies)")
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"cannot be read: {exc}") from None
    return buf


def scaled(raw: np.ndarray, slope: float, inter: float, *, where: Callable[[tuple[int, ...]], str]) -> np.ndarray:
    """Stored values × slope + intercept as float32, refusing NaN, ±inf and values beyond float32 before and
    after the scaling (`check_values`: ConfigError naming the voxel)."""
    check_values(raw, setting="worker.data.path", where=where)
    out = raw.astype(np.float32)
    if slope != 1.0 or inter != 0.0:
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused just below, naming the voxel
            out = (raw.astype(np.float64) * slope + inter).astype(np.float32) if raw.dtype.itemsize > 2 \
                else out * np.float32(slope) + np.float32(inter)
        check_values(out, setting="worker.data.path", where=where)
    return out


@dataclass(frozen=True, eq=False)
class NiftiFile:
    """A NIfTI-1 or NIfTI-2 single file (.nii or .nii.gz) whose header passed the checks."""

    name: str
    path: str
    gz: bool
    shape: tuple[int, ...]       # as stored: (X, Y, Z) or (X, Y, Z, C)
    dtype: np.dtype
    offset: int
    slope: float
    inter: float
    affine: np.ndarray
    ornt: np.ndarray
    geometry: Geometry

    @property
    def channels(self) -> int:
        """The channels of a 4-D file (its last axis), else 1."""
        return self.shape[3] if len(self.shape) == 4 else 1

    def raw(self) -> np.ndarray:
        """The voxels as stored (file axes), scaled to float32 and checked."""
        data = read_exact(self.path, gz=self.gz, offset=self.offset,
                          nbytes=int(np.prod(self.shape)) * self.dtype.itemsize)
        stored = np.frombuffer(data, dtype=self.dtype).reshape(self.shape, order="F")
        return scaled(stored, self.slope, self.inter, where=lambda at: f"{self.path} voxel {list(at)}")

    def decode(self) -> np.ndarray:
        """(C, X, Y, Z) float32 in RAS."""
        return _channels_first(reorient(self.raw(), self.ornt))

    def world(self) -> np.ndarray:
        """The voxel-to-world affine of the volume in RAS (mm)."""
        return ras_affine(self.affine, self.shape, self.ornt)

    def plane(self, axis: int, index: int) -> np.ndarray | None:
        """An uncompressed file's plane read alone (nibabel's proxy, memory-mapped); a .gz is not seekable."""
        if self.gz:
            return None
        stored_axis = int(np.flatnonzero(self.ornt[:, 0] == axis)[0])
        flipped = self.ornt[stored_axis, 1] < 0
        at = self.shape[stored_axis] - 1 - index if flipped else index
        cut: list[slice] = [slice(None)] * len(self.shape)
        cut[stored_axis] = slice(at, at + 1)
        proxy = _PROXY(self.path, (self.shape, self.dtype, self.offset, self.slope, self.inter))
        part = scaled(np.asarray(proxy[tuple(cut)]), 1.0, 0.0, where=lambda got: f"{self.path} voxel {list(got)}")
        return np.asarray(np.take(_channels_first(reorient(part, self.ornt)), 0, axis=1 + axis))


def _channels_first(ras: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.moveaxis(ras, 3, 0) if ras.ndim == 4 else ras[None], dtype=np.float32)


def nifti_file(path: str, name: str) -> NiftiFile:
    """A NIfTI file's header, checked before any of its data is read; ValueError saying what is wrong."""
    gz = name.endswith(".gz")
    try:
        with _open(path, gz) as fh:
            head = fh.read(540)
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError(f"cannot be read: {exc}") from None
    sizes = {int.from_bytes(head[:4], order): order for order in ("little", "big")} if len(head) >= 4 else {}
    size = next((s for s in _HEADERS if s in sizes), 0)
    if not size:
        raise ValueError("is not a NIfTI file (its first bytes declare no NIfTI-1 or NIfTI-2 header)")
    if len(head) < size:
        raise ValueError(f"is truncated: it ends inside its {size}-byte header")
    # the byte order from sizeof_hdr, never nibabel's guess from dim[0] (a hostile dim[0] would flip it)
    header = _HEADERS[size](binaryblock=head[:size], endianness="<" if sizes[size] == "little" else ">", check=False)
    magic = bytes(header["magic"].item())
    if magic not in (b"n+1", b"n+2"):
        raise ValueError(f"is not a single-file NIfTI (magic {magic!r}; a .hdr/.img pair is not read)")
    shape, dtype = _declared(header)
    offset = int(header["vox_offset"])
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if not size <= offset <= MAX_VOX_OFFSET:
        raise ValueError(f"declares its data at byte {offset}, outside [{size}, {MAX_VOX_OFFSET}]")
    if not gz and os.path.getsize(path) < offset + nbytes:
        raise ValueError(f"is truncated: it holds {os.path.getsize(path)} bytes, its header declares "
                         f"{offset + nbytes}")
    try:
        slope, inter = header.get_slope_inter()
        affine = header.get_best_affine()
    except (HeaderDataError, ValueError) as exc:
        raise ValueError(f"has an invalid header: {exc}") from None
    ornt, geometry = to_ras(affine, shape, file=name)
    return NiftiFile(name, path, gz, shape, dtype, offset, 1.0 if slope is None else float(slope),
                     0.0 if inter is None else float(inter), np.asarray(affine, np.float64), ornt, geometry)


def _declared(header: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and data type a header declares, refused when absurd (before anything else is read)."""
    dim = [int(d) for d in header["dim"]]
    if not 1 <= dim[0] <= 7:
        raise ValueError(f"declares {dim[0]} dimensions (a NIfTI has 1 to 7)")
    shape = dim[1:dim[0] + 1]
    while len(shape) > 3 and shape[-1] == 1:
        shape.pop()
    if len(shape) not in (3, 4) or any(d < 1 for d in shape):
        raise ValueError(f"declares the shape {shape}: a volume is (X, Y, Z), or (X, Y, Z, channels)")
    if any(d > MAX_SIDE for d in shape[:3]) or (len(shape) == 4 and shape[3] > MAX_CHANNELS):
        raise ValueError(f"declares the shape {shape}: at most {MAX_SIDE} voxels an axis and {MAX_CHANNELS} "
                         f"channels")
    try:
        dtype = header.get_data_dtype()
    except (HeaderDataError, KeyError, ValueError, TypeError):
        raise ValueError(f"declares the unknown data type code {int(header['datatype'])}") from None
    if dtype.fields is not None or dtype.newbyteorder("=").name not in NIFTI_DTYPES:
        raise ValueError(f"holds {dtype} voxels; read are {', '.join(NIFTI_DTYPES)}")
    values = int(np.prod(shape))
    if values > MAX_VALUES or values * max(dtype.itemsize, 4) > MAX_ARRAY_BYTES:
        raise ValueError(f"declares {shape} {dtype} voxels: more than the {MAX_VALUES} values "
                         f"({MAX_ARRAY_BYTES} bytes) a volume may hold")
    return tuple(shape), dtype


def nifti_volumes(folder: str, *, setting: str) -> tuple[list[NiftiFile], list[ConfigError]]:
    """The folder's .nii/.nii.gz files, each header checked; every other entry and every bad header a problem."""
    volumes: list[NiftiFile] = []
    problems: list[ConfigError] = []
    strangers: list[str] = []
    for entry in scan(folder, setting=setting):
        if not entry.name.endswith((".nii", ".nii.gz")) or not entry.is_file():
            strangers.append(entry.name)
            continue
        try:
            volumes.append(nifti_file(entry.path, entry.name))
        except ValueError as exc:
            problems.append(ConfigError(setting, f"{os.path.join(folder, entry.name)} {exc}"))
    if strangers:
        shown = ", ".join(strangers[:5]) + (f" (and {len(strangers) - 5} more)" if len(strangers) > 5 else "")
        problems.append(ConfigError(setting, f"{folder} holds entries that are not NIfTI volumes (.nii, .nii.gz): "
                                             f"{shown}"))
    return volumes, problems
