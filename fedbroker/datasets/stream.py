"""Samples that stay on the site's disk until a batch asks for them: a folder of 100,000 images must train in a
memory budget, so a reader of files hands back `FileSamples` (one key per sample and a function that decodes
one) instead of a decoded array.

`FileSamples` quacks like the first axis of an array where the data sets need it: `len`, `shape` (the batch
axis first; a spatial size that differs between files is 0), `dtype`, indexing by an integer array or a slice
(a view: nothing is decoded) and `read(idx)`, the decoded batch. `np.asarray` decodes everything, and is
refused when that would exceed `MAX_VALUES`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from fedbroker.datasets.dataset import MAX_VALUES
from fedbroker.errors import ConfigError

if TYPE_CHECKING:
    from fedbroker.job.pipeline import DataPipeline

log = logging.getLogger(__name__)


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


# --- reading samples as the model takes them: prepared, cached, charged against the memory budget --------------

Prepare = Callable[[np.ndarray], np.ndarray]   # one raw sample → the model's input (the job's preprocess)


def take(samples: np.ndarray | FileSamples, idx: np.ndarray | slice) -> np.ndarray:
    """The samples `idx` as one array: a gather of an in-memory array, or the decoded files of a FileSamples."""
    if isinstance(samples, FileSamples):
        chosen = np.arange(len(samples))[idx] if isinstance(idx, slice) else idx
        return samples.read(chosen)
    return np.asarray(samples[idx])


class DecodedCache:
    """Prepared samples kept on the site's disk (`worker.data.cache`), one small .npz per sample under a folder
    per pipeline digest, so later epochs and rounds skip decoding.

    An entry is named by the sample's key, its file's size and modification time and the pipeline's digest: a
    file that changes, or a job that prepares differently, misses. An entry is written to a temporary name and
    renamed, so a fault mid-write leaves no entry. It is never trusted blindly: it is read without pickle, its
    zip checksum checked, and it must name its own key and fingerprint and hold a finite float32 (or int64 mask)
    array of the expected shape; anything else is deleted and the sample decoded again (`discarded` counts them).
    """

    def __init__(self, folder: str, digest: str) -> None:
        self.folder = os.path.join(folder, digest[:32])
        os.makedirs(self.folder, exist_ok=True)
        self.hits = self.misses = self.discarded = 0
        self._lock = threading.Lock()

    @staticmethod
    def fingerprint(key: str) -> str | None:
        """key|size|mtime of the file behind `key` (its path, or its path then '#' and a part); None when there
        is no such file (then the sample is not cached)."""
        for path in (key, key.rsplit("#", 1)[0]):
            try:
                st = os.stat(path)
            except (OSError, ValueError):
                continue
            return f"{key}|{st.st_size}|{st.st_mtime_ns}"
        return None

    def _path(self, fingerprint: str) -> str:
        name = hashlib.sha256(fingerprint.encode("utf-8", "surrogatepass")).hexdigest()
        return os.path.join(self.folder, name[:2], name + ".npz")

    def get(self, fingerprint: str, *, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """The entry of `fingerprint` when present and sound (`shape`: 0 = any size on that axis)."""
        path = self._path(fingerprint)
        if not os.path.exists(path):
            self._count("misses")
            return None
        try:
            with np.load(path, allow_pickle=False) as entry:
                named = bytes(entry["key"]).decode("utf-8", "surrogatepass")
                value = np.array(entry["x"])
        except Exception:   # truncated, bad CRC, not a zip, missing member, an object array: decode again
            value, named = None, ""
        if value is None or named != fingerprint or not _fits(value, shape, dtype):
            self._count("discarded")
            log.warning("the cached sample %s is corrupt or altered: discarded and decoded again", path)
            with contextlib.suppress(OSError):
                os.remove(path)
            return None
        self._count("hits")
        return value

    def put(self, fingerprint: str, value: np.ndarray) -> None:
        """Write an entry (temporary name, then an atomic rename); a full or read-only disk only skips caching."""
        path = self._path(fingerprint)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                np.savez(f, x=value, key=np.frombuffer(fingerprint.encode("utf-8", "surrogatepass"), np.uint8))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("a decoded sample could not be cached in %s: %s", self.folder, exc)
            with contextlib.suppress(OSError):
                os.remove(tmp)

    def _count(self, what: str) -> None:
        with self._lock:
            setattr(self, what, getattr(self, what) + 1)


def _fits(value: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    if value.dtype != dtype or value.ndim != len(shape):
        return False
    if any(want and got != want for got, want in zip(value.shape, shape)):
        return False
    return value.dtype.kind != "f" or bool(np.isfinite(value).all())


class SampleReader:
    """Reads batches of samples as the model takes them: `read(idx)` decodes each file (or takes it from the
    cache), prepares it (`prepare`, the job's preprocess; None: as decoded) and stacks them. Thread-safe, and a
    pure function of `idx`: prefetching in another thread changes no result."""

    def __init__(self, samples: FileSamples, prepare: Prepare | None, *, out_shape: tuple[int, ...],
                 cache: DecodedCache | None = None) -> None:
        self.samples, self.prepare, self.cache = samples, prepare, cache
        self.out_shape = out_shape
        self.dtype = samples.dtype

    def one(self, i: int) -> np.ndarray:
        """Sample `i` prepared: from the cache when it holds a sound entry, else decoded (and cached)."""
        key = self.samples.key(i)
        fingerprint = self.cache.fingerprint(key) if self.cache is not None else None
        if fingerprint is not None and self.cache is not None:
            cached = self.cache.get(fingerprint, shape=self.out_shape, dtype=self.dtype)
            if cached is not None:
                return cached
        value = np.asarray(self.samples.read_one(key), dtype=self.dtype)
        if self.prepare is not None:
            value = np.ascontiguousarray(self.prepare(value), dtype=self.dtype)
        if fingerprint is not None and self.cache is not None:
            self.cache.put(fingerprint, value)
        return value

    def read(self, idx: np.ndarray) -> np.ndarray:
        """The samples `idx`, prepared and stacked (their prepared shapes must agree)."""
        samples = [self.one(int(i)) for i in np.asarray(idx, dtype=np.int64)]
        if not samples:
            return np.zeros((0, *(d or 1 for d in self.out_shape)), dtype=self.dtype)
        shapes = {s.shape for s in samples}
        if len(shapes) > 1:
            raise ConfigError("worker.data.path", f"the prepared samples have different shapes {sorted(shapes)[:4]}: "
                                                  f"the job must resize, crop or pad them to one (its data section)")
        return np.stack(samples)


def sample_bytes(shape: tuple[int, ...], dtype: np.dtype | type = np.float32) -> int:
    """Bytes of one sample of `shape` (an axis of 0, a size that varies, counts as 1: its size is unknown)."""
    return int(np.prod([d or 1 for d in shape], dtype=np.int64)) * np.dtype(dtype).itemsize


def pipeline_digest(pipeline: DataPipeline | None, *, mask: bool = False) -> str:
    """What names the prepared samples in the cache: a digest of the job's preprocess (no pipeline: as decoded),
    images and masks apart."""
    described: Any = None if pipeline is None else pipeline.to_dict().get("preprocess", [])
    text = json.dumps({"preprocess": described, "mask": mask}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def preparer(pipeline: DataPipeline | None, *, mask: bool) -> Callable[[np.ndarray], np.ndarray] | None:
    """One raw sample → the model's input (or mask): the job's preprocess; None without one."""
    if pipeline is None or not pipeline.preprocess:
        return None
    from fedbroker.datasets.transforms import prepare

    return lambda sample: prepare(pipeline, sample, mask=mask)


def batch_reader(samples: np.ndarray | FileSamples, pipeline: DataPipeline | None, *, mask: bool,
                 cache: str = "") -> Callable[[np.ndarray], np.ndarray]:
    """idx → the samples `idx` as the model takes them (the job's preprocess applied to each; masks as masks): a
    gather of in-memory samples, or a SampleReader over files (with the site's decoded cache when `cache`)."""
    prepare = preparer(pipeline, mask=mask)
    if not isinstance(samples, FileSamples):
        arr = samples
        if prepare is None:
            return lambda idx: np.asarray(arr[idx])
        dtype = np.int64 if mask else np.float32
        return lambda idx: np.stack([np.asarray(prepare(s), dtype=dtype) for s in arr[idx]])
    return reader(samples, pipeline, mask=mask, cache=cache).read


def reader(samples: FileSamples, pipeline: DataPipeline | None, *, mask: bool, cache: str) -> SampleReader:
    """The SampleReader of `samples` under the job's preprocess, with the site's cache when it has one."""
    if mask:   # a mask's prepared size follows its image's: checked for its axes, dtype and values only
        shape: tuple[int, ...] = (0,) * len(samples.sample_shape)
    else:
        shape = tuple(pipeline.output_shape(samples.sample_shape)) if pipeline is not None else samples.sample_shape
    store = DecodedCache(cache, pipeline_digest(pipeline, mask=mask)) if cache else None
    return SampleReader(samples, preparer(pipeline, mask=mask), out_shape=shape, cache=store)


# What is held at once while training streams: the pass being trained, the pass decoded ahead, and the
# augmented copy of the one being trained.
BATCHES_HELD = 3


def check_memory(*, memory_mib: int, pass_samples: int, per_sample: int, streamed: bool) -> None:
    """Refuse, before any step, a training whose decoded samples cannot fit `worker.data.memory_mib`:
    BATCHES_HELD passes of `pass_samples` samples of `per_sample` bytes (raw + prepared, image and mask)."""
    if not streamed:
        return
    need = BATCHES_HELD * pass_samples * per_sample
    if need > memory_mib * MIB:
        raise ConfigError("worker.data.memory_mib", (
            f"a pass of {pass_samples} samples takes {per_sample / MIB:.3g} MiB each; the {BATCHES_HELD} passes held "
            f"at once (the one training, the one decoded ahead, its augmented copy) need {need / MIB:.1f} MiB, over "
            f"this site's budget of {memory_mib} MiB: set worker.physical_batch_size (the samples one pass decodes; "
            f"the same update and ε) or raise worker.data.memory_mib"))


MIB = 1 << 20
