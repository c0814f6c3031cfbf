"""A site's NIfTI slices and masks train through the worker's training path as the same arrays in memory would:
read a batch at a time from the files, with and without DP."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from fedbroker.config import DataSection, DPPolicy, WorkerConfig
from fedbroker.datasets import load_worker_data
from fedbroker.job.spec import TrainingConfig
from fedbroker.job.task import TaskConfig
from fedbroker.worker.training import train_local
from tests.volume_files import LPS, write_nifti

SEGMENTATION = TaskConfig(type="segmentation", classes=2)


@pytest.fixture
def slices(tmp_path):
    rng = np.random.default_rng(8)
    (tmp_path / "img").mkdir()
    (tmp_path / "msk").mkdir()
    for i in range(4):
        volume = rng.normal(size=(8, 8, 6)).astype(np.float32)
        name = f"case{i}.nii" if i % 2 else f"case{i}.nii.gz"
        write_nifti(tmp_path / "img" / name, volume, LPS)
        write_nifti(tmp_path / "msk" / name, (volume > 0.3).astype(np.uint8), LPS)
    return load_worker_data(WorkerConfig(dataset="nifti", data=DataSection(
        path=str(tmp_path / "img"), masks=str(tmp_path / "msk"), labels="mask", num_classes=2, slices="axial")))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 1))


def test_slices_train_from_files_as_the_same_arrays_in_memory(slices):
    assert slices.x.shape == (24, 1, 8, 8)
    config = TrainingConfig(local_epochs=2, batch_size=8, lr=0.5)
    files, arrays = _model(), _model()
    x, y = slices.x.read(np.arange(len(slices))), slices.y.read(np.arange(len(slices)))
    with torch.no_grad():
        before = float(nn.functional.cross_entropy(files(torch.from_numpy(x)), torch.from_numpy(y)))
    train_local(files, slices.x, slices.y, config=config, dp=None, seed=4, task=SEGMENTATION)
    train_local(arrays, x, y, config=config, dp=None, seed=4, task=SEGMENTATION)
    for a, b in zip(files.state_dict().values(), arrays.state_dict().values()):
        assert torch.equal(a, b)
    with torch.no_grad():
        after = float(nn.functional.cross_entropy(files(torch.from_numpy(x)), torch.from_numpy(y)))
    assert after < before


def test_slices_train_under_dp_and_spend_epsilon(slices):
    model = _model()
    start = copy.deepcopy(model.state_dict())
    dp = DPPolicy(enabled=True, noise_multiplier=1.0, max_grad_norm=1.0, epsilon_budget=100.0)
    result = train_local(model, slices.x, slices.y, config=TrainingConfig(local_epochs=1, batch_size=8, lr=0.2),
                         dp=dp, seed=2, task=SEGMENTATION)
    assert result.epsilon is not None and result.epsilon > 0 and np.isfinite(result.train_loss)
    assert any(not torch.equal(start[k], v) for k, v in model.state_dict().items())
