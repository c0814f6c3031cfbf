"""An owner's own arrays, an .npz archive (np.savez or np.savez_compressed): each member's size is checked
twice before it is inflated, as the zip directory declares it and as the .npy header inside declares it
(shape and dtype), and the two must agree; then the data is read in bounded chunks, never unpickled."""

from __future__ import annotations

import math
import os
import zipfile
import zlib
from typing import IO

import numpy as np

from fedbroker.config import DataSection
from fedbroker.datasets.dataset import MAX_ARRAY_BYTES, MAX_VALUES, Dataset, listing
from fedbroker.datasets.owned import own_dataset, task_dataset
from fedbroker.errors import ConfigError

_NPY_HEADER_MAX = 10_000 + 12       # numpy's own limit on an .npy header, plus its magic and length fields
_DEFLATE_MAX_RATIO = 1032           # deflate inflates at most ~1032 bytes from one: a larger claim is a lie
_READ_ERRORS = (ValueError, OSError, EOFError, zlib.error, zipfile.BadZipFile)  # a broken member, in any way


def load_npz(source: DataSection) -> Dataset:
    """The arrays named by features_key (N, ...) and labels_key (N,), checked from their headers before reading."""
    path = source.path
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise _not_an_archive(path, exc) from None
    with archive:
        members = {(i.filename[:-4] if i.filename.endswith(".npy") else i.filename): i for i in archive.infolist()}
        for setting, key in (("features_key", source.features_key), ("labels_key", source.labels_key)):
            if key not in members:
                raise ConfigError(f"worker.data.{setting}", f"{path} holds no array {key!r}; it holds "
                                                            f"{listing(list(members)) or 'none'}")
        archive_bytes = os.path.getsize(path)
        x_info, y_info = members[source.features_key], members[source.labels_key]
        x_shape, x_dtype = _header(archive, x_info, path, archive_bytes)
        y_shape, y_dtype = _header(archive, y_info, path, archive_bytes)
        _check_shapes(source, x_shape, x_dtype, y_shape, y_dtype)
        x, labels = _read(archive, x_info, path), _read(archive, y_info, path)
    key, label_key = source.features_key, source.labels_key
    if source.labels != "class":
        return task_dataset(x.astype(np.float64, copy=False), labels, source, name="npz",
                            where=lambda at: f"{path}: {key!r}{list(at)}",
                            label_where=lambda at: f"{path}: {label_key!r}{list(at)}")
    return own_dataset(x.astype(np.float64, copy=False), [str(v) for v in labels.tolist()], source, name="npz",
                       where=lambda at: f"{path}: {key!r}{list(at)}")


def _not_an_archive(path: str, exc: Exception) -> ConfigError:
    """Why the file is no .npz: a lone .npy array has no names to find x and y by; anything else is unreadable."""
    try:
        with open(path, "rb") as fh:
            lone = fh.read(6) == b"\x93NUMPY"
    except OSError:
        lone = False
    if lone:
        return ConfigError("worker.data.path", f"{path} is a single .npy array, not an .npz archive of named "
                                               f"arrays (np.savez(path, x=..., y=...))")
    return ConfigError("worker.data.path", f"{path} is not a readable .npz file: {exc}")


def _header(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: str,
            archive_bytes: int) -> tuple[tuple[int, ...], np.dtype[np.generic]]:
    """A member's shape and dtype from its .npy header, after the zip directory's claims are found sane."""
    place = f"{path} member {info.filename!r}"
    if info.file_size > MAX_ARRAY_BYTES + _NPY_HEADER_MAX:
        raise ConfigError("worker.data.path", f"{place}: the zip directory declares {info.file_size} bytes, more "
                                              f"than the {MAX_ARRAY_BYTES} an array may hold")
    if info.compress_size > archive_bytes:
        raise ConfigError("worker.data.path", f"{place}: the zip directory declares {info.compress_size} "
                                              f"compressed bytes, the whole file has {archive_bytes}")
    if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
        raise ConfigError("worker.data.path", f"{place} is stored uncompressed but declares {info.compress_size} "
                                              f"bytes stored for {info.file_size}")
    if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > _DEFLATE_MAX_RATIO * info.compress_size + 64:
        raise ConfigError("worker.data.path", f"{place} declares {info.file_size} bytes inflated from "
                                              f"{info.compress_size}: more than deflate can produce")
    try:
        with archive.open(info) as member:
            version = np.lib.format.read_magic(member)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f".npy format version {version} (np.savez writes 1.0 or 2.0)")
            read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                           else np.lib.format.read_array_header_2_0)
            shape, _fortran, dtype = read_header(member)
            offset = member.tell()
    except _READ_ERRORS as exc:
        raise ConfigError("worker.data.path", f"{place} has no readable .npy header: {exc}") from None
    if dtype.hasobject:
        raise ConfigError("worker.data.path", f"{place} holds Python objects ({dtype}): reading them would need "
                                              f"pickle, which is refused")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes > MAX_ARRAY_BYTES:
        raise ConfigError("worker.data.path", f"{place}: its .npy header declares shape {list(shape)} of {dtype}, "
                                              f"{nbytes} bytes, more than the {MAX_ARRAY_BYTES} an array may hold")
    if offset + nbytes != info.file_size:
        raise ConfigError("worker.data.path", f"{place}: its .npy header declares {nbytes} bytes of data after "
                                              f"byte {offset}, but the zip directory declares {info.file_size} bytes")
    return tuple(int(d) for d in shape), dtype


def _check_shapes(source: DataSection, x_shape: tuple[int, ...], x_dtype: np.dtype[np.generic],
                  y_shape: tuple[int, ...], y_dtype: np.dtype[np.generic]) -> None:
    """The features and labels must make a data set, judged from the headers alone."""
    fk, lk = source.features_key, source.labels_key
    if x_dtype.kind not in "biuf" or len(x_shape) < 2:
        raise ConfigError("worker.data.features_key", f"{fk!r} must be numbers shaped (N, ...), got {x_dtype} "
                                                      f"{list(x_shape)}")
    if math.prod(x_shape) > MAX_VALUES:
        raise ConfigError("worker.data.features_key", f"{fk!r} has shape {list(x_shape)}: more than the "
                                                      f"{MAX_VALUES} values a file may hold")
    if source.labels != "class":  # their shape is checked with the values (fedbroker.datasets.labels)
        if not y_shape or y_shape[0] != x_shape[0] or math.prod(y_shape) > MAX_VALUES:
            raise ConfigError("worker.data.labels_key", f"{lk!r} must hold the labels of the {x_shape[0]} samples, "
                                                        f"got shape {list(y_shape)}")
    elif len(y_shape) != 1 or y_shape[0] != x_shape[0]:
        raise ConfigError("worker.data.labels_key", f"{lk!r} must be one label per sample ({x_shape[0]}), got "
                                                    f"shape {list(y_shape)}")
    if y_dtype.kind not in "biufU":
        raise ConfigError("worker.data.labels_key", f"{lk!r} must hold numbers or text, got {y_dtype}")


def _read(archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: str) -> np.ndarray:
    """The member's array, read in chunks (numpy's own reader): exactly the bytes its header declared."""
    try:
        with archive.open(info) as member:
            stream: IO[bytes] = member
            return np.lib.format.read_array(stream, allow_pickle=False)
    except _READ_ERRORS as exc:
        raise ConfigError("worker.data.path", f"{path} member {info.filename!r} is corrupt or truncated: "
                                              f"{exc}") from None
