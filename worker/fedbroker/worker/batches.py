"""The batches local training fetches: a gather of in-memory arrays, or samples streamed from the site's disk.

In memory (`np.ndarray`): the arrays go to the device once and a batch is one gather, as always; the job's
preprocess (`data.preprocess`) runs once over every sample before training.

From files (`fedbroker.datasets.stream.FileSamples`): only a batch's samples are decoded, prepared (the job's
preprocess, per sample) and stacked, so a site's 100,000 images train in `worker.data.memory_mib`. The indices
of the next batch are known ahead (the shuffle or the Poisson draw), so the next batch is decoded in a thread
while the current one trains (Pillow and nibabel release the GIL while decoding); a batch's decoding is a pure
function of its indices and augmentation runs in the training thread, in order, from its own generator, so the
result never depends on which thread ran first. With `worker.data.cache` set, prepared samples are kept on disk
(`DecodedCache`) and later epochs and rounds skip decoding.

Augmentation (`data.augment`, training only) runs on the device batch; a mask moves with its image.
"""

from __future__ import annotations

import collections
import resource
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedbroker.datasets.stream import FileSamples, batch_reader

if TYPE_CHECKING:
    from fedbroker.job.pipeline import DataPipeline

Decoded = tuple[np.ndarray, np.ndarray | None]


def job_pipeline(installed: object) -> DataPipeline | None:
    """The data pipeline of a job's installed settings (None: the job has no data section)."""
    pipeline = getattr(installed, "pipeline", None)
    return pipeline if pipeline is not None and hasattr(pipeline, "preprocess") else None


def peak_memory_bytes() -> int:
    """This process's peak resident memory so far, in bytes (Linux reports ru_maxrss in KiB, macOS in bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


class Prefetcher:
    """Decodes the batches it is told of in one background thread, in order; `get(idx)` hands back the batch
    of `idx`, decoded ahead when it was told of it, else decoded now. At most the batches told of and not yet
    taken are held (the training loop tells one ahead)."""

    def __init__(self, decode: Callable[[np.ndarray], Decoded]) -> None:
        self.decode = decode
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: collections.deque[tuple[np.ndarray, Future[Decoded]]] = collections.deque()

    def tell(self, idx: torch.Tensor) -> None:
        """The batch `idx` comes next: start decoding it."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedbroker-decode")
        chosen = idx.cpu().numpy()
        self._ahead.append((chosen, self._pool.submit(self.decode, chosen)))

    def get(self, idx: torch.Tensor) -> Decoded:
        """The decoded batch `idx`."""
        chosen = idx.cpu().numpy()
        at = next((i for i, (told, _) in enumerate(self._ahead) if np.array_equal(told, chosen)), None)
        if at is None:
            return self.decode(chosen)
        for _ in range(at):   # told of before it but never asked for: dropped
            self._ahead.popleft()[1].cancel()
        return self._ahead.popleft()[1].result()

    def close(self) -> None:
        """Drop what was decoded ahead and stop the thread."""
        for _, future in self._ahead:
            future.cancel()
        self._ahead.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class Batches:
    """`fetch(idx)`: the batch `idx` on the device, prepared and augmented; `prefetch(idx)` (streamed samples
    only, else None): the next batch to decode ahead. `close()` stops the decoding thread."""

    def __init__(self, x: torch.Tensor | FileSamples, y: torch.Tensor | FileSamples, *,
                 pipeline: DataPipeline | None, device: torch.device, generator: torch.Generator,
                 cache: str = "") -> None:
        """`x`: the features (a tensor in memory, or files); `y`: the labels as the task's loss takes them (a tensor),
        or masks on files."""
        self.device, self.pipeline, self.generator = device, pipeline, generator
        self.augments = pipeline is not None and bool(pipeline.augment)
        self.prefetcher: Prefetcher | None = None
        self.prefetch: Callable[[torch.Tensor], None] | None = None
        self.x_mem: torch.Tensor | None = None
        self.y_mem = None if isinstance(y, FileSamples) else y.to(device)
        # masks: on files, or in memory one int64 value per pixel (they move with their images)
        self.mask = isinstance(y, FileSamples) or (y.dtype == torch.int64 and y.dim() == len(x.shape) - 1)
        if isinstance(x, torch.Tensor) and not isinstance(y, FileSamples):
            if pipeline is not None and pipeline.preprocess:   # in memory: prepared once, before training
                every = np.arange(len(x))
                x = torch.from_numpy(batch_reader(x.numpy(), pipeline, mask=False)(every))
                if self.mask:
                    y = torch.from_numpy(batch_reader(y.numpy(), pipeline, mask=True)(every))
            self.x_mem, self.y_mem = x.to(device), y.to(device)
            return
        read_x = batch_reader(x if isinstance(x, FileSamples) else x.numpy(), pipeline, mask=False, cache=cache)
        read_y = batch_reader(y, pipeline, mask=True, cache=cache) if isinstance(y, FileSamples) else None

        def decode(idx: np.ndarray) -> Decoded:
            return read_x(idx), (read_y(idx) if read_y is not None else None)

        self.prefetcher = Prefetcher(decode)
        self.prefetch = self.prefetcher.tell

    def fetch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch `idx` (indices into the samples) on the device."""
        if self.prefetcher is None:
            assert self.x_mem is not None and self.y_mem is not None
            xb, yb = self.x_mem[idx], self.y_mem[idx]
        else:
            xs, ms = self.prefetcher.get(idx)
            xb = torch.from_numpy(np.ascontiguousarray(xs, dtype=np.float32)).to(self.device)
            if ms is not None:
                yb = torch.from_numpy(np.ascontiguousarray(ms, dtype=np.int64)).to(self.device)
            else:
                assert self.y_mem is not None
                yb = self.y_mem[idx.to(self.y_mem.device)]
        if not self.augments:
            return xb, yb
        from fedbroker.datasets.transforms import augment

        assert self.pipeline is not None
        xa, ya = augment(self.pipeline, xb, yb if self.mask else None, generator=self.generator)
        return xa, (ya if self.mask and ya is not None else yb)

    def close(self) -> None:
        """Stop the decoding thread (drops batches decoded ahead)."""
        if self.prefetcher is not None:
            self.prefetcher.close()
