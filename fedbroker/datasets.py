"""The data-set readers: scikit-learn's bundled sets, IDX files, or a data owner's own CSV, .npz or Parquet
file; never a download. In the kernel because three services read the same sets: a worker trains on its
share, the coordinator evaluates on the held-out split, the aggregation service draws its probes from it.

Every worker must turn the same raw data into the same arrays (a federation of workers holding
differently scaled features would average nonsense), so the scaling of the bundled sets is fixed per data
set and uses statistics of the *whole bundled set*, not of a worker's share. An owner's own file is
scaled as the owner declares (`worker.data.standardize`: its own mean and std, computed here, on the
worker); owners whose features differ in scale should agree on it, or standardise beforehand.
"""

from __future__ import annotations

import collections
import csv
import gzip
import math
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedbroker.config import DataSection, WorkerConfig
from fedbroker.errors import ConfigError
from fedbroker.spec import MAX_WIDTH

DATASETS = ("digits", "breast_cancer", "wine", "iris", "mnist", "fashion_mnist")
OWN_FORMATS = ("idx", "csv", "npz", "parquet")   # an owner's own files (worker.idx_dir, worker.data)
MAX_CLASSES = MAX_WIDTH                          # the coordinator accepts no more classes in a registration

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


def load_worker_data(config: WorkerConfig) -> Dataset:
    """The data a worker trains on: a bundled set by name, or the owner's own files (`OWN_FORMATS`)."""
    name = config.dataset
    if name in DATASETS:
        return load_dataset(name, idx_dir=config.idx_dir or None)
    if name == "idx":
        if not config.idx_dir:
            raise ConfigError("worker.idx_dir", "dataset idx needs the folder of the IDX files (worker.idx_dir)")
        return _load_idx_pairs("idx", config.idx_dir, require_all=False, num_classes=config.data.num_classes)
    if name in ("csv", "npz", "parquet"):
        source = config.data
        if not source.path:
            raise ConfigError("worker.data.path", f"dataset {name} needs the file to read (worker.data.path)")
        if not os.path.isfile(source.path):
            raise ConfigError("worker.data.path", f"{source.path} is not a file")
        return {"csv": _load_csv, "npz": _load_npz, "parquet": _load_parquet}[name](source)
    raise ConfigError("worker.dataset", f"unknown data set {name!r}; known: {', '.join(DATASETS + OWN_FORMATS)}")


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
    return _load_idx_pairs(name, idx_dir, require_all=True, num_classes=10)


def _load_idx_pairs(name: str, idx_dir: str, *, require_all: bool, num_classes: int) -> Dataset:
    """Images (N, H, W) of unsigned bytes and labels (N,) from the standard file names: both pairs for
    mnist/fashion_mnist; for an owner's `idx` set, whichever pairs are there (the train pair alone will do)."""
    if not os.path.isdir(idx_dir):
        raise ConfigError("idx_dir", f"{idx_dir} is not a directory")
    xs, ys = [], []
    for image_stem, label_stem in _IDX_FILES:
        if not require_all and not _has_idx_file(idx_dir, image_stem) and not _has_idx_file(idx_dir, label_stem):
            continue
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
    if not xs:
        raise ConfigError("idx_dir", f"no IDX files in {idx_dir} (needs {_expected_names()})")
    if any(x.shape[1:] != xs[0].shape[1:] for x in xs):
        raise ConfigError("idx_dir", f"train images are {xs[0].shape[1:]} but test images are {xs[1].shape[1:]}")
    images = np.concatenate(xs)
    y = np.concatenate(ys).astype(np.int64)
    classes = num_classes or (int(y.max()) + 1 if len(y) else 1)
    if len(y) and (y.min() < 0 or y.max() >= classes):
        raise ConfigError("idx_dir", f"{name} labels must lie in 0..{classes - 1}, found {y.min()}..{y.max()}")
    x = (images.astype(np.float32) / np.float32(255.0))[:, None, :, :]
    return Dataset(x=x, y=y, num_classes=classes, name=name)


def _has_idx_file(idx_dir: str, stem: str) -> bool:
    try:
        _find_idx_file(idx_dir, stem)
    except ConfigError:
        return False
    return True


