"""Samples that stay on the site's disk until a batch asks for them: a folder of 100,000 images must train in a
memory budget, so a reader of files hands back `FileSamples` (one key per sample and a function that decodes
one) instead of a decoded array.

`FileSamples` quacks like the first axis of an array where the data sets need it: `len`, `shape` (the batch
axis first; a spatial size that differs between files is 0), `dtype`, indexing by an integer array or a slice
(a view: nothing is decoded) and `read(idx)`, the decoded batch. `np.asarray` decodes everything, and is
refused when that would exceed `MAX_VALUES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fedbroker.datasets.dataset import MAX_VALUES
from fedbroker.errors import ConfigError


class FileSamples:
    """Samples decoded on demand: `read_one(key)` returns one sample of `sample_shape` (0 = varies) as `dtype`."""

    def __init__(self, keys: Sequence[str], read_one: Callable[[str], np.ndarray], *,
                 sample_shape: tuple[int, ...], dtype: np.dtype | type = np.float32,
                 index: np.ndarray | None = None) -> None:
        self.keys = tuple(keys)
        self.read_one = read_one
        self.sample_shape = tuple(int(d) for d in sample_shape)
        self.dtype = np.dtype(dtype)
        self.index = np.arange(len(self.keys), dtype=np.int64) if index is None else np.asarray(index, np.int64)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def shape(self) -> tuple[int, ...]:
        """The batch axis, then one sample's shape (0 where files differ)."""
        return (len(self), *self.sample_shape)

    @property
    def ndim(self) -> int:
        """Axes, the batch axis included, as an array's."""
        return 1 + len(self.sample_shape)

    def __getitem__(self, idx: np.ndarray | slice | Sequence[int]) -> FileSamples:
        """A view of the chosen samples; nothing is read."""
        return FileSamples(self.keys, self.read_one, sample_shape=self.sample_shape, dtype=self.dtype,
                           index=self.index[idx])

    def key(self, i: int) -> str:
        """The file (or file and slice) sample `i` is read from, for error messages."""
        return self.keys[int(self.index[i])]

    def read(self, idx: np.ndarray | Sequence[int] | None = None) -> np.ndarray:
        """The decoded samples `idx` (all when None), stacked: their shapes must agree."""
        chosen = self.index if idx is None else self.index[np.asarray(idx, dtype=np.int64)]
        samples = [np.asarray(self.read_one(self.keys[int(i)]), dtype=self.dtype) for i in chosen]
        if not samples:
            return np.zeros((0, *(d or 1 for d in self.sample_shape)), dtype=self.dtype)
        shapes = {s.shape for s in samples}
        if len(shapes) > 1:
            raise ConfigError("worker.data.path", f"the samples have different shapes {sorted(shapes)[:4]}: the job "
                                                  f"must resize, crop or pad them to one (its data section)")
        return np.stack(samples)

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        values = len(self) * int(np.prod([d or 1 for d in self.sample_shape]))
        if values > MAX_VALUES:
            raise ConfigError("worker.data.path", f"{len(self)} samples of shape {list(self.sample_shape)} are too "
                                                  f"many to decode at once; they are read a batch at a time")
        out = self.read()
        return out if dtype is None else out.astype(dtype)
