"""IDX files (the MNIST format), plain or gzip: the dims in the header are checked before any data is read or
inflated, and a gzip stream is inflated only as far as those dims reach (one byte more, to refuse a tail)."""

from __future__ import annotations

import gzip
import io
import math
import os
import struct
import zlib

import numpy as np

from fedbroker.datasets.dataset import MAX_ARRAY_BYTES, MAX_VALUES, Dataset, check_values
from fedbroker.errors import ConfigError

# IDX type codes (third magic byte) -> big-endian numpy dtype.
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
# (images, labels) file stems; train and test are pooled and split by `train_test_split`.
IDX_FILES = (
    ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
)


def load_idx(path: str) -> np.ndarray:
    """Read an IDX file (the MNIST format: 0x00 0x00, type code, ndim, big-endian uint32 dims, data).

    Gzip is detected from the content, not the file name. A bad magic number, dims beyond the limits
    (`MAX_VALUES`, `MAX_ARRAY_BYTES`), a truncated file, trailing bytes or a non-finite float raise a
    ConfigError naming the file and the place, because a silently short array would misalign images and labels.
    """
    try:
        with open(path, "rb") as fh:
            return _read_file(fh, path)
    except FileNotFoundError:
        raise ConfigError(path, "IDX file not found") from None


def _read_file(fh: io.BufferedIOBase, path: str) -> np.ndarray:
    if fh.read(2) != b"\x1f\x8b":
        fh.seek(0)
        return _read_idx(fh, path, size=os.fstat(fh.fileno()).st_size)
    fh.seek(0)
    try:
        with gzip.GzipFile(fileobj=fh) as stream:
            return _read_idx(stream, path, size=None)
    except (EOFError, OSError, zlib.error) as exc:
        raise ConfigError(path, f"corrupt or truncated gzip data ({exc})") from None


def _read_idx(stream: io.BufferedIOBase, path: str, *, size: int | None) -> np.ndarray:
    """The array behind the header; `size` is the plain file's length, None for a gzip stream (unknown)."""
    head = _read_bytes(stream, 4)
    if len(head) < 4:
        raise ConfigError(path, f"truncated IDX file: {len(head)} bytes, the header alone needs 4")
    if head[0] != 0 or head[1] != 0 or head[2] not in IDX_DTYPES:
        raise ConfigError(
            path,
            f"bad IDX magic number 0x{head.hex()}: expected 0x0000, a type code among "
            f"{', '.join(f'0x{c:02x}' for c in IDX_DTYPES)} and the number of dimensions",
        )
    dtype = np.dtype(IDX_DTYPES[head[2]])
    ndim = head[3]
    header = 4 + 4 * ndim
    raw_dims = _read_bytes(stream, 4 * ndim)
    if len(raw_dims) < 4 * ndim:
        raise ConfigError(path, f"truncated IDX file: header needs {header} bytes, file has {4 + len(raw_dims)}")
    dims = struct.unpack(f">{ndim}I", raw_dims)
    count = math.prod(dims)  # Python ints: four dims of 2**32 must not wrap around to a small product
    expected = header + count * dtype.itemsize
    if count > MAX_VALUES or count * dtype.itemsize > MAX_ARRAY_BYTES:
        raise ConfigError(path, f"header bytes 4..{header} declare dims {dims}: {count} values of {dtype.itemsize} "
                                f"bytes, more than the {MAX_VALUES} values and {MAX_ARRAY_BYTES} bytes a file may hold")
    if size is not None and size < expected:
        raise ConfigError(path, f"truncated IDX file: dims {dims} need {expected} bytes, file has {size}")
    if size is not None and size > expected:
        raise ConfigError(path, f"IDX file has {size - expected} unexpected trailing bytes after dims {dims}")
    data = np.empty(count, dtype=dtype)
    got = _read_into(stream, data.view(np.uint8).data)
    if got < count * dtype.itemsize:
        raise ConfigError(path, f"truncated IDX file: dims {dims} need {expected} bytes, file has {header + got}")
    if size is None and stream.read(1):
        raise ConfigError(path, f"unexpected trailing bytes after byte {expected} of the inflated data "
                                f"(all that dims {dims} need)")
    if not dtype.isnative:  # in place: a copy would double the memory of a file near the limit
        data = data.byteswap(inplace=True).view(dtype.newbyteorder())
    array = data.reshape(dims)
    check_values(array, setting=path, where=lambda at: f"at index {list(at)}")
    return array


