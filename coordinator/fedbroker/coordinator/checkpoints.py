"""Global-model checkpoints as safetensors files: raw arrays behind a JSON header, nothing that can run code.

A checkpoint's string metadata holds its format, job, round, model spec and the tensors' order (safetensors
lays tensors out in its own order; the model's order is what gets streamed and hashed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import safetensors.numpy
from safetensors import SafetensorError, safe_open

from fedbroker.files import write_atomic

FORMAT = "fedbroker-checkpoint/1"
SUFFIX = ".safetensors"


def save_checkpoint(directory: str | os.PathLike[str], job_id: str, round_number: int,
                    tensors: Mapping[str, np.ndarray], model_spec_json: str) -> str:
    """Write atomically (`write_atomic`) so a crash never leaves a half checkpoint behind; returns its path."""
    folder = Path(directory) / job_id
    Path(directory).mkdir(mode=0o700, parents=True, exist_ok=True)  # owner-only, like the files (0600)
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / f"round-{round_number:05d}{SUFFIX}"
    metadata = {"format": FORMAT, "job_id": job_id, "round": str(round_number),
                "model_spec_json": model_spec_json, "tensors": json.dumps(list(tensors))}
    write_atomic(path, safetensors.numpy.save({name: np.ascontiguousarray(arr) for name, arr in tensors.items()},
                                              metadata=metadata))
    return str(path)


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], str]:
    """(tensors in the model's order, model spec JSON); raises ValueError on a file that is not a checkpoint."""
    try:
        with safe_open(str(path), framework="numpy") as fh:
            metadata = fh.metadata() or {}
            loaded = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118 (a reader, not a dict)
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a safetensors checkpoint ({exc})") from None
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{path}: not a checkpoint of format {FORMAT!r}")
    order = json.loads(metadata["tensors"])
    if sorted(order) != sorted(loaded):
        raise ValueError(f"{path}: the tensors listed in its metadata are not the tensors it holds")
    spec_json = metadata["model_spec_json"]
    json.loads(spec_json)
    return {name: loaded[name] for name in order}, spec_json


def checkpoints_of(directory: str | os.PathLike[str], job_id: str) -> list[Path]:
    """A job's checkpoints, oldest round first."""
    folder = Path(directory) / job_id
    return sorted(folder.glob(f"round-*{SUFFIX}"))