# ----- an owner's own table or arrays -----


def _load_csv(source: DataSection) -> Dataset:
    with open(source.path, newline="", encoding="utf-8-sig") as fh:
        rows = list(csv.reader(fh))
    if not rows:
        raise ConfigError("worker.data.path", f"{source.path} is empty: it needs a header row naming the columns")
    header = [name.strip() for name in rows[0]]
    features, label = _columns(header, source, where=source.path)
    body = [(line, row) for line, row in enumerate(rows[1:], start=2) if any(cell.strip() for cell in row)]
    x = np.empty((len(body), len(features)), dtype=np.float64)
    columns = [(j, header.index(column), column) for j, column in enumerate(features)]
    at_label = header.index(label)
    raw_labels = []
    for i, (line, row) in enumerate(body):
        if len(row) != len(header):
            raise ConfigError("worker.data.path", f"{source.path} line {line}: {len(row)} fields, the header has "
                                                  f"{len(header)}")
        for j, at, column in columns:
            x[i, j] = _number(row[at], f"{source.path} line {line}, column {column!r}")
        raw_labels.append(row[at_label].strip())
    return _own_dataset(x, raw_labels, source, name="csv")


def _load_parquet(source: DataSection) -> Dataset:
    import pyarrow as pa  # imported lazily: only a Parquet owner needs it
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(source.path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError("worker.data.path", f"{source.path} is not a readable Parquet file: {exc}") from None
    features, label = _columns(list(schema.names), source, where=source.path)
    table = pq.read_table(source.path, columns=[*features, label])
    columns = []
    for name in features:
        column = table.column(name)
        kind = column.type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
            raise ConfigError("worker.data.feature_columns", f"{source.path} column {name!r} holds {kind}, not numbers")
        if column.null_count:
            raise ConfigError("worker.data.path", f"{source.path} column {name!r} has {column.null_count} missing values")
        columns.append(column.to_numpy().astype(np.float64))
    labels = table.column(label)
    if labels.null_count:
        raise ConfigError("worker.data.label_column", f"{source.path} column {label!r} has {labels.null_count} "
                                                      f"missing labels")
    x = np.stack(columns, axis=1) if columns else np.zeros((len(table), 0))
    return _own_dataset(x, [str(v) for v in labels.to_pylist()], source, name="parquet")


def _load_npz(source: DataSection) -> Dataset:
    try:
        archive = np.load(source.path, allow_pickle=False)  # object arrays would need pickle: refused
    except (OSError, ValueError) as exc:
        raise ConfigError("worker.data.path", f"{source.path} is not a readable .npz file: {exc}") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):  # a lone .npy array: no names to find x and y by
        raise ConfigError("worker.data.path", f"{source.path} is a single .npy array, not an .npz archive of named "
                                              f"arrays (np.savez(path, x=..., y=...))")
    with archive:
        for setting, key in (("features_key", source.features_key), ("labels_key", source.labels_key)):
            if key not in archive.files:
                raise ConfigError(f"worker.data.{setting}", f"{source.path} holds no array {key!r}; it holds "
                                                            f"{', '.join(archive.files) or 'none'}")
        try:
            x, labels = archive[source.features_key], archive[source.labels_key]
        except ValueError as exc:  # an object array: it would need pickle
            raise ConfigError("worker.data.path", f"{source.path}: {exc}") from None
    if x.dtype.kind not in "biuf" or x.ndim < 2:
        raise ConfigError("worker.data.features_key", f"{source.features_key!r} must be numbers shaped (N, ...), got "
                                                      f"{x.dtype} {list(x.shape)}")
    if labels.ndim != 1 or len(labels) != len(x):
        raise ConfigError("worker.data.labels_key", f"{source.labels_key!r} must be one label per sample ({len(x)}), "
                                                    f"got shape {list(labels.shape)}")
    if labels.dtype.kind not in "biufU":
        raise ConfigError("worker.data.labels_key", f"{source.labels_key!r} must hold numbers or text, got {labels.dtype}")
    if not np.isfinite(x).all():
        raise ConfigError("worker.data.path", f"{source.path}: {source.features_key!r} holds NaN or infinite values")
    return _own_dataset(x.astype(np.float64), [str(v) for v in labels.tolist()], source, name="npz")


