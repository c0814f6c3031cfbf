"""A worker's local data: scikit-learn's bundled sets or MNIST-style IDX files, never a download.

Every worker must turn the same raw data into the same arrays (a federation of workers holding
differently scaled features would average nonsense), so the scaling here is fixed per data set and
uses statistics of the *whole bundled set*, not of a worker's share.
"""

from __future__ import annotations

import gzip
import os
import zlib
from dataclasses import dataclass

import numpy as np

from fedbroker.errors import ConfigError

DATASETS = ("digits", "breast_cancer", "wine", "iris", "mnist", "fashion_mnist")

_TABULAR = ("breast_cancer", "wine", "iris")
_IDX_SETS = ("mnist", "fashion_mnist")
# IDX type codes (third magic byte) -> big-endian numpy dtype.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
# (images, labels) file stems; train and test are pooled and split by `train_test_split`.
_IDX_FILES = (
    ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
)


@dataclass(frozen=True)
class Dataset:
    """Features and labels: x float32 (N, C, H, W) for images or (N, F) for tables, y int64 in 0..K-1."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        if self.x.dtype != np.float32:
            raise ConfigError("x", f"must be float32, got {self.x.dtype}")
        if self.y.dtype != np.int64 or self.y.ndim != 1:
            raise ConfigError("y", f"must be a 1-D int64 array, got {self.y.dtype} with shape {self.y.shape}")
        if len(self.x) != len(self.y):
            raise ConfigError("y", f"has {len(self.y)} labels for {len(self.x)} samples")
        if len(self.y) and (self.y.min() < 0 or self.y.max() >= self.num_classes):
            raise ConfigError("y", f"labels must lie in 0..{self.num_classes - 1}")

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample, as a model spec needs it."""
        return tuple(int(d) for d in self.x.shape[1:])

    def __len__(self) -> int:
        return len(self.y)


