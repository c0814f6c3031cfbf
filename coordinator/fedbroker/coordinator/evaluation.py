"""Global-model evaluation on the coordinator's held-out test split (when the job names a data set)."""

from __future__ import annotations

import json
import threading
from functools import lru_cache

import numpy as np

from fedbroker.datasets import Dataset, load_dataset, train_test_split
from fedbroker.evaluation import evaluate
from fedbroker.job.spec import JobSpec, parse_model
from fedbroker.model import build_model, load_numpy_state
from fedbroker.weights.plan import merge_adapters

_lock = threading.Lock()


@lru_cache(maxsize=8)
def test_split(name: str, test_fraction: float, seed: int, idx_dir: str | None = None) -> Dataset:
    """The held-out split of a data set, loaded once per (set, fraction, seed): every round evaluates on it."""
    data = load_dataset(name, idx_dir=idx_dir)
    return train_test_split(data, test_fraction=test_fraction, seed=seed)[1]


def evaluate_global(job: JobSpec, spec_json: str, tensors: dict[str, np.ndarray]) -> tuple[float, float] | None:
    """(accuracy, mean cross-entropy) of the global model, or None when the job has no evaluation set."""
    if not job.evaluation.dataset:
        return None
    with _lock:
        test = test_split(job.evaluation.dataset, job.evaluation.test_fraction, job.evaluation.split_seed)
    model = build_model(parse_model(json.loads(spec_json)))
    adapters = job.plan.adapters  # a LoRA job's global model is scored as the plain model it computes
    load_numpy_state(model, merge_adapters(tensors, adapters) if adapters is not None else tensors)
    return evaluate(model, test.x, test.y)