def _columns(header: Sequence[str], source: DataSection, *, where: str) -> tuple[list[str], str]:
    """The feature columns (in the declared order) and the label column, each checked against the header."""
    repeated = sorted(c for c, n in collections.Counter(header).items() if n > 1)
    if repeated:
        raise ConfigError("worker.data.path", f"{where} names the columns {', '.join(map(repr, repeated))} more "
                                              f"than once: which one is meant is ambiguous")
    if source.label_column not in header:
        raise ConfigError("worker.data.label_column", f"{where} has no column {source.label_column!r}; its columns: "
                                                      f"{', '.join(header)}")
    features = list(source.feature_columns) or [c for c in header if c != source.label_column]
    missing = [c for c in features if c not in header]
    if missing:
        raise ConfigError("worker.data.feature_columns", f"{where} has no column {', '.join(map(repr, missing))}; "
                                                         f"its columns: {', '.join(header)}")
    if source.label_column in features:
        raise ConfigError("worker.data.feature_columns", f"lists the label column {source.label_column!r}")
    if not features:
        raise ConfigError("worker.data.feature_columns", f"{where} has no feature column besides the label")
    return features, source.label_column


def _number(cell: str, where: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        raise ConfigError("worker.data.path", f"{where}: {cell!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError("worker.data.path", f"{where}: {cell!r} is not a finite number")
    return value


def _class_index(label: str, where: str) -> int:
    try:
        value = float(label)
    except ValueError:
        value = -1.0
    if not (value.is_integer() and value >= 0):
        raise ConfigError("worker.data.classes", f"{where}: label {label!r} is not a class index 0..K-1; list the "
                                                 f"label values in worker.data.classes")
    return int(value)


def _own_dataset(x: np.ndarray, raw_labels: list[str], source: DataSection, *, name: str) -> Dataset:
    """Class indices from the labels as declared, and (if asked) this worker's own standardisation."""
    if not raw_labels:
        raise ConfigError("worker.data.path", f"{source.path} holds no samples")
    if source.classes:
        index = {c: i for i, c in enumerate(source.classes)}
        unknown = sorted({v for v in raw_labels if v not in index})
        if unknown:
            raise ConfigError("worker.data.classes", f"{source.path} has labels {unknown[:5]} that are not among the "
                                                     f"declared classes {list(source.classes)}")
        y = np.array([index[v] for v in raw_labels], dtype=np.int64)
        num_classes = len(source.classes)
    else:
        y = np.array([_class_index(v, source.path) for v in raw_labels], dtype=np.int64)
        num_classes = source.num_classes or int(y.max()) + 1
    if source.num_classes and source.num_classes != num_classes:
        raise ConfigError("worker.data.num_classes", f"is {source.num_classes} but worker.data.classes lists "
                                                     f"{num_classes}")
    if not 1 <= num_classes <= MAX_CLASSES:
        raise ConfigError("worker.data.num_classes", f"must lie in [1, {MAX_CLASSES}], got {num_classes}")
    if y.max() >= num_classes:
        raise ConfigError("worker.data.num_classes", f"is {num_classes} but the labels reach {int(y.max())} (class "
                                                     f"indices are 0..num_classes-1)")
    sample = x.shape[1:]
    if not 1 <= len(sample) <= 3 or not all(1 <= d <= MAX_WIDTH for d in sample):
        raise ConfigError("worker.data.path", f"{source.path}: one sample's shape {list(sample)} cannot be a model's "
                                              f"input (1 to 3 sizes, each in [1, {MAX_WIDTH}])")
    if source.standardize:
        mean = x.mean(axis=0)
        std = x.std(axis=0)
        std[std == 0] = 1.0  # a constant feature stays 0 instead of becoming NaN
        x = (x - mean) / std
    return Dataset(x=np.ascontiguousarray(x, dtype=np.float32), y=y, num_classes=num_classes, name=name)
