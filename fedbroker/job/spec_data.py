"""A job's `data` section: how the sites' inputs are preprocessed, so that the model carries its preprocessing.

`standardize: federated` has the sites agree, before round 1, on one mean and std per flattened input feature
from their sums, sums of squares and counts (each site releases them under its own DP policy); the
coordinator then puts a `standardize` layer holding them in front of the job's model, so every site trains,
and the downloaded model is applied, on inputs standardised the same way. The statistics are computed on the
values clipped to `bounds` (which also fix the sensitivity of each site's release), so bounds are required:
`[lo, hi]` for every feature, or one `[lo, hi]` per flattened input feature.

`preprocess`, `augment` and `expect` are the job's data pipeline (fedbroker.job.pipeline): preprocessing and
augmentation of images and volumes, applied on the sites; absent, the section is what it was before them.

Kept apart from `fedbroker.job.spec` (which imports it) so that the parser stays within its file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.pipeline import FIELDS as PIPELINE_FIELDS
from fedbroker.job.pipeline import SIZE_STEPS, DataPipeline, parse_pipeline

STANDARDIZE = ("none", "federated")
STANDARDIZE_LAYER = "standardize"   # the layer type `standardize: federated` puts in front of the model
_FIELDS = ("standardize", "bounds", *PIPELINE_FIELDS)

Bounds = tuple[tuple[float, float], ...]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    try:
        return _number(value) and math.isfinite(float(value))
    except OverflowError:  # an integer no float holds
        return False


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class DataConfig:
    """The job's preprocessing; `bounds`: one (lo, hi) for every feature, or one per flattened input feature
    (empty: none given)."""

    standardize: str = "none"
    bounds: Bounds = ()
    pipeline: DataPipeline = field(default_factory=DataPipeline)   # preprocess, augment, expect (empty: none)

    def __post_init__(self) -> None:
        problems = section_problems(self.standardize, self.bounds)
        if len(problems) == 1:
            raise problems[0]
        if problems:
            raise ConfigErrors(problems)

    def to_dict(self) -> dict[str, Any]:
        """The section as a job writes it (one pair as `[lo, hi]`)."""
        out: dict[str, Any] = {"standardize": self.standardize}
        if len(self.bounds) == 1:
            out["bounds"] = list(self.bounds[0])
        elif self.bounds:
            out["bounds"] = [list(pair) for pair in self.bounds]
        return {**out, **self.pipeline.to_dict()}

    def feature_bounds(self, features: int) -> tuple[list[float], list[float]]:
        """(lower, upper), one value each per feature (the given pair repeated when there is one)."""
        pairs = list(self.bounds) * features if len(self.bounds) == 1 else list(self.bounds)
        return [float(lo) for lo, _ in pairs], [float(hi) for _, hi in pairs]


def section_problems(standardize: Any, bounds: Sequence[Any]) -> list[ConfigError]:
    """Every problem of the section on its own, each naming its field (`data.<field>`, `data.bounds[i]`)."""
    out: list[ConfigError] = []
    if standardize not in STANDARDIZE:
        hint = " ('site' is a site's own setting: worker data.standardize)" if standardize == "site" else ""
        out.append(ConfigError("data.standardize", f"must be 'none' or 'federated', got {_show(standardize)}{hint}"))
    elif standardize == "federated" and not bounds:
        out.append(ConfigError("data.bounds", "is required with standardize federated: [lo, hi] for every feature, "
                                              "or one [lo, hi] per input feature (the sites' statistics are "
                                              "computed on values clipped to them)"))
    elif standardize == "none" and bounds:
        out.append(ConfigError("data.bounds", "applies only with standardize federated"))
    for i, pair in enumerate(bounds):
        problem = _pair_problem(pair)
        if problem:
            out.append(ConfigError("data.bounds" if len(bounds) == 1 else f"data.bounds[{i}]", problem))
    return out


def _pair_problem(pair: Any) -> str:
    """What is wrong with one [lo, hi] ("" when nothing)."""
    if (isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2
            or not all(_finite(v) for v in pair)):
        return f"must be [lo, hi], two finite numbers, got {_show(pair)}"
    if not pair[0] < pair[1]:
        return f"lo must be below hi, got [{pair[0]:g}, {pair[1]:g}]"
    return ""


class _Layer(Protocol):
    @property
    def type(self) -> str: ...


class _Model(Protocol):  # fedbroker.job.spec.ModelSpec, which this module cannot import (spec imports it)
    @property
    def input_shape(self) -> tuple[int, ...]: ...
    @property
    def layers(self) -> Sequence[_Layer]: ...


def parse_data(raw: Any, errors: list[ConfigError], model: _Model) -> DataConfig:
    """The `data` section of a job (absent or null: the defaults) for `model`; every problem of it, alone and
    with the model (`data_problems`), is added to `errors` (the defaults come back for wrong values)."""
    data = _parse_data(raw, errors)
    errors.extend(data_problems(data, model))
    return data


def _parse_data(raw: Any, errors: list[ConfigError]) -> DataConfig:
    if raw is None:
        return DataConfig()
    if not isinstance(raw, Mapping):
        errors.append(ConfigError("data", f"must be a mapping, got {type(raw).__name__}"))
        return DataConfig()
    errors.extend(ConfigError(f"data.{key}", f"unknown field; known: {', '.join(_FIELDS)}")
                  for key in sorted(set(raw) - set(_FIELDS)))
    pipeline = DataPipeline()
    try:
        pipeline = parse_pipeline({k: v for k, v in raw.items() if k in PIPELINE_FIELDS})
    except ConfigErrors as exc:
        errors.extend(exc.errors)
    except ConfigError as exc:
        errors.append(exc)
    standardize, given = raw.get("standardize", "none"), raw.get("bounds")
    items: list[Any] = []
    if given is not None and (isinstance(given, str) or not isinstance(given, Sequence) or not given):
        errors.append(ConfigError("data.bounds", f"must be [lo, hi] or a list of [lo, hi], got {_show(given)}"))
        return DataConfig(pipeline=pipeline)
    if given is not None:
        items = [given] if all(_number(v) for v in given) else list(given)  # one pair: every feature
    problems = section_problems(standardize, items)
    errors.extend(problems)
    if problems:
        return DataConfig(pipeline=pipeline)
    return DataConfig(standardize=standardize, bounds=tuple((float(lo), float(hi)) for lo, hi in items),
                      pipeline=pipeline)


def data_problems(data: DataConfig, model: _Model) -> list[ConfigError]:
    """What the section cannot see alone: per-feature bounds must number the model's flattened input features,
    and a model that standardises itself must not be standardised again. (A model with problems of its own
    comes as one without layers or shape: nothing to check against.)"""
    input_shape, layer_types = model.input_shape, [layer.type for layer in model.layers]
    out: list[ConfigError] = []
    features = math.prod(input_shape) if input_shape else 0
    if len(data.bounds) > 1 and features and len(data.bounds) != features:
        out.append(ConfigError("data.bounds", f"has {len(data.bounds)} [lo, hi] pairs but the model takes "
                                              f"{features} input features (model.input_shape {list(input_shape)}): "
                                              f"give one [lo, hi] for all features, or one per feature"))
    if data.standardize == "federated" and getattr(model, "is_graph", False):
        out.append(ConfigError("data.standardize", "federated puts the agreed standardize layer in front of a chain "
                                                   "of layers; this model is a graph (model.nodes): use none or site"))
    if data.pipeline != DataPipeline():
        out += pipeline_model_problems(data, input_shape)
    if data.standardize == "federated" and layer_types and layer_types[0] == STANDARDIZE_LAYER:
        out.append(ConfigError("model.layers[0].type", "standardize federated puts the agreed standardize layer in "
                                                       "front of the model: remove this one, or set data.standardize "
                                                       "none"))
    return out



def pipeline_model_problems(data: DataConfig, input_shape: tuple[int, ...]) -> list[ConfigError]:
    """The pipeline against the model's input (C, *spatial): images or volumes only, the sizes and channels it
    sets are the model's, its augmentation fits the prepared shape; and no federated standardisation, whose
    statistics are of the raw features, beside it. (No shape: a model with problems of its own.)"""
    pipeline, out = data.pipeline, []
    if data.standardize == "federated":
        out.append(ConfigError("data.standardize", "federated agrees on statistics of the raw features; with "
                                                   "preprocess/augment use normalize (per_image or fixed mean/std)"))
    if not input_shape:
        return out
    if len(input_shape) not in (3, 4):
        return [*out, ConfigError("data", f"preprocess, augment and expect apply to images (C, H, W) and volumes "
                                          f"(C, D, H, W); model.input_shape is {list(input_shape)}")]
    rank = pipeline.spatial_rank
    if rank and rank != len(input_shape) - 1:
        return [*out, ConfigError("data", f"the pipeline is {rank}-D but model.input_shape {list(input_shape)} is "
                                          f"{len(input_shape) - 1}-D")]
    last_size = max((i for i, s in enumerate(pipeline.preprocess) if s.name in SIZE_STEPS), default=None)
    if last_size is not None:
        step = pipeline.preprocess[last_size]
        if tuple(step.args["size"]) != tuple(input_shape[1:]):
            out.append(ConfigError(f"data.preprocess[{last_size}].{step.name}", (
                f"makes samples of spatial size {list(step.args['size'])} but model.input_shape is "
                f"{list(input_shape)}")))
    channels = [(i, s.args["channels"]) for i, s in enumerate(pipeline.preprocess) if s.name == "channels"]
    if channels and channels[-1][1] != input_shape[0]:
        out.append(ConfigError(f"data.preprocess[{channels[-1][0]}].channels", (
            f"makes {channels[-1][1]} channels but model.input_shape {list(input_shape)} takes {input_shape[0]}")))
    if not out:  # the augmentation against the prepared shape, which is the model's input
        augment_only = DataPipeline(augment=pipeline.augment)
        out += augment_only.shape_problems(input_shape)
    return out


def evaluation_set_problems(data: DataConfig, dataset: str) -> list[ConfigError]:
    """The coordinator's evaluation sets are arrays it holds, never prepared by a job's pipeline: a job that
    preprocesses its sites' files is scored by the sites (evaluation.every)."""
    if dataset and data.pipeline.preprocess:
        return [ConfigError("evaluation.dataset", f"{dataset!r} is not prepared by the job's data.preprocess (the "
                                                  f"coordinator's sets are arrays); score the job on the sites "
                                                  f"(evaluation.every) instead")]
    return []
