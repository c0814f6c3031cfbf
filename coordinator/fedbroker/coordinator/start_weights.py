"""A job's start weights at the coordinator: taken at submission, kept beside its checkpoints, and turned
into version 1 before its first round.

Who reads a start file: the data scientist's CLI reads `model.initial_weights.path` on their own machine and
sends the bytes with the submission; the coordinator never opens a path a job names (a job could name any
file of the coordinator's host). The coordinator checks the bytes against the SHA-256 the job pins before
anything parses them, then decodes them with `safetensors` (no pickle) and checks them against the model by
name, shape and finiteness. `model.from_job` names an earlier job: only one the submitter may read (the job
they submitted; any job with authentication off), only once it completed, its final checkpoint with its
adapters merged. An unknown id and another identity's job get the same answer, so the refusal tells nobody
which ids exist.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from fedbroker.coordinator.checkpoints import load_checkpoint
from fedbroker.coordinator.store import StateStore
from fedbroker.errors import ConfigError
from fedbroker.files import write_atomic
from fedbroker.job.spec import JobSpec, job_from_json, parameter_shapes
from fedbroker.job.status import JobStatus
from fedbroker.weights.plan import merge_adapters, raise_all
from fedbroker.weights.start import check_pin, decode, encode, start_problems

START_FILE = "start.safetensors"


def resolve_start(job: JobSpec, data: bytes, *, store: StateStore, caller: str | None) -> dict[str, np.ndarray] | None:
    """The checked start weights of a submitted job (None: the seeded random draw). `data` is the start file's
    bytes as the CLI sent them; `caller` the submitting identity (None with authentication off)."""
    plan = job.plan
    if data and plan.initial_weights is None:
        raise ConfigError("model.initial_weights", "the submission carries weights but the job pins no start file")
    if plan.initial_weights is not None:
        if not data:
            raise ConfigError("model.initial_weights", "the job pins a start file but the submission carries no "
                                                       "weights (`fedbroker submit` reads the file and sends them)")
        check_pin(data, sha256=plan.initial_weights.sha256)
        tensors, where = decode(data), "model.initial_weights"
    elif plan.from_job:
        tensors, where = final_model(store, plan.from_job, caller=caller), "model.from_job"
    else:
        return None
    shapes = parameter_shapes(job.model)
    raise_all(start_problems(shapes, tensors, where=where))
    return {name: tensors[name] for name in shapes}


def final_model(store: StateStore, job_id: str, *, caller: str | None) -> dict[str, np.ndarray]:
    """A completed job's final model, adapters merged; ConfigError naming model.from_job otherwise."""
    row = store.job(job_id)
    if row is None or (caller is not None and row.submitter != caller):
        raise ConfigError("model.from_job", f"no job {job_id!r} that {caller or 'you'} may read")
    if row.status != JobStatus.COMPLETED:
        raise ConfigError("model.from_job", f"job {job_id!r} is {row.status}: only a completed job's final model "
                                            f"can start another")
    last = store.last_checkpoint(job_id)
    if last is None or not last.checkpoint:
        raise ConfigError("model.from_job", f"job {job_id!r} completed without a checkpoint: no final model")
    tensors, _ = load_checkpoint(last.checkpoint)
    adapters = job_from_json(row.spec_json).plan.adapters
    return merge_adapters(tensors, adapters) if adapters is not None else tensors


def save_start(directory: str | os.PathLike[str], job_id: str, tensors: Mapping[str, np.ndarray]) -> None:
    """Keep a job's start weights beside its checkpoints (owner-only), for its first round and a restart."""
    folder = Path(directory) / job_id
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_atomic(folder / START_FILE, encode(tensors))


def load_start(directory: str | os.PathLike[str], job_id: str) -> dict[str, np.ndarray]:
    """The start weights `save_start` kept; ValueError when they are gone (the job cannot start as pinned)."""
    path = Path(directory) / job_id / START_FILE
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"job {job_id!r}: its start weights {str(path)!r} cannot be read ({exc.strerror})") from None
    return decode(data)
