"""How well a torch model fits labelled arrays. The coordinator scores each global model on its held-out
split and a worker's trainer checks its arrays the same way; in the kernel so neither imports the other."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from fedbroker.errors import ConfigError

if TYPE_CHECKING:
    from fedbroker.datasets.stream import FileSamples


def as_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 features, int64 labels) as CPU tensors; refuses no samples, a label count that differs from the
    sample count and labels that are not integers, which torch would otherwise meet mid-pass."""
    x = np.asarray(x)
    y = np.asarray(y)
    if len(x) == 0:
        raise ConfigError("x", "no samples")
    if y.ndim != 1 or len(y) != len(x):
        raise ConfigError("y", f"needs one label per sample: shape {y.shape} for {len(x)} samples")
    if not np.issubdtype(y.dtype, np.integer):
        raise ConfigError("y", f"labels must be integers, got {y.dtype}")
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), torch.from_numpy(y.astype(np.int64))


def evaluate(
    model: nn.Module, x: np.ndarray | FileSamples, y: np.ndarray, *, device: str = "cpu", batch_size: int = 512
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of `model` on (x, y); moves `model` to `device`, restores its mode. Samples on
    files (`FileSamples`) are decoded a batch at a time, as decoded (no job pipeline here)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ConfigError("batch_size", f"must be an integer >= 1, got {batch_size!r}")
    from fedbroker.datasets.stream import FileSamples, batch_reader

    if isinstance(x, FileSamples):   # on files: labels checked as always, the samples decoded a batch at a time
        as_tensors(np.zeros((len(x), 0), np.float32), y)
        read = batch_reader(x, None, mask=False)
        x_t: torch.Tensor | FileSamples = x
        y_t = torch.from_numpy(np.asarray(y).astype(np.int64))
    else:
        x_t, y_t = as_tensors(x, y)
    dev = torch.device(device)
    was_training = model.training
    model.to(dev).eval()
    correct, loss_sum = 0, 0.0
    try:
        with torch.no_grad():
            for i in range(0, len(y_t), batch_size):
                yb = y_t[i : i + batch_size].to(dev)
                xb = torch.from_numpy(read(np.arange(i, i + len(yb)))).to(dev) if isinstance(x_t, FileSamples) \
                    else x_t[i : i + batch_size].to(dev)
                logits = model(xb)
                loss_sum += float(nn.functional.cross_entropy(logits, yb, reduction="sum"))
                correct += int((logits.argmax(dim=1) == yb).sum())
    finally:
        model.train(was_training)
    return correct / len(y_t), loss_sum / len(y_t)
