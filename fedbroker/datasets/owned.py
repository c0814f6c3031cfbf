"""What every reader of an owner's own file shares: the columns it names, the labels it declares, the values it
must hold (finite, within float32) and the owner's own standardisation."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence

import numpy as np

from fedbroker.config import DataSection
from fedbroker.datasets.dataset import MAX_COLUMNS, Dataset, check_values, listing
from fedbroker.errors import ConfigError
from fedbroker.job.spec import MAX_WIDTH

MAX_CLASSES = MAX_WIDTH  # the coordinator accepts no more classes in a registration


def columns(header: Sequence[str], source: DataSection, *, where: str) -> tuple[list[str], str]:
    """The feature columns (in the declared order) and the label column, each checked against the header.

    Checked in time linear in the header, before a single row is read: a header of a million columns must be
    refused at once, not after minutes of `in list` lookups.
    """
    if len(header) > MAX_COLUMNS:
        raise ConfigError("worker.data.path", f"{where}: the header names {len(header)} columns, more than the "
                                              f"{MAX_COLUMNS} a table may have")
    names = collections.Counter(header)
    repeated = sorted(c for c, n in names.items() if n > 1)
    if repeated:
        raise ConfigError("worker.data.path", f"{where} names the columns {listing([repr(c) for c in repeated])} "
                                              f"more than once: which one is meant is ambiguous")
    label = source.label_column
    if label not in names:
        raise ConfigError("worker.data.label_column", f"{where} has no column {label!r}; its columns: "
                                                      f"{listing(list(header))}")
    declared = bool(source.feature_columns)
    features = list(source.feature_columns) or [c for c in header if c != label]
    missing = [c for c in features if c not in names]
    if missing:
        raise ConfigError("worker.data.feature_columns", f"{where} has no column {listing([repr(c) for c in missing])}"
                                                         f"; its columns: {listing(list(header))}")
    if label in features:
        raise ConfigError("worker.data.feature_columns", f"lists the label column {label!r}")
    if not features:
        raise ConfigError("worker.data.feature_columns", f"{where} has no feature column besides the label")
    if len(features) > MAX_WIDTH:
        setting, hint = (("worker.data.feature_columns", "") if declared else
                         ("worker.data.path", "; list the ones to use in worker.data.feature_columns"))
        raise ConfigError(setting, f"{where}: {len(features)} feature columns, more than the {MAX_WIDTH} a model's "
                                   f"input can take{hint}")
    return features, label


def label_columns(header: Sequence[str], source: DataSection, *, where: str) -> tuple[list[str], list[str]]:
    """(feature columns, label columns) of a table whose labels are not class indices (`worker.data.labels`
    multilabel or target): `label_columns`, or the one `label_column`; the features are the rest unless listed."""
    names = set(header)
    labels = list(source.label_columns) or [source.label_column]
    missing = [c for c in labels if c not in names]
    if missing:
        raise ConfigError("worker.data.label_columns", f"{where} has no column {listing([repr(c) for c in missing])}; "
                                                       f"its columns: {listing(list(header))}")
    features = list(source.feature_columns) or [c for c in header if c not in labels]
    problems = [c for c in features if c in labels]
    if problems:
        raise ConfigError("worker.data.feature_columns", f"lists label columns {listing(problems)}")
    if not features:
        raise ConfigError("worker.data.feature_columns", f"{where} has no feature column besides the labels")
    if len(features) > MAX_WIDTH:
        raise ConfigError("worker.data.feature_columns", f"{where}: {len(features)} feature columns, more than the "
                                                         f"{MAX_WIDTH} a model's input can take")
    return features, labels


def task_dataset(x: np.ndarray, y: np.ndarray, source: DataSection, *, name: str,
                 where: Callable[[tuple[int, ...]], str], label_where: Callable[[tuple[int, ...]], str]) -> Dataset:
    """A data set whose labels are not class indices (`fedbroker.datasets.labels`): labels checked, then the
    features as `own_dataset` checks them."""
    from fedbroker.datasets.labels import task_labels, width

    if not len(x):
        raise ConfigError("worker.data.path", f"{source.path} holds no samples")
    classes = source.num_classes
    if source.labels == "mask" and not 2 <= classes <= MAX_CLASSES:
        raise ConfigError("worker.data.num_classes", f"is required with labels mask: the classes of a mask, in "
                                                     f"[2, {MAX_CLASSES}] (background included), got {classes}")
    labels = task_labels(source.labels, y, tuple(x.shape), num_classes=classes, where=label_where)
    return Dataset(x=own_features(x, source, where=where), y=labels, num_classes=classes if source.labels == "mask" else
                   width(source.labels, labels), name=name, labels=source.labels)


def number(cell: str, where: str) -> float:
    """One CSV cell as a finite float, or a refusal quoting the cell as written."""
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


def class_indices(raw_labels: list[str], source: DataSection) -> tuple[np.ndarray, int]:
    """Class indices of the labels as declared (`classes` names them in class order, else they are 0..K-1) and
    the number of classes, checked against `num_classes`."""
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
    return y, num_classes


def own_dataset(x: np.ndarray, raw_labels: list[str], source: DataSection, *, name: str,
                where: Callable[[tuple[int, ...]], str]) -> Dataset:
    """Class indices from the labels as declared (`class_indices`), and (if asked) this worker's own
    standardisation.

    `where(index)` names the place in the file of x[index], for the refusal of a value no model can train on.
    """
    if not raw_labels:
        raise ConfigError("worker.data.path", f"{source.path} holds no samples")
    y, num_classes = class_indices(raw_labels, source)
    return Dataset(x=own_features(x, source, where=where), y=y, num_classes=num_classes, name=name)


def own_features(x: np.ndarray, source: DataSection, *, where: Callable[[tuple[int, ...]], str]) -> np.ndarray:
    """The features as a model takes them (float32), checked, and standardised if the owner asked (`site`)."""
    sample = x.shape[1:]
    if not 1 <= len(sample) <= 3 or not all(1 <= d <= MAX_WIDTH for d in sample):
        raise ConfigError("worker.data.path", f"{source.path}: one sample's shape {list(sample)} cannot be a model's "
                                              f"input (1 to 3 sizes, each in [1, {MAX_WIDTH}])")
    # Before standardising: one NaN would spread over its whole column. Values within float32's range cannot
    # overflow the mean or std in float64, and a z-score is at most sqrt(N), so standardised values stay finite.
    check_values(x, setting="worker.data.path", where=where)
    if source.standardize == "site":  # federated: raw here, standardised by the model's first layer
        mean = x.mean(axis=0)
        std = x.std(axis=0)
        std[std == 0] = 1.0  # a constant feature stays 0 instead of becoming NaN
        x = (x - mean) / std
    return np.ascontiguousarray(x, dtype=np.float32)
