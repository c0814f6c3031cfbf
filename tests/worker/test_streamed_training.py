"""Training and evaluation on samples that stream from files (fedbroker.worker.batches): the same result as the
same arrays in memory (DP on and off), deterministic whatever the decoding thread's timing, through the cache, and
a batch over the owner's memory budget refused before any ε."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from torch import nn

from fedbroker.config import DPPolicy
from fedbroker.datasets.stream import FileSamples
from fedbroker.errors import ConfigError
from fedbroker.job.pipeline import parse_pipeline
from fedbroker.job.spec import TrainingConfig
from fedbroker.job.task import TaskConfig
from fedbroker.tasks.losses import evaluation_sums
from fedbroker.worker.batches import Prefetcher
from fedbroker.worker.training import train_local

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

POLICY = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=100.0)
CONFIG = TrainingConfig(local_epochs=2, batch_size=16, lr=0.05)


def _cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 8 * 8, 3))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("samples")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 1, 8, 8)).astype(np.float32)
    y = (rng.integers(0, 3, size=96)).astype(np.int64)
    paths = []
    for i, v in enumerate(x):
        paths.append(str(root / f"{i:03d}.npy"))
        np.save(paths[-1], v)
    return x, y, paths


def _files(paths, *, slow: float = 0.0, calls=None) -> FileSamples:
    def read_one(key: str) -> np.ndarray:
        if calls is not None:
            calls.append(key)
        if slow:
            time.sleep(slow)
        return np.load(key, allow_pickle=False)

    return FileSamples(paths, read_one, sample_shape=(1, 8, 8))


def _state(model: nn.Module) -> list[np.ndarray]:
    return [v.detach().numpy().copy() for v in model.state_dict().values()]


@pytest.mark.parametrize("dp", [None, POLICY], ids=["plain", "dp"])
def test_training_on_files_equals_training_on_the_same_arrays_in_memory(folder, dp):
    x, y, paths = folder
    in_memory, on_files = _cnn(), _cnn()
    a = train_local(in_memory, x, y, config=CONFIG, dp=dp, seed=7)
    b = train_local(on_files, _files(paths), y, config=CONFIG, dp=dp, seed=7)
    for u, v in zip(_state(in_memory), _state(on_files)):
        np.testing.assert_array_equal(u, v)
    assert a.train_loss == b.train_loss and a.epsilon == b.epsilon and a.history == b.history


def test_dp_passes_on_files_equal_those_in_memory(folder):
    x, y, paths = folder
    in_memory, on_files = _cnn(), _cnn()
    train_local(in_memory, x, y, config=CONFIG, dp=POLICY, seed=3, physical_batch_size=5)
    train_local(on_files, _files(paths), y, config=CONFIG, dp=POLICY, seed=3, physical_batch_size=5)
    for u, v in zip(_state(in_memory), _state(on_files)):
        np.testing.assert_array_equal(u, v)


def test_the_result_does_not_depend_on_the_decoding_threads_timing(folder):
    """A slow decoder (the thread always behind) and a fast one (always ahead) train the same weights, with an
    augmenting pipeline whose draws come from the training thread."""
    _, y, paths = folder
    pipeline = parse_pipeline({"augment": [{"flip": {"axes": [2], "p": 0.5}}, {"rotate90": {"p": 0.5}}]})
    fast, slow = _cnn(), _cnn()
    train_local(fast, _files(paths), y, config=CONFIG, dp=POLICY, seed=11, pipeline=pipeline)
    train_local(slow, _files(paths, slow=0.002), y, config=CONFIG, dp=POLICY, seed=11, pipeline=pipeline)
    for u, v in zip(_state(fast), _state(slow)):
        np.testing.assert_array_equal(u, v)
    plain = _cnn()
    train_local(plain, _files(paths), y, config=CONFIG, dp=POLICY, seed=11)
    assert any(not np.array_equal(u, v) for u, v in zip(_state(fast), _state(plain)))   # augmentation did act


def test_the_prefetcher_decodes_the_next_batch_in_another_thread_and_hands_back_in_order():
    threads, told = [], []

    def decode(idx: np.ndarray):
        threads.append(threading.get_ident())
        return idx * 10, None

    p = Prefetcher(decode)
    for i in range(3):
        p.tell(torch.tensor([i, i + 1]))
        told.append(i)
    p._pool.submit(lambda: None).result()   # the three decoded (in order, one thread) before any is asked for
    assert [p.get(torch.tensor([i, i + 1]))[0].tolist() for i in told] == [[0, 10], [10, 20], [20, 30]]
    assert p.get(torch.tensor([9]))[0].tolist() == [90]   # never told of: decoded now, here
    assert threads[-1] == threading.get_ident() and len(set(threads[:3])) == 1 and threads[0] != threads[-1]
    p.tell(torch.tensor([1]))
    p.tell(torch.tensor([2]))
    assert p.get(torch.tensor([5]))[0].tolist() == [50]   # not told of: the batches told of stay
    assert p.get(torch.tensor([2]))[0].tolist() == [20]   # [1], told before it and skipped, is dropped
    assert not p._ahead
    p.close()


def test_training_decodes_each_sample_once_per_epoch_and_the_cache_decodes_it_once_in_all(folder, tmp_path):
    _, y, paths = folder
    pipeline = parse_pipeline({"preprocess": [{"normalize": "per_image"}]})
    calls: list[str] = []
    plain = TrainingConfig(local_epochs=2, batch_size=16, lr=0.05)
    first, second, uncached = _cnn(), _cnn(), _cnn()
    train_local(uncached, _files(paths, calls=calls), y, config=plain, dp=None, seed=1, pipeline=pipeline)
    assert len(calls) == 2 * len(paths)
    calls.clear()
    cache = str(tmp_path / "cache")
    train_local(first, _files(paths, calls=calls), y, config=plain, dp=None, seed=1, pipeline=pipeline, cache=cache)
    assert sorted(calls) == sorted(paths)   # epoch 2 from the cache
    train_local(second, _files(paths, calls=calls), y, config=plain, dp=None, seed=1, pipeline=pipeline, cache=cache)
    assert len(calls) == len(paths)          # the next round: nothing decoded
    for u, v, w in zip(_state(first), _state(second), _state(uncached)):
        np.testing.assert_array_equal(u, v)
        np.testing.assert_array_equal(u, w)


def test_a_batch_over_the_memory_budget_is_refused_before_any_epsilon(folder):
    x, y, paths = folder
    pipeline = parse_pipeline({"preprocess": [{"resize": [512, 512]}]})
    calls: list[str] = []
    with pytest.raises(ConfigError) as err:
        train_local(_cnn(), _files(paths, calls=calls), y, config=TrainingConfig(batch_size=64), dp=POLICY,
                    pipeline=pipeline, memory_mib=64)
    assert err.value.field == "worker.data.memory_mib" and "physical_batch_size" in str(err.value)
    assert calls == []   # refused before the first sample was decoded, let alone a step taken
    # In-memory arrays were loaded whole already: the budget does not apply to them.
    train_local(_cnn(), x, y, config=CONFIG, dp=None, memory_mib=1)


def test_evaluation_sums_on_files_equal_those_on_arrays(folder):
    x, y, paths = folder
    model = _cnn()
    task = TaskConfig()
    on_arrays = evaluation_sums(task, model, x, y, batch_size=20)
    on_files = evaluation_sums(task, model, _files(paths)[np.arange(96)], y, batch_size=20)
    assert on_arrays == on_files


def test_segmentation_masks_on_files_train_and_evaluate(tmp_path):
    rng = np.random.default_rng(2)
    images = rng.normal(size=(24, 1, 8, 8)).astype(np.float32)
    masks = (images[:, 0] > 0).astype(np.int64)
    ipaths, mpaths = [], []
    for i in range(24):
        ipaths.append(str(tmp_path / f"i{i}.npy"))
        mpaths.append(str(tmp_path / f"m{i}.npy"))
        np.save(ipaths[-1], images[i])
        np.save(mpaths[-1], masks[i])
    x = FileSamples(ipaths, lambda k: np.load(k), sample_shape=(1, 8, 8))
    m = FileSamples(mpaths, lambda k: np.load(k), sample_shape=(8, 8), dtype=np.int64)
    task = TaskConfig(type="segmentation", classes=2)

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1))

    a, b = net(), net()
    config = TrainingConfig(local_epochs=2, batch_size=8, lr=0.1)
    train_local(a, images, masks, config=config, dp=None, seed=5, task=task)
    train_local(b, x, m, config=config, dp=None, seed=5, task=task)
    for u, v in zip(_state(a), _state(b)):
        np.testing.assert_array_equal(u, v)
    assert evaluation_sums(task, b, x, m) == evaluation_sums(task, b, images, masks)
    assert os.path.exists(ipaths[0])


def test_feature_statistics_of_files_equal_those_of_the_arrays(folder, monkeypatch):
    from fedbroker.worker import feature_statistics

    monkeypatch.setattr(feature_statistics, "STREAM_CHUNK", 40)   # three chunks of the 96 samples
    clipped_sums = feature_statistics.clipped_sums
    x, _, paths = folder
    lower, upper = np.full(64, -1.0), np.full(64, 1.0)
    np.testing.assert_allclose(clipped_sums(_files(paths), lower, upper), clipped_sums(x, lower, upper), rtol=1e-12)
