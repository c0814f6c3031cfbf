"""FileSamples, the decoded cache and the memory check (fedbroker.datasets.stream): views decode nothing, the
split of a folder decodes nothing, a cache entry is used only when sound."""

from __future__ import annotations

import os
import pathlib
import zipfile

import numpy as np
import pytest

from fedbroker.datasets import Dataset, strata, train_test_split
from fedbroker.datasets.stream import DecodedCache, FileSamples, SampleReader, batch_reader, check_memory
from fedbroker.errors import ConfigError
from fedbroker.job.pipeline import parse_pipeline


class Folder:
    """n small .npy files on disk; read_one decodes one and counts the calls."""

    def __init__(self, root: str, n: int, shape: tuple[int, ...] = (1, 6, 6), seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.values = rng.normal(size=(n, *shape)).astype(np.float32)
        self.paths = []
        for i, v in enumerate(self.values):
            path = os.path.join(root, f"s{i:04d}.npy")
            np.save(path, v)
            self.paths.append(path)
        self.calls = 0

    def read_one(self, key: str) -> np.ndarray:
        self.calls += 1
        return np.load(key, allow_pickle=False)

    def samples(self) -> FileSamples:
        return FileSamples(self.paths, self.read_one, sample_shape=self.values.shape[1:])


def test_views_and_shapes_decode_nothing_and_read_decodes_the_chosen(tmp_path):
    folder = Folder(str(tmp_path), 10)
    s = folder.samples()
    view = s[np.array([7, 2, 5])][1:]
    assert view.shape == (2, 1, 6, 6) and view.ndim == 4 and folder.calls == 0
    assert view.key(0).endswith("s0002.npy")
    np.testing.assert_array_equal(view.read(), folder.values[[2, 5]])
    assert folder.calls == 2
    np.testing.assert_array_equal(np.asarray(s[:3]), folder.values[:3])


def test_train_test_split_and_strata_of_a_folder_decode_nothing(tmp_path):
    folder = Folder(str(tmp_path), 48)
    y = np.arange(48, dtype=np.int64) % 4
    train, test = train_test_split(Dataset(x=folder.samples(), y=y, num_classes=4, name="folder"),
                                   test_fraction=0.25, seed=3)
    assert len(train) == 36 and len(test) == 12 and folder.calls == 0
    assert isinstance(train.x, FileSamples) and sorted(train.x.index.tolist() + test.x.index.tolist()) == list(range(48))
    np.testing.assert_array_equal(train.y, y[train.x.index])
    strata(train)
    masks = FileSamples(folder.paths, folder.read_one, sample_shape=(6, 6), dtype=np.int64)
    seg = Dataset(x=folder.samples(), y=masks, num_classes=2, name="seg", labels="mask")
    seg_train, _ = train_test_split(seg, test_fraction=0.2, seed=1)
    assert isinstance(seg_train.y, FileSamples) and np.array_equal(seg_train.y.index, seg_train.x.index)
    assert len(strata(seg_train)) == len(seg_train) and folder.calls == 0


def test_cache_hits_after_a_miss_and_misses_when_the_file_or_the_pipeline_changes(tmp_path):
    os.makedirs(tmp_path / "data")
    folder = Folder(str(tmp_path / "data"), 4)
    cache = DecodedCache(str(tmp_path / "cache"), "a" * 64)
    read = SampleReader(folder.samples(), None, out_shape=(1, 6, 6), cache=cache)
    first = read.read(np.arange(4))
    assert (cache.misses, cache.hits, folder.calls) == (4, 0, 4)
    np.testing.assert_array_equal(read.read(np.arange(4)), first)
    assert (cache.hits, folder.calls) == (4, 4)
    changed = folder.values[1] + 1
    np.save(folder.paths[1], changed)
    os.utime(folder.paths[1], ns=(1, 1))   # a new mtime: the entry of the old file no longer applies
    np.testing.assert_array_equal(read.read(np.array([1])), changed[None])
    assert folder.calls == 5
    other = SampleReader(folder.samples(), lambda s: s * 2, out_shape=(1, 6, 6),
                         cache=DecodedCache(str(tmp_path / "cache"), "b" * 64))
    np.testing.assert_array_equal(other.read(np.array([0])), 2 * folder.values[:1])
    assert folder.calls == 6


def _entries(root: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".npz"))


