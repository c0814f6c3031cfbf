"""The arrays every reader returns, and the limits every reader enforces before it reads.

A worker reads its data once, at start, before it registers or spends any ε; a hostile file must be refused
there, as a ConfigError naming the setting and the place in the file, never as a traceback, a MemoryError or a
NaN met in round 2. So every size a file *declares* (an IDX header, an .npy header inside an .npz, a zip
directory, a Parquet footer, a CSV header) is checked against these limits before the data behind it is
inflated or parsed, and every feature value must be finite and fit the float32 the model trains on.

The limits are generous for real data (one worker holds a share of a data set; CIFAR-10's whole training set
is 154 M values, MNIST's 55 M) and small enough that a worker never allocates more than a few GiB for them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedbroker.errors import ConfigError
from fedbroker.job.spec import MAX_WIDTH

MAX_VALUES = 2**28             # feature values one file may hold (268 M; as float64 while read: 2 GiB)
MAX_ARRAY_BYTES = 2**31        # bytes one IDX file or one .npz member may declare for its data (2 GiB)
MAX_COLUMNS = 4 * MAX_WIDTH    # columns a CSV or Parquet header may name (at most MAX_WIDTH can be features)
MAX_LINE_CHARS = 2**24         # characters in one CSV line, its line end included (16 Mi)
# A CSV field longer than csv.field_size_limit() (131,072 characters unless the process raises it) is refused
# by the csv module itself, naming the line.
FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class Dataset:
    """Features and labels: x float32 (N, C, H, W) for images or (N, F) for tables; y by `labels`
    (fedbroker.datasets.labels): int64 in 0..K-1 (`class`), float32 (N, L) of 0/1 (`multilabel`, K = L), float32
    (N,) or (N, k) (`target`, K = k), int64 (N, *spatial) in 0..K-1 (`mask`)."""

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str
    labels: str = "class"

    def __post_init__(self) -> None:
        if self.x.dtype != np.float32:
            raise ConfigError("x", f"must be float32, got {self.x.dtype}")
        if self.labels != "class":
            want = np.int64 if self.labels == "mask" else np.float32
            if self.y.dtype != want or len(self.y) != len(self.x):
                raise ConfigError("y", f"{self.labels} labels must be {np.dtype(want)}, one per sample, got "
                                       f"{self.y.dtype} with shape {self.y.shape}")
            return
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


def check_values(x: np.ndarray, *, setting: str, where: Callable[[tuple[int, ...]], str]) -> None:
    """Refuse NaN, ±inf and values beyond float32's range, naming the first one's place (`where(index)`).

    One such value turns the whole model into NaN at the first step (with standardisation, its whole column
    at once); the worker would have spent ε on the round before anyone noticed.
    """
    if x.size == 0 or x.dtype.kind != "f":  # integers are always finite and fit
        return
    low, high = x.min(), x.max()  # NaN propagates through both; no copy of x on the common path
    if low >= -FLOAT32_MAX and high <= FLOAT32_MAX:
        return
    bad = ~(np.abs(x) <= FLOAT32_MAX)
    at = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), x.shape))
    value = float(x[at])
    problem = ("is not a finite number" if not np.isfinite(value)
               else f"does not fit a 32-bit float (at most ±{FLOAT32_MAX:.4g})")
    raise ConfigError(setting, f"{where(at)}: {value!r} {problem}")


def listing(names: list[str], *, most: int = 20) -> str:
    """Names for an error message, cut short: a hostile header can name a million columns."""
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown}, ... ({len(names)} in all)"