def load_dataset(name: str, *, idx_dir: str | None = None) -> Dataset:
    """Load a known data set; `idx_dir` is required for mnist/fashion_mnist (the standard IDX files)."""
    if name not in DATASETS:
        raise ConfigError("dataset", f"unknown data set {name!r}; known: {', '.join(DATASETS)}")
    if name in _IDX_SETS:
        if idx_dir is None:
            raise ConfigError("idx_dir", f"{name} needs a directory holding the IDX files {_expected_names()}")
        return _load_idx_set(name, idx_dir)

    from sklearn import datasets as skd  # imported lazily: only the bundled sets need it

    if name == "digits":
        bunch = skd.load_digits()
        x = (bunch.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
        return Dataset(x=x, y=bunch.target.astype(np.int64), num_classes=10, name=name)
    loader = {"breast_cancer": skd.load_breast_cancer, "wine": skd.load_wine, "iris": skd.load_iris}[name]
    bunch = loader()
    data = bunch.data.astype(np.float64)
    std = data.std(axis=0)
    std[std == 0] = 1.0  # a constant feature stays 0 instead of becoming NaN
    x = ((data - data.mean(axis=0)) / std).astype(np.float32)
    y = bunch.target.astype(np.int64)
    return Dataset(x=x, y=y, num_classes=int(y.max()) + 1, name=name)


def train_test_split(ds: Dataset, *, test_fraction: float = 0.2, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Stratified, deterministic split: each class contributes round(test_fraction·n_c) test samples.

    Implemented with numpy's PCG64 rather than scikit-learn so the split depends only on the seed,
    not on a library version; both halves keep the original sample order.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError("test_fraction", f"must lie strictly between 0 and 1, got {test_fraction}")
    rng = np.random.default_rng(seed)
    test_parts = []
    for c in range(ds.num_classes):
        members = np.flatnonzero(ds.y == c)
        n_test = round(test_fraction * len(members))
        test_parts.append(rng.permutation(members)[:n_test])
    test_idx = np.sort(np.concatenate(test_parts)) if test_parts else np.zeros(0, dtype=np.int64)
    is_test = np.zeros(len(ds), dtype=bool)
    is_test[test_idx] = True
    train_idx = np.flatnonzero(~is_test)
    return _subset(ds, train_idx), _subset(ds, test_idx)


def load_idx(path: str) -> np.ndarray:
    """Read an IDX file (the MNIST format: 0x00 0x00, type code, ndim, big-endian uint32 dims, data).

    Gzip is detected from the content, not the file name. A bad magic number, a truncated file or
    trailing bytes raise a ConfigError naming the file, because a silently short array would
    misalign images and labels.
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise ConfigError(path, "IDX file not found") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as exc:
            raise ConfigError(path, f"corrupt or truncated gzip data ({exc})") from None
    if len(raw) < 4:
        raise ConfigError(path, f"truncated IDX file: {len(raw)} bytes, the header alone needs 4")
    if raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ConfigError(
            path,
            f"bad IDX magic number 0x{raw[:4].hex()}: expected 0x0000, a type code among "
            f"{', '.join(f'0x{c:02x}' for c in _IDX_DTYPES)} and the number of dimensions",
        )
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ConfigError(path, f"truncated IDX file: header needs {header} bytes, file has {len(raw)}")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) < expected:
        raise ConfigError(
            path, f"truncated IDX file: dims {dims} need {expected} bytes, file has {len(raw)}"
        )
    if len(raw) > expected:
        raise ConfigError(path, f"IDX file has {len(raw) - expected} unexpected trailing bytes after dims {dims}")
    data = np.frombuffer(raw, dtype=dtype, offset=header, count=int(np.prod(dims, dtype=np.int64)))
    return data.astype(dtype.newbyteorder("="), copy=True).reshape(dims)


def _subset(ds: Dataset, idx: np.ndarray) -> Dataset:
    return Dataset(x=ds.x[idx], y=ds.y[idx], num_classes=ds.num_classes, name=ds.name)


def _expected_names() -> str:
    return ", ".join(f"{stem}[.gz]" for pair in _IDX_FILES for stem in pair)


def _find_idx_file(idx_dir: str, stem: str) -> str:
    # Some archives unpack "train-images-idx3-ubyte" as "train-images.idx3-ubyte"; accept both.
    dotted = stem.replace("-idx", ".idx")
    for candidate in (stem, stem + ".gz", dotted, dotted + ".gz"):
        path = os.path.join(idx_dir, candidate)
        if os.path.isfile(path):
            return path
    raise ConfigError("idx_dir", f"missing IDX file {stem}[.gz] in {idx_dir} (needs {_expected_names()})")


def _load_idx_set(name: str, idx_dir: str) -> Dataset:
    if not os.path.isdir(idx_dir):
        raise ConfigError("idx_dir", f"{idx_dir} is not a directory")
    xs, ys = [], []
    for image_stem, label_stem in _IDX_FILES:
        image_path = _find_idx_file(idx_dir, image_stem)
        label_path = _find_idx_file(idx_dir, label_stem)
        images, labels = load_idx(image_path), load_idx(label_path)
        if images.ndim != 3 or labels.ndim != 1:
            raise ConfigError(
                image_path, f"expected images (N, H, W) and labels (N,), got {images.shape} and {labels.shape}"
            )
        if images.dtype != np.uint8:
            raise ConfigError(image_path, f"expected unsigned-byte pixels (type code 0x08), got {images.dtype}")
        if len(images) != len(labels):
            raise ConfigError(label_path, f"{len(labels)} labels for {len(images)} images in {image_path}")
        xs.append(images)
        ys.append(labels)
    if xs[0].shape[1:] != xs[1].shape[1:]:
        raise ConfigError("idx_dir", f"train images are {xs[0].shape[1:]} but test images are {xs[1].shape[1:]}")
    images = np.concatenate(xs)
    y = np.concatenate(ys).astype(np.int64)
    if len(y) and (y.min() < 0 or y.max() > 9):
        raise ConfigError("idx_dir", f"{name} labels must lie in 0..9, found {y.min()}..{y.max()}")
    x = (images.astype(np.float32) / np.float32(255.0))[:, None, :, :]
    return Dataset(x=x, y=y, num_classes=10, name=name)