@pytest.mark.parametrize("damage", ["truncated", "flipped byte", "wrong shape", "another key", "nan", "pickle",
                                    "not a zip"])
def test_a_corrupt_or_altered_cache_entry_is_discarded_and_decoded_again(tmp_path, damage):
    os.makedirs(tmp_path / "data")
    folder = Folder(str(tmp_path / "data"), 2)
    cache = DecodedCache(str(tmp_path / "cache"), "c" * 64)
    read = SampleReader(folder.samples(), None, out_shape=(1, 6, 6), cache=cache)
    read.read(np.arange(2))
    target = cache._path(cache.fingerprint(folder.paths[0]))
    other = cache._path(cache.fingerprint(folder.paths[1]))
    raw = pathlib.Path(target).read_bytes()
    key = np.frombuffer(cache.fingerprint(folder.paths[0]).encode(), np.uint8)
    write = pathlib.Path(target).write_bytes
    if damage == "truncated":
        write(raw[: len(raw) // 2])
    elif damage == "flipped byte":   # inside the stored array: the zip's CRC no longer matches
        at = raw.index(folder.values[0].tobytes()[:8]) + 16
        write(raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:])
    elif damage == "wrong shape":
        np.savez(target, x=np.zeros((1, 5, 5), np.float32), key=key)
    elif damage == "another key":   # a sound entry of another sample put in this one's place
        write(pathlib.Path(other).read_bytes())
    elif damage == "nan":
        np.savez(target, x=np.full((1, 6, 6), np.nan, np.float32), key=key)
    elif damage == "pickle":
        np.savez(target, x=np.array([{"a": 1}], dtype=object), key=key)
    else:
        write(b"PK not really a zip")
    calls = folder.calls
    np.testing.assert_array_equal(read.read(np.array([0])), folder.values[:1])
    assert cache.discarded == 1 and folder.calls == calls + 1
    assert zipfile.is_zipfile(target)   # re-decoded and written again, soundly
    np.testing.assert_array_equal(read.read(np.array([0])), folder.values[:1])
    assert folder.calls == calls + 1 and cache.discarded == 1


def test_a_fault_mid_write_leaves_no_entry(tmp_path, monkeypatch):
    os.makedirs(tmp_path / "data")
    folder = Folder(str(tmp_path / "data"), 1)
    cache = DecodedCache(str(tmp_path / "cache"), "d" * 64)

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", fail)
    read = SampleReader(folder.samples(), None, out_shape=(1, 6, 6), cache=cache)
    np.testing.assert_array_equal(read.read(np.array([0])), folder.values[:1])
    assert _entries(str(tmp_path / "cache")) == []
    assert not [f for _, _, files in os.walk(tmp_path / "cache") for f in files]   # no temporary left either


def test_a_key_without_a_file_is_not_cached(tmp_path):
    cache = DecodedCache(str(tmp_path), "e" * 64)
    samples = FileSamples(["no/such/file#3"], lambda key: np.ones((1, 2, 2), np.float32), sample_shape=(1, 2, 2))
    SampleReader(samples, None, out_shape=(1, 2, 2), cache=cache).read(np.array([0]))
    assert cache.fingerprint("no/such/file#3") is None and _entries(str(tmp_path)) == []


def test_batch_reader_prepares_with_the_pipeline_files_and_arrays_alike(tmp_path):
    folder = Folder(str(tmp_path), 3, shape=(1, 8, 8))
    pipeline = parse_pipeline({"preprocess": [{"resize": [4, 4]}, {"normalize": "per_image"}]})
    from_files = batch_reader(folder.samples(), pipeline, mask=False)(np.array([2, 0]))
    from_arrays = batch_reader(folder.values, pipeline, mask=False)(np.array([2, 0]))
    assert from_files.shape == (2, 1, 4, 4) and from_files.dtype == np.float32
    np.testing.assert_array_equal(from_files, from_arrays)


def test_a_batch_over_the_memory_budget_is_refused_naming_the_setting():
    check_memory(memory_mib=1, pass_samples=10, per_sample=1000, streamed=True)
    with pytest.raises(ConfigError) as err:
        check_memory(memory_mib=1, pass_samples=100, per_sample=64 * 64 * 3 * 4 * 2, streamed=True)
    assert err.value.field == "worker.data.memory_mib" and "physical_batch_size" in str(err.value)
