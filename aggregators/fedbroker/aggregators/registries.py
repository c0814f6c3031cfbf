"""Builds a job's algorithms by registry name, once, so a bad name or parameter fails at submission.

`accept_job` and `accept_job_text` are where a job is accepted (the coordinator's SubmitJob, the CLI): the
kernel's parser plus the checks only the algorithm registries can make, every problem reported at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from fedbroker.aggregators.alignment import ALIGNMENT, Alignment
from fedbroker.aggregators.fedbuff import staleness_function
from fedbroker.aggregators.network import alignment_problems
from fedbroker.aggregators.registry import Registry
from fedbroker.aggregators.selection import SELECTION, GeneticSelection, Selector
from fedbroker.aggregators.weighting import WEIGHTING, Weighting
from fedbroker.aggregators.weighting.fedavg import FedAvgWeighting, UniformWeighting
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.spec import (
    EVALUATION_SETS,
    AggregationConfig,
    JobSpec,
    ModelSpec,
    ScheduleConfig,
    job_from_text,
    output_shapes,
    parse_job,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Algorithms:
    alignment_name: str
    alignment: Alignment
    weighting: Weighting
    selection_name: str
    selection: Selector

    @property
    def weights_positive(self) -> bool:
        """FedAvg and uniform weights are > 0 for every valid update; DWFed's may all be 0."""
        return isinstance(self.weighting, (FedAvgWeighting, UniformWeighting))

    @property
    def incremental(self) -> bool:
        """True when every accepted update can be folded into a running mean and then dropped (not when a
        `max_share` cap makes the coefficients depend on the whole round)."""
        return self.alignment_name == "none" and self.selection_name == "all" and self.weighting.proportional


def _create(registry: Registry[T], name: str, params: Mapping[str, Any], errors: list[ConfigError]) -> T | None:
    try:
        return registry.create(name, params)
    except ConfigError as exc:
        errors.append(exc)
        return None


def build_algorithms(config: AggregationConfig) -> Algorithms:
    """Raises every bad name or parameter of the three algorithms at once."""
    errors: list[ConfigError] = []
    alignment = _create(ALIGNMENT, config.alignment, config.alignment_params, errors)
    weighting = _create(WEIGHTING, config.weighting, config.weighting_params, errors)
    selection = _create(SELECTION, config.selection, config.selection_params, errors)
    if alignment is None or weighting is None or selection is None:
        raise errors[0] if len(errors) == 1 else ConfigErrors(errors)
    return Algorithms(alignment_name=config.alignment, alignment=alignment, weighting=weighting,
                      selection_name=config.selection, selection=selection)


def job_problems(*, aggregation: AggregationConfig, model: ModelSpec) -> list[ConfigError]:
    """What the algorithm registries refuse in a job: an unknown algorithm or parameter, or an alignment
    that cannot align its model. A `fedbroker.spec.JobCheck`: parse_job reports these with its own."""
    problems: list[ConfigError] = []
    try:
        algorithms = build_algorithms(aggregation)
    except ConfigErrors as exc:
        problems.extend(exc.errors)
    except ConfigError as exc:
        problems.append(exc)
    else:
        problems.extend(_probe_problems(algorithms.selection, model))
    if aggregation.alignment != "none" and model.layers:
        problems.extend(ConfigError("aggregation.alignment", f"{aggregation.alignment} cannot align this model: {p}")
                        for p in alignment_problems(model))
    return problems


def _probe_problems(selection: Selector, model: ModelSpec) -> list[ConfigError]:
    """A probe set the model cannot read (its samples are not the model's input, or it has more classes
    than the model has outputs) would fail every GA round: refuse it at submission."""
    dataset = selection.probe_dataset if isinstance(selection, GeneticSelection) else ""
    if not dataset or not model.layers:
        return []
    try:
        shapes = output_shapes(model)
    except ConfigError:  # the model's own problems are reported where it is parsed
        return []
    sample, classes = EVALUATION_SETS[dataset]
    field = "aggregation.selection_params.probe_dataset"
    if tuple(model.input_shape) != sample:
        return [ConfigError(field, f"{dataset!r} has samples of shape {list(sample)} but model.input_shape is "
                                   f"{list(model.input_shape)}")]
    if shapes and (len(shapes[-1]) != 1 or shapes[-1][0] < classes):
        return [ConfigError(field, f"{dataset!r} has {classes} classes but the model outputs {list(shapes[-1])}")]
    return []


def accept_job(raw: object) -> JobSpec:
    """A job given as a mapping (parsed YAML/JSON), validated in full; raises ConfigError(s) naming each bad field."""
    job = parse_job(raw, check=job_problems)
    schedule_problem(job.schedule)
    return job


def schedule_problem(schedule: ScheduleConfig) -> None:
    """An async job's staleness function and its parameters (raises the ConfigError naming the field)."""
    if schedule.mode == "async":
        staleness_function(schedule.staleness, schedule.staleness_params)


def accept_job_text(text: str) -> JobSpec:
    """A job given as YAML or JSON text, validated in full (see accept_job)."""
    job = job_from_text(text, check=job_problems)
    schedule_problem(job.schedule)
    return job
