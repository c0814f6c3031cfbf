"""Labels of every kind a task needs, checked at the door: every problem of a label file named at once.

`worker.data.labels` says what a sample's label is:

- `class`: a class index (classification; the readers' `own_dataset` maps declared class names);
- `multilabel`: a row of 0/1 per sample (csv/parquet: `label_columns`, one per finding; npz: y (N, L));
- `target`: real values (regression: one column or `label_columns`; npz: y (N,) or (N, k));
- `mask`: a class index per pixel (segmentation; npz only: y (N, H, W) or (N, D, H, W), the spatial size of x).

A hostile or broken label file is refused before the worker registers or spends ε: a NaN or infinite target,
a multi-hot value other than 0 or 1, a mask of the wrong shape, a mask value out of 0..num_classes−1 or not
whole. `label_problems` lists each with its place (the first few places of each kind, and their count).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fedbroker.datasets.dataset import FLOAT32_MAX
from fedbroker.errors import ConfigError, ConfigErrors

MAX_LABELS = 65_536
_SHOWN = 3


def _places(bad: np.ndarray, where: Callable[[tuple[int, ...]], str]) -> str:
    at = np.argwhere(bad)[:_SHOWN]
    shown = "; ".join(where(tuple(int(i) for i in a)) for a in at)
    count = int(bad.sum())
    return shown + (f" (and {count - len(at)} more)" if count > len(at) else "")


def label_problems(kind: str, y: np.ndarray, x_shape: tuple[int, ...], *, num_classes: int,
                   where: Callable[[tuple[int, ...]], str]) -> list[ConfigError]:
    """Every problem of labels `y` of kind `kind` for samples of shape `x_shape` (with the batch axis);
    `where(index)` names the place in the file of y[index]."""
    setting = "worker.data.labels"
    out: list[ConfigError] = []
    if len(y) != x_shape[0]:
        return [ConfigError(setting, f"{len(y)} labels for {x_shape[0]} samples")]
    if y.dtype.kind not in "biuf":
        return [ConfigError(setting, f"{kind} labels must be numbers, got {y.dtype}")]
    values = y.astype(np.float64, copy=False)
    not_finite = ~np.isfinite(values)
    if not_finite.any():
        out.append(ConfigError(setting, f"{kind} labels must be finite numbers: NaN or infinite at "
                                        f"{_places(not_finite, where)}"))
    if kind == "multilabel":
        if y.ndim != 2 or not 1 <= y.shape[1] <= MAX_LABELS:
            out.append(ConfigError(setting, f"multilabel labels must be one row of 0/1 per sample, (N, L), got shape "
                                            f"{list(y.shape)}"))
        else:
            bad = np.isfinite(values) & (values != 0) & (values != 1)
            if bad.any():
                out.append(ConfigError(setting, f"multilabel labels must be 0 or 1: other values at "
                                                f"{_places(bad, where)}"))
    elif kind == "target":
        if y.ndim not in (1, 2):
            out.append(ConfigError(setting, f"regression targets must be (N,) or (N, k), got shape {list(y.shape)}"))
        big = np.isfinite(values) & (np.abs(values) > FLOAT32_MAX)
        if big.any():
            out.append(ConfigError(setting, f"regression targets must fit a 32-bit float: at {_places(big, where)}"))
    elif kind == "mask":
        spatial = tuple(x_shape[2:])
        if tuple(y.shape[1:]) != spatial or not spatial:
            out.append(ConfigError(setting, f"masks must have the samples' spatial size {list(spatial)} (x is "
                                            f"{list(x_shape)}: (N, C, *spatial)), got {list(y.shape)}"))
        finite = np.isfinite(values)
        fractional = finite & (values != np.round(values))
        if fractional.any():
            out.append(ConfigError(setting, f"mask values must be whole class indices: at {_places(fractional, where)}"))
        outside = finite & ((values < 0) | (values >= num_classes))
        if outside.any():
            out.append(ConfigError(setting, f"mask values must lie in 0..{num_classes - 1} (worker.data.num_classes "
                                            f"{num_classes}): at {_places(outside, where)}"))
    return out


def task_labels(kind: str, y: np.ndarray, x_shape: tuple[int, ...], *, num_classes: int,
                where: Callable[[tuple[int, ...]], str]) -> np.ndarray:
    """`y` checked (`label_problems`, raised all at once) and typed as the task's loss takes it: float32 rows
    and targets, int64 masks."""
    problems = label_problems(kind, y, x_shape, num_classes=num_classes, where=where)
    if problems:
        raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
    if kind == "mask":
        return np.ascontiguousarray(y, dtype=np.int64)
    return np.ascontiguousarray(y, dtype=np.float32)


def width(kind: str, y: np.ndarray) -> int:
    """What `Dataset.num_classes` holds for non-class labels: the labels per sample (multilabel), the targets
    per sample (regression); masks keep the class count."""
    return int(y.shape[1]) if y.ndim == 2 else 1
