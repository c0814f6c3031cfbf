"""Every task's loss as one number per sample, so that DP-SGD's per-sample clipping is sound.

Per-sample clipping bounds each sample's influence by clipping the gradient of *its own* loss. That holds only
if the training loss is a sum (or a mean over the batch, a constant factor) of per-sample losses each of which
depends on its own sample alone. A loss that couples samples breaks it silently: soft Dice computed over the
whole batch, or class-weighted cross-entropy normalised by the batch's sum of weights (torch's
`reduction="mean"` with `weight=`), makes one sample's gradient depend on the others, and the clip no longer
bounds what one sample changes. So here:

- classification: cross-entropy per sample (with `label_smoothing`); a class weight multiplies the sample's
  loss and the result is divided by the *constant* mean of the job's weights, never by the batch's weight sum;
- multilabel: binary cross-entropy with logits, averaged over the sample's labels;
- regression: squared error (or Huber) averaged over the sample's targets;
- segmentation: per-pixel cross-entropy averaged over the image's pixels, plus `dice_weight` × (1 − soft
  Dice) computed per image (MONAI's DiceLoss with `batch=False`) and averaged over classes.

`per_sample_loss` returns the (n,) vector; the training loops reduce it (mean without DP, sum or Opacus's
per-sample handling with DP). tests/worker/test_task_losses.py pins the independence and the per-sample
gradients against Opacus's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from fedbroker.errors import ConfigError
from fedbroker.job.task import TaskConfig

if TYPE_CHECKING:
    from fedbroker.datasets.stream import FileSamples
    from fedbroker.job.pipeline import DataPipeline


def per_sample_loss(task: TaskConfig, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss of every sample of the batch, shape (n,): each entry depends on its own output and target only."""
    if task.type == "classification":
        weight = None
        if task.class_weights:
            w = torch.tensor(task.class_weights, dtype=output.dtype, device=output.device)
            weight = w / w.mean()  # a constant of the job: the loss's scale stays that of unweighted CE
        return F.cross_entropy(output, target, weight=weight, reduction="none",
                               label_smoothing=task.label_smoothing)
    if task.type == "multilabel":
        return F.binary_cross_entropy_with_logits(output, target.to(output.dtype), reduction="none").mean(dim=1)
    if task.type == "regression":
        y = target.to(output.dtype).reshape(output.shape)
        if task.loss == "huber":
            each = F.huber_loss(output, y, reduction="none", delta=task.huber_delta)
        else:
            each = F.mse_loss(output, y, reduction="none")
        return each.mean(dim=1)
    if task.type == "segmentation":
        pixels = F.cross_entropy(output, target, reduction="none")          # (n, *spatial)
        loss = pixels.flatten(1).mean(dim=1)
        if task.dice_weight:
            loss = loss + task.dice_weight * soft_dice_loss(output, target, task.classes)
        return loss
    raise ConfigError("task.type", f"has no loss: {task.type!r}")


def soft_dice_loss(output: torch.Tensor, target: torch.Tensor, classes: int) -> torch.Tensor:
    """1 − soft Dice of each image (softmax of the scores against the one-hot mask), averaged over classes:
    shape (n,). MONAI's DiceLoss with `batch=False` sums over each image's own pixels only."""
    from monai.losses.dice import DiceLoss

    dice = DiceLoss(softmax=True, to_onehot_y=True, batch=False, reduction="none")
    per_class: torch.Tensor = dice(output, target.unsqueeze(1))               # (n, C, 1, ...)
    return per_class.reshape(len(output), classes).mean(dim=1)


def label_tensor(task: TaskConfig, y: np.ndarray) -> torch.Tensor:
    """The labels as the task's loss takes them: int64 classes and masks, float32 multi-hot rows and targets."""
    if task.type in ("classification", "segmentation"):
        return torch.from_numpy(np.ascontiguousarray(y, dtype=np.int64))
    return torch.from_numpy(np.ascontiguousarray(y, dtype=np.float32))


def task_tensors(task: TaskConfig, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 features, the task's label tensor); refuses no samples and a label count that is not the sample
    count (the labels' own values were checked by the reader, `fedbroker.datasets.labels`)."""
    x, y = np.asarray(x), np.asarray(y)
    if len(x) == 0:
        raise ConfigError("x", "no samples")
    if len(y) != len(x):
        raise ConfigError("y", f"needs one label per sample: shape {y.shape} for {len(x)} samples")
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)), label_tensor(task, y)


def predictions(task: TaskConfig, output: torch.Tensor) -> Any:
    """What the scores are computed from: class probabilities (classification: softmax, (n, k), whose arg-max is
    the predicted class), class indices per pixel (segmentation), probabilities per label (multilabel) or the
    raw values (regression), as numpy."""
    if task.type == "classification":
        return torch.softmax(output.double(), dim=1).cpu().numpy()
    if task.type == "segmentation":
        return output.argmax(dim=1).cpu().numpy()
    if task.type == "multilabel":
        return torch.sigmoid(output).cpu().numpy()
    return output.cpu().numpy()


def evaluation_sums(task: TaskConfig, model: torch.nn.Module, x: np.ndarray | FileSamples,
                    y: np.ndarray | FileSamples, *, device: str = "cpu", batch_size: int = 256,
                    pipeline: DataPipeline | None = None, cache: str = "") -> dict[str, float]:
    """The task's evaluation sums (`fedbroker.tasks.scores.batch_sums`) of `model` on (x, y): inference only,
    in batches; the model's mode is restored. Samples on files (and masks) are decoded a batch at a time and
    prepared by the job's `pipeline` (`fedbroker.datasets.stream.batch_reader`; never augmented)."""
    from fedbroker.datasets.stream import batch_reader
    from fedbroker.tasks.scores import add_sums, batch_sums

    if len(x) == 0:
        raise ConfigError("x", "no samples")
    if len(y) != len(x):
        raise ConfigError("y", f"has {len(y)} labels for {len(x)} samples")
    read_x = batch_reader(x, pipeline, mask=False, cache=cache)
    read_y = batch_reader(y, pipeline, mask=True, cache=cache) if task.type == "segmentation" \
        else batch_reader(y, None, mask=False)
    dev = torch.device(device)
    was_training = model.training
    model.to(dev).eval()
    parts = []
    try:
        with torch.no_grad():
            for i in range(0, len(x), batch_size):
                idx = np.arange(i, min(i + batch_size, len(x)))
                xb = torch.from_numpy(np.ascontiguousarray(read_x(idx), dtype=np.float32)).to(dev)
                yb = label_tensor(task, read_y(idx)).to(dev)
                out = model(xb)
                loss = per_sample_loss(task, out, yb).sum()
                parts.append(batch_sums(task, predictions(task, out), yb.cpu().numpy(), float(loss)))
    finally:
        model.train(was_training)
    return add_sums(parts)
