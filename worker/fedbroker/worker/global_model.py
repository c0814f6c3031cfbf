"""A global model as a worker receives it (spec JSON and weights), built and checked against this worker's data
and its limits: the same steps before training a round and before scoring one, so both refuse a model for the
same reasons."""

from __future__ import annotations

import json

import numpy as np
from torch import nn

from fedbroker.config import LimitsSection
from fedbroker.errors import ModelOverLimits
from fedbroker.job.model_spec import model_bounds
from fedbroker.job.spec import ModelSpec, parse_model
from fedbroker.model import build_model, load_numpy_state
from fedbroker.rpc.aggregation_client import Model
from fedbroker.weights.adapters import planned_model
from fedbroker.weights.plan import ModelPlan
from fedbroker.weights.start import frozen_digest


def limits_problem(spec: ModelSpec, limits: LimitsSection) -> str:
    """Why the model is over the site's ceilings, with its figures and the ceilings ("" when it is not)."""
    bounds = model_bounds(spec)
    over = [f"{what} {value:,} > {name} {ceiling:,}" for what, value, name, ceiling in (
        ("parameters", bounds.parameters, "max_parameters", limits.max_parameters),
        ("activation bytes per sample", bounds.activation_bytes, "max_activation_bytes", limits.max_activation_bytes),
        ("FLOPs per sample", bounds.flops, "max_flops", limits.max_flops)) if ceiling and value > ceiling]
    return f"the model is over this site's worker.limits: {'; '.join(over)}" if over else ""


def build_global(global_model: Model, plan: ModelPlan | None = None, *, limits: LimitsSection | None = None,
                 start_digest: str = "") -> tuple[ModelSpec, nn.Module]:
    """The model's spec and torch module, with the job's plan applied (adapters in place, what does not train
    frozen); ValueError naming the version when it cannot be built, or when its frozen tensors are not the
    start weights the job's settings pin (`start_digest`: a server that sent this site other weights);
    ModelOverLimits (before anything is built) when it is over `limits`."""
    version, spec_json, weights = global_model
    plan = plan or ModelPlan()
    try:
        spec = parse_model(json.loads(spec_json))
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"the global model {version} cannot be built: {exc}") from None
    problem = limits_problem(spec, limits) if limits is not None else ""
    if problem:
        raise ModelOverLimits(problem)
    try:
        model = build_model(spec) if plan == ModelPlan() else planned_model(spec, plan)
        load_numpy_state(model, weights)
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise ValueError(f"the global model {version} cannot be built: {exc}") from None
    if start_digest:
        got = frozen_digest(weights, spec, plan)
        if got != start_digest:
            raise ValueError(f"the global model {version}'s frozen tensors have digest {got[:16]}…, the job's "
                             f"settings pin {start_digest[:16]}…: these are not the job's start weights")
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