def _read_bytes(stream: io.BufferedIOBase, n: int) -> bytes:
    """Up to `n` bytes, fewer only at the end of the stream (a gzip stream returns short reads)."""
    parts, got = [], 0
    while got < n:
        part = stream.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _read_into(stream: io.BufferedIOBase, buffer: memoryview) -> int:
    """Fill `buffer` from the stream; how many bytes it got (fewer only at the end of the stream)."""
    got = 0
    while got < len(buffer):
        n = stream.readinto(buffer[got:])
        if not n:
            break
        got += n
    return got


def expected_names() -> str:
    """The IDX file names a folder must hold, for error messages."""
    return ", ".join(f"{stem}[.gz]" for pair in IDX_FILES for stem in pair)


def _find_idx_file(idx_dir: str, stem: str, setting: str) -> str:
    # Some archives unpack "train-images-idx3-ubyte" as "train-images.idx3-ubyte"; accept both.
    dotted = stem.replace("-idx", ".idx")
    for candidate in (stem, stem + ".gz", dotted, dotted + ".gz"):
        path = os.path.join(idx_dir, candidate)
        if os.path.isfile(path):
            return path
    raise ConfigError(setting, f"missing IDX file {stem}[.gz] in {idx_dir} (needs {expected_names()})")


def _load_named(path: str, setting: str) -> np.ndarray:
    """`load_idx`, its refusal naming the setting that chose the folder (the file stays in the message)."""
    try:
        return load_idx(path)
    except ConfigError as error:
        raise ConfigError(setting, f"{path}: {error.problem}") from None


def load_idx_pairs(name: str, idx_dir: str, *, setting: str, require_all: bool, num_classes: int) -> Dataset:
    """Images (N, H, W) of unsigned bytes and labels (N,) from the standard file names: both pairs for
    mnist/fashion_mnist; for an owner's `idx` set, whichever pairs are there (the train pair alone will do).
    `setting` names the folder's setting in every refusal (`idx_dir`, `worker.idx_dir`)."""
    if not os.path.isdir(idx_dir):
        raise ConfigError(setting, f"{idx_dir} is not a directory")
    xs, ys = [], []
    for image_stem, label_stem in IDX_FILES:
        if not require_all and not _has_idx_file(idx_dir, image_stem) and not _has_idx_file(idx_dir, label_stem):
            continue
        image_path = _find_idx_file(idx_dir, image_stem, setting)
        label_path = _find_idx_file(idx_dir, label_stem, setting)
        images, labels = _load_named(image_path, setting), _load_named(label_path, setting)
        if images.ndim != 3 or labels.ndim != 1:
            raise ConfigError(
                setting, f"{image_path}: expected images (N, H, W) and labels (N,), got {images.shape} and "
                         f"{labels.shape}"
            )
        if images.dtype != np.uint8:
            raise ConfigError(setting, f"{image_path}: expected unsigned-byte pixels (type code 0x08), got "
                                       f"{images.dtype}")
        if len(images) != len(labels):
            raise ConfigError(setting, f"{label_path}: {len(labels)} labels for {len(images)} images in {image_path}")
        xs.append(images)
        ys.append(labels)
    if not xs:
        raise ConfigError(setting, f"no IDX files in {idx_dir} (needs {expected_names()})")
    if any(x.shape[1:] != xs[0].shape[1:] for x in xs):
        raise ConfigError(setting, f"train images are {xs[0].shape[1:]} but test images are {xs[1].shape[1:]}")
    images = np.concatenate(xs)
    y = np.concatenate(ys).astype(np.int64)
    classes = num_classes or (int(y.max()) + 1 if len(y) else 1)
    if len(y) and (y.min() < 0 or y.max() >= classes):
        raise ConfigError(setting, f"{name} labels must lie in 0..{classes - 1}, found {y.min()}..{y.max()}")
    x = (images.astype(np.float32) / np.float32(255.0))[:, None, :, :]
    return Dataset(x=x, y=y, num_classes=classes, name=name)


def _has_idx_file(idx_dir: str, stem: str) -> bool:
    try:
        _find_idx_file(idx_dir, stem, "idx_dir")
    except ConfigError:
        return False
    return True
