"""A global model as a worker receives it (spec JSON and weights), built and checked against this worker's data:
the same steps before training a round and before scoring one, so both refuse a model for the same reasons."""

from __future__ import annotations

import json

import numpy as np
from torch import nn

from fedbroker.job.spec import ModelSpec, parse_model
from fedbroker.model import build_model, load_numpy_state
from fedbroker.rpc.aggregation_client import Model


def build_global(global_model: Model) -> tuple[ModelSpec, nn.Module]:
    """The model's spec and torch module; ValueError naming the version when it cannot be built."""
    version, spec_json, weights = global_model
    try:
        spec = parse_model(json.loads(spec_json))
        model = build_model(spec)
        load_numpy_state(model, weights)
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise ValueError(f"the global model {version} cannot be built: {exc}") from None
    return spec, model


def fit_problem(spec: ModelSpec, x: np.ndarray, num_classes: int, *, holder: str) -> str:
    """Why the model cannot take these samples ("" when it can): torch would fail on the first batch, and no
    retry changes that. `holder` names whose data it is in the message ("this worker's data")."""
    sample_shape = tuple(int(d) for d in x.shape[1:])
    if tuple(spec.input_shape) != sample_shape:
        return (f"model.input_shape {list(spec.input_shape)} does not fit {holder}, whose samples have shape "
                f"{list(sample_shape)}")
    if spec.num_outputs < num_classes:
        return f"the model outputs {spec.num_outputs} class scores but {holder} has {num_classes} classes"
    return ""
