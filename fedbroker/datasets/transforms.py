"""A job's data pipeline (fedbroker.job.pipeline) applied to samples, with MONAI's transforms.

`prepare` turns one raw sample, (C, *spatial) as a reader decodes it, into the model's input (a mask, (*spatial)
class ids, into the model's mask shape: the geometric steps only, resized by nearest neighbour); it is
deterministic, and it is what the download's README tells a user to run on a raw file. `augment` changes a
training batch at random, the same geometric change for an image and its mask (MONAI's dictionary transforms
over the keys image and mask), with its random state drawn from a torch generator: one seed, one result.
Every augmentation keeps the prepared shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from monai.data.meta_obj import get_track_meta, set_track_meta
from monai.transforms.compose import Compose
from monai.transforms.croppad.array import ResizeWithPadOrCrop
from monai.transforms.croppad.dictionary import RandSpatialCropd, SpatialPadd
from monai.transforms.intensity.array import NormalizeIntensity, ScaleIntensityRange
from monai.transforms.intensity.dictionary import RandScaleIntensityd, RandShiftIntensityd
from monai.transforms.spatial.array import Resize
from monai.transforms.spatial.dictionary import RandFlipd, RandRotate90d, Resized
from monai.transforms.utility.array import RepeatChannel

from fedbroker.job.pipeline import DataPipeline, Step

_GEOMETRIC = ("resize", "resize_volume", "crop", "pad")
_IMAGE, _MASK = "image", "mask"


@contextmanager
def _plain_tensors() -> Iterator[None]:
    """MONAI's transforms without their metadata (plain tensors): three times faster on a batch, and nothing
    here reads the metadata. MONAI keeps the switch process-wide, so it is put back as it was."""
    before = get_track_meta()
    set_track_meta(False)
    try:
        yield
    finally:
        set_track_meta(before)


def _linear(rank: int) -> str:
    return "trilinear" if rank == 3 else "bilinear"


def _preprocess_step(step: Step, *, channels: int, rank: int, mask: bool) -> Callable[[Any], Any] | None:
    """One preprocess step as a MONAI transform of a (C, *spatial) array (None: nothing to do for this sample)."""
    a = step.args
    if step.name == "window":
        lo, hi = a["center"] - a["width"] / 2, a["center"] + a["width"] / 2
        return ScaleIntensityRange(a_min=lo, a_max=hi, b_min=0.0, b_max=1.0, clip=True)
    if step.name in ("resize", "resize_volume"):
        if mask:
            return Resize(spatial_size=a["size"], mode="nearest", dtype=torch.float32)
        return Resize(spatial_size=a["size"], mode=_linear(rank), align_corners=False)
    if step.name in ("crop", "pad"):
        return ResizeWithPadOrCrop(spatial_size=a["size"], mode="constant")
    if step.name == "channels":
        return RepeatChannel(repeats=a["channels"]) if channels == 1 and a["channels"] > 1 else None
    if not a["mean"]:  # normalize: per_image
        return NormalizeIntensity(channel_wise=True)
    if len(a["mean"]) == 1:
        return NormalizeIntensity(subtrahend=a["mean"][0], divisor=a["std"][0])
    return NormalizeIntensity(subtrahend=list(a["mean"]), divisor=list(a["std"]), channel_wise=True)


def prepare(pipeline: DataPipeline, sample: np.ndarray, *, mask: bool = False) -> np.ndarray:
    """One raw sample (C, *spatial) through the job's preprocessing, in its order, as float32 (the model's input);
    a mask (*spatial) of class ids through its geometric steps only, by nearest neighbour, as int64."""
    x = np.asarray(sample)
    if mask:
        x = x[np.newaxis]
    x = x.astype(np.float32, copy=True)  # some MONAI transforms (NormalizeIntensity) write into their input
    rank, channels = x.ndim - 1, x.shape[0]
    out: Any = x
    with _plain_tensors():
        for step in pipeline.preprocess:
            if mask and step.name not in _GEOMETRIC:
                continue
            transform = _preprocess_step(step, channels=channels, rank=rank, mask=mask)
            if transform is not None:
                out = transform(out)
                channels = int(out.shape[0])
    array: np.ndarray = out.numpy() if isinstance(out, torch.Tensor) else np.asarray(out)
    if mask:
        labels: np.ndarray = np.rint(array[0]).astype(np.int64)
        return labels
    return np.ascontiguousarray(array, dtype=np.float32)


def _augment_steps(steps: Sequence[Step], spatial: Sequence[int], keys: list[str]) -> list[Callable[[Any], Any]]:
    """The augment steps as MONAI dictionary transforms over `keys` (image, and mask when there is one)."""
    out: list[Callable[[Any], Any]] = []
    nearest = ("nearest",) if len(keys) > 1 else ()
    for step in steps:
        a = step.args
        if step.name == "flip":
            out += [RandFlipd(keys=keys, prob=a["p"], spatial_axis=[ax - 1 for ax in a["axes"]])]
        elif step.name == "rotate90":
            out += [RandRotate90d(keys=keys, prob=a["p"], max_k=3, spatial_axes=(a["axes"][0] - 1, a["axes"][1] - 1))]
        elif step.name == "random_crop":
            padded = [d + 2 * a["pad"] for d in spatial]
            out += [SpatialPadd(keys=keys, spatial_size=padded, mode="constant"),
                    RandSpatialCropd(keys=keys, roi_size=a["size"], random_center=True, random_size=False)]
            if tuple(a["size"]) != tuple(spatial):
                out += [Resized(keys=keys, spatial_size=list(spatial), mode=(_linear(len(spatial)), *nearest),
                                align_corners=(False, *(None for _ in nearest)))]
        elif step.name == "intensity":
            if a["scale"]:
                out += [RandScaleIntensityd(keys=[_IMAGE], factors=a["scale"], prob=a["p"])]
            if a["shift"]:
                out += [RandShiftIntensityd(keys=[_IMAGE], offsets=a["shift"], prob=a["p"])]
    return out


def augment(pipeline: DataPipeline, xb: torch.Tensor, yb: torch.Tensor | None, *,
            generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A training batch xb (N, C, *spatial) augmented sample by sample; yb is moved with it when it is a batch of
    masks (N, *spatial), and returned as it is otherwise (class ids, targets). The random state is one draw from
    `generator`, so the same generator state gives the same batch; identity when the pipeline has no augment."""
    if not pipeline.augment or len(xb) == 0:
        return xb, yb
    masks = yb is not None and yb.dim() == xb.dim() - 1 and tuple(yb.shape[1:]) == tuple(xb.shape[2:])
    keys = [_IMAGE, _MASK] if masks else [_IMAGE]
    compose = Compose(_augment_steps(pipeline.augment, tuple(xb.shape[2:]), keys))
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator).item())
    compose.set_random_state(seed=seed)
    images, labels = [], []
    with _plain_tensors():
        for i in range(len(xb)):
            item: dict[str, Any] = {_IMAGE: xb[i].clone()}  # never written into: the caller's batch
            if masks:
                assert yb is not None
                item[_MASK] = yb[i].unsqueeze(0).to(torch.float32)
            done = compose(item)
            images.append(torch.as_tensor(done[_IMAGE]))
            if masks:
                labels.append(torch.as_tensor(done[_MASK])[0])
    x_out = torch.stack(images).to(dtype=xb.dtype, device=xb.device)
    if not masks:
        return x_out, yb
    assert yb is not None
    return x_out, torch.round(torch.stack(labels)).to(dtype=yb.dtype, device=yb.device)

