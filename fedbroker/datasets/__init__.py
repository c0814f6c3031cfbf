"""The data-set readers: scikit-learn's bundled sets, IDX files, or a data owner's own CSV, .npz or Parquet
file; never a download. In the kernel because three services read the same sets: a worker trains on its
share, the coordinator evaluates on the held-out split, the aggregation service draws its probes from it.

Every worker must turn the same raw data into the same arrays (a federation of workers holding
differently scaled features would average nonsense), so the scaling of the bundled sets is fixed per data
set and uses statistics of the *whole bundled set*, not of a worker's share. An owner's own file is
scaled as the owner declares (`worker.data.standardize`): `site`, with its own mean and std computed here;
`federated` and `none`, not at all here (federated: the model's first layer standardises with statistics
the sites agreed on, so every site and the downloaded model scale alike).

An owner's file is refused at the door, before the worker registers or spends ε, with a ConfigError naming
the setting and the place in the file: see `fedbroker.datasets.dataset` for the limits every reader enforces
before it inflates or parses what a file declares. One module per format: `idx`, `tables` (CSV, Parquet),
`npz`, `images` (a folder of PNG/JPEG files and a labels CSV, read a batch at a time), `volumes` (NIfTI files
and DICOM series, a package); `owned` holds what the owner's formats share.
"""

from __future__ import annotations

import os

import numpy as np

from fedbroker.config import WorkerConfig
from fedbroker.datasets.dataset import Dataset
from fedbroker.datasets.idx import expected_names, load_idx, load_idx_pairs
from fedbroker.datasets.npz import load_npz
from fedbroker.datasets.tables import load_csv, load_parquet
from fedbroker.errors import ConfigError

DATASETS = ("digits", "breast_cancer", "wine", "iris", "mnist", "fashion_mnist")
OWN_FORMATS = ("idx", "csv", "npz", "parquet", "images", "nifti", "dicom")   # an owner's own files (worker.data)

_IDX_SETS = ("mnist", "fashion_mnist")

__all__ = ["DATASETS", "OWN_FORMATS", "Dataset", "load_dataset", "load_idx", "load_worker_data",
           "strata", "train_test_split"]


def load_dataset(name: str, *, idx_dir: str | None = None) -> Dataset:
    """Load a known data set; `idx_dir` is required for mnist/fashion_mnist (the standard IDX files)."""
    if name not in DATASETS:
        raise ConfigError("dataset", f"unknown data set {name!r}; known: {', '.join(DATASETS)}")
    if name in _IDX_SETS:
        if idx_dir is None:
            raise ConfigError("idx_dir", f"{name} needs a directory holding the IDX files {expected_names()}")
        return load_idx_pairs(name, idx_dir, setting="idx_dir", require_all=True, num_classes=10)

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
        return load_idx_pairs("idx", config.idx_dir, setting="worker.idx_dir", require_all=False,
                              num_classes=config.data.num_classes)
    if name == "images":  # a folder of PNG/JPEG files, read a batch at a time (fedbroker.datasets.images)
        from fedbroker.datasets.images import load_images

        return load_images(config.data)
    if name in ("nifti", "dicom"):  # folders of volumes, read a batch at a time (fedbroker.datasets.volumes)
        from fedbroker.datasets.volumes import load_volumes

        return load_volumes(config.data, name)
    if name in ("csv", "npz", "parquet"):
        source = config.data
        if not source.path:
            raise ConfigError("worker.data.path", f"dataset {name} needs the file to read (worker.data.path)")
        if not os.path.isfile(source.path):
            raise ConfigError("worker.data.path", f"{source.path} is not a file")
        return {"csv": load_csv, "npz": load_npz, "parquet": load_parquet}[name](source)
    raise ConfigError("worker.dataset", f"unknown data set {name!r}; known: {', '.join(DATASETS + OWN_FORMATS)}")


def train_test_split(ds: Dataset, *, test_fraction: float = 0.2, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Stratified, deterministic split: each class contributes round(test_fraction·n_c) test samples.

    Implemented with numpy's PCG64 rather than scikit-learn so the split depends only on the seed,
    not on a library version; both halves keep the original sample order. Samples cut from one volume (slices:
    `ds.x.groups`) are split by volume, round(test_fraction·volumes) held out whole, unstratified: a patient's
    slices on both sides would score the model on what it trained on.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError("test_fraction", f"must lie strictly between 0 and 1, got {test_fraction}")
    rng = np.random.default_rng(seed)
    groups = getattr(ds.x, "groups", None)  # slices of volumes: a volume's slices all on one side, never both
    if groups is not None:
        held = rng.permutation(np.unique(groups))[:round(test_fraction * len(np.unique(groups)))]
        is_held = np.isin(groups, held)
        return _subset(ds, np.flatnonzero(~is_held)), _subset(ds, np.flatnonzero(is_held))
    if ds.labels != "class":  # no classes to stratify by: a plain random split of round(test_fraction·N)
        test_idx = np.sort(rng.permutation(len(ds))[:round(test_fraction * len(ds))])
        keep = np.ones(len(ds), dtype=bool)
        keep[test_idx] = False
        return _subset(ds, np.flatnonzero(keep)), _subset(ds, test_idx)
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


def strata(ds: Dataset) -> np.ndarray:
    """The classes a split or a partition draws by: the labels, or, for labels that are not classes (multilabel
    rows, targets, masks), one class for every sample."""
    return ds.y if ds.labels == "class" else np.zeros(len(ds), dtype=np.int64)


def _subset(ds: Dataset, idx: np.ndarray) -> Dataset:
    return Dataset(x=ds.x[idx], y=ds.y[idx], num_classes=ds.num_classes, name=ds.name, labels=ds.labels)
