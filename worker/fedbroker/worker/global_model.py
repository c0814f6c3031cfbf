"""A global model as a worker receives it (spec JSON and weights), built and checked against this worker's data
and its limits: the same steps before training a round and before scoring one, so both refuse a model for the
same reasons."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from torch import nn

from fedbroker.config import LimitsSection
from fedbroker.datasets.volumes.geometry import geometry_problems
from fedbroker.errors import ConfigError, ModelOverLimits
from fedbroker.job.model_spec import model_bounds
from fedbroker.job.pipeline import DataPipeline
from fedbroker.job.spec import ModelSpec, output_shapes, parse_model
from fedbroker.job.task import TaskConfig
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


# The label kind (worker.data.labels) each task trains on.
TASK_LABELS = {"classification": "class", "multilabel": "multilabel", "regression": "target", "segmentation": "mask"}


def fit_problem(spec: ModelSpec, x: Any, num_classes: int, *, holder: str, task: TaskConfig | None = None,
                labels: str = "class", pipeline: DataPipeline | None = None) -> str:
    """Why the model cannot take these samples ("" when it can): torch would fail on the first batch, and no
    retry changes that. `holder` names whose data it is in the message ("this worker's data"); `labels` is the
    kind of its labels, which must be the one `task` trains on (`num_classes`: its classes, labels or targets).
    With the job's data `pipeline`, the samples are taken as it prepares them (a size of 0: files that differ),
    and volumes must meet its `expect` (spacing, orientation; counted, files unnamed: the reason leaves the site)."""
    sample_shape = tuple(int(d) for d in x.shape[1:])
    task = task or TaskConfig()
    if pipeline is not None:
        try:
            prepared = pipeline.output_shape(sample_shape)
        except ConfigError as exc:
            return f"the job's data pipeline cannot take {holder}, whose samples have shape {list(sample_shape)}: {exc}"
        if tuple(spec.input_shape) != prepared:
            return (f"model.input_shape {list(spec.input_shape)} does not fit {holder}, whose samples the job's data "
                    f"pipeline prepares to shape {list(prepared)}")
    elif tuple(spec.input_shape) != sample_shape:
        return (f"model.input_shape {list(spec.input_shape)} does not fit {holder}, whose samples have shape "
                f"{list(sample_shape)}")
    misfits = geometry_problems(getattr(x, "geometries", ()), pipeline.expect if pipeline is not None else None,
                                name_files=False)
    if misfits:
        return f"{holder} does not meet the job's data.expect: " + "; ".join(p.problem for p in misfits)
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
    return token_problem(spec, x, holder=holder) if isinstance(x, np.ndarray) else ""


def token_problem(spec: ModelSpec, x: np.ndarray, *, holder: str) -> str:
    """Why samples are not token ids of the model's Embedding ("" when they are, or the model reads no ids): each
    feature must be a whole number in [0, num_embeddings). Neither the value nor the sample is named: the
    message may leave the site, and a feature is a datum."""
    first = spec.layers[0] if spec.layers else None
    if first is None or first.type != "Embedding" or not len(x):
        return ""
    vocabulary = int(first.params["num_embeddings"])
    values = np.asarray(x)
    if not np.issubdtype(values.dtype, np.number) or not np.isfinite(values).all() \
            or (values != np.round(values)).any() or values.min() < 0 or values.max() >= vocabulary:
        return (f"model.layers[0] is an Embedding that reads the input as token ids, but {holder} holds features "
                f"that are not whole numbers in [0, {vocabulary}) (num_embeddings)")
    return ""
