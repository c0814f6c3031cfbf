"""A global model as a worker receives it (spec JSON and weights), built and checked against this worker's data:
the same steps before training a round and before scoring one, so both refuse a model for the same reasons."""

from __future__ import annotations

import json

import numpy as np
from torch import nn

from fedbroker.job.spec import ModelSpec, output_shapes, parse_model
from fedbroker.job.task import TaskConfig
from fedbroker.model import build_model, load_numpy_state
from fedbroker.rpc.aggregation_client import Model


def build_global(global_model: Model) -> tuple[ModelSpec, nn.Sequential]:
    """The model's spec and torch module; ValueError naming the version when it cannot be built."""
    version, spec_json, weights = global_model
    try:
        spec = parse_model(json.loads(spec_json))
        model = build_model(spec)
        load_numpy_state(model, weights)
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise ValueError(f"the global model {version} cannot be built: {exc}") from None
    return spec, model


# The label kind (worker.data.labels) each task trains on.
TASK_LABELS = {"classification": "class", "multilabel": "multilabel", "regression": "target", "segmentation": "mask"}


def fit_problem(spec: ModelSpec, x: np.ndarray, num_classes: int, *, holder: str, task: TaskConfig | None = None,
                labels: str = "class") -> str:
    """Why the model cannot take these samples ("" when it can): torch would fail on the first batch, and no
    retry changes that. `holder` names whose data it is in the message ("this worker's data"); `labels` is the
    kind of its labels, which must be the one `task` trains on (`num_classes`: its classes, labels or targets)."""
    sample_shape = tuple(int(d) for d in x.shape[1:])
    task = task or TaskConfig()
    if tuple(spec.input_shape) != sample_shape:
        return (f"model.input_shape {list(spec.input_shape)} does not fit {holder}, whose samples have shape "
                f"{list(sample_shape)}")
    if TASK_LABELS[task.type] != labels:
        return (f"the job's task is {task.type}, which trains on {TASK_LABELS[task.type]} labels, but {holder} holds "
                f"{labels} labels (worker.data.labels)")
    output = output_shapes(spec)[-1]
    if task.type == "segmentation":
        return "" if num_classes <= output[0] else (f"the model outputs {output[0]} classes per pixel but {holder} "
                                                    f"has masks of {num_classes} classes")
    if task.type != "classification":
        return "" if output == (num_classes,) else (f"the model outputs {list(output)} but {holder} has "
                                                    f"{num_classes} {labels} values per sample")
    if spec.num_outputs < num_classes:
        return f"the model outputs {spec.num_outputs} class scores but {holder} has {num_classes} classes"
    return ""
