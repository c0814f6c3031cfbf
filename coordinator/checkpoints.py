"""Global-model checkpoints as .npz files (numpy's zip of raw arrays; loaded with allow_pickle=False)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

SPEC_KEY = "__model_spec_json__"


def save_checkpoint(directory: str | os.PathLike[str], job_id: str, round_number: int,
                    tensors: Mapping[str, np.ndarray], model_spec_json: str) -> str:
    """Write atomically (temp file + rename) so a crash never leaves a half checkpoint behind."""
    folder = Path(directory) / job_id
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"round-{round_number:05d}.npz"
    tmp = folder / f".round-{round_number:05d}.npz.tmp"
    spec = np.frombuffer(model_spec_json.encode(), dtype=np.uint8)
    with open(tmp, "wb") as fh:
        np.savez(fh, **{SPEC_KEY: spec}, **{name: np.asarray(arr) for name, arr in tensors.items()})
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return str(path)


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], str]:
    with np.load(path, allow_pickle=False) as data:
        tensors = {name: data[name] for name in data.files if name != SPEC_KEY}
        spec_json = bytes(data[SPEC_KEY]).decode()
    json.loads(spec_json)
    return tensors, spec_json
