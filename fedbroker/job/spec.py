"""Job specs: declarative JSON/YAML validated once, at the edge, into frozen objects.

A model is a list of layers from an allow-list (never code). Validation infers every layer's output
shape from the input shape, so a Linear whose `in_features` does not match what the previous layer
produces is refused at submission, naming the field, rather than crashing a worker in round 1.
All problems are reported at once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.model_spec import MAX_LAYERS as MAX_LAYERS
from fedbroker.job.model_spec import MAX_PARAMETERS as MAX_PARAMETERS
from fedbroker.job.model_spec import MAX_SPEC_BYTES as MAX_SPEC_BYTES
from fedbroker.job.model_spec import MAX_WIDTH as MAX_WIDTH
from fedbroker.job.model_spec import Collector, check_plain, is_int, show
from fedbroker.job.model_spec import LayerSpec as LayerSpec
from fedbroker.job.model_spec import ModelSpec as ModelSpec
from fedbroker.job.model_spec import matched_layers as matched_layers
from fedbroker.job.model_spec import output_shapes as output_shapes
from fedbroker.job.model_spec import parameter_shapes as parameter_shapes
from fedbroker.job.model_spec import parse_model as parse_model
from fedbroker.job.privacy import PrivacyConfig, parse_privacy
from fedbroker.job.spec_data import DataConfig, data_problems, evaluation_set_problems, parse_data
from fedbroker.job.task import TaskConfig, output_problems, parse_task
from fedbroker.job.yamltext import load_yaml
from fedbroker.tasks.scores import score_names, threshold_problem
from fedbroker.weights.plan import ModelPlan, parse_plan, plan_problems

MAX_ROUNDS = 100_000
# What one training step may ask of a worker's memory, in bytes: batch_size × (the input, every layer's
# output, and, for DP-SGD, one gradient per parameter per sample), 4 bytes each. Without it a 0.8 M-parameter
# model with a large batch asked workers for 170 GB and failed every round after admission.
MAX_STEP_BYTES = 8 << 30
# The data sets the coordinator can evaluate a global model on, with one sample's shape and the number of
# classes (fedbroker.datasets loads them; tests/kernel/test_submission_limits.py checks this table against it).
# The IDX sets (mnist, fashion_mnist) need files only the workers hold, so they are not evaluation sets.
EVALUATION_SETS: Mapping[str, tuple[tuple[int, ...], int]] = {
    "digits": ((1, 8, 8), 10), "breast_cancer": ((30,), 2), "wine": ((13,), 3), "iris": ((4,), 3),
}
# A job's name becomes part of its id, which names a checkpoint folder and a metric label: no path tricks.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # fullmatch: `$` would pass a trailing newline

class _Section:
    """A job section that checks itself when it is built, so `parse_job` and direct Python construction
    share one set of types and limits. `problems()` names every problem at once (`<SECTION>.<field>`);
    construction raises them as one ConfigError(s). A field's type is its default's (an int is accepted,
    and kept as a float, where a float is expected); a field without a default holds a mapping."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
    SECTION: ClassVar[str]
    LIMITS: ClassVar[Mapping[str, tuple[float, float]]] = {}   # field -> [lo, hi], both included
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {}       # field -> the allowed texts

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if type(f.default) is float and is_int(value):
                try:
                    object.__setattr__(self, f.name, float(value))
                except OverflowError:  # no float holds it: left as it is, for the limit check to refuse
                    pass
        _raise_all(self.problems())

    def problems(self) -> list[ConfigError]:
        out: list[ConfigError] = []
        for f in dataclasses.fields(self):
            where, value = f"{self.SECTION}.{f.name}", getattr(self, f.name)
            if f.default is dataclasses.MISSING:
                if not isinstance(value, Mapping):
                    out.append(ConfigError(where, f"must be a mapping, got {type(value).__name__}"))
                continue
            expected = type(f.default)
            if not (is_int(value) if expected is int else isinstance(value, expected)):
                out.append(ConfigError(where, f"must be {expected.__name__}, got {type(value).__name__} {show(value)}"))
            elif f.name in self.LIMITS:
                lo, hi = self.LIMITS[f.name]
                if not lo <= value <= hi or (isinstance(value, float) and not math.isfinite(value)):
                    out.append(ConfigError(where, f"must be in [{lo}, {hi}], got {show(value)}"))
            elif f.name in self.CHOICES and value not in self.CHOICES[f.name]:
                allowed = " or ".join(repr(c) for c in self.CHOICES[f.name])
                out.append(ConfigError(where, f"must be {allowed}, got {show(value)}"))
        return out


OPTIMIZERS = ("sgd", "adam")


@dataclass(frozen=True)
class TrainingConfig(_Section):
    """The job's local training settings, the only ones a worker trains with. `proximal_mu` > 0 turns
    FedAvg local training into FedProx; `momentum` applies to sgd only."""

    rounds: int = 5
    local_epochs: int = 1
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    proximal_mu: float = 0.0

    SECTION: ClassVar[str] = "training"
    LIMITS: ClassVar[Mapping[str, tuple[float, float]]] = {
        "rounds": (1, MAX_ROUNDS), "local_epochs": (1, 1000), "batch_size": (1, 65_536), "lr": (1e-8, 10.0),
        "momentum": (0.0, 0.999), "proximal_mu": (0.0, 100.0),
    }
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {"optimizer": OPTIMIZERS}

    def problems(self) -> list[ConfigError]:
        """Every problem of the section, each naming its field."""
        out = super().problems()
        if (not any(e.field in ("training.optimizer", "training.momentum") for e in out)
                and self.momentum and self.optimizer != "sgd"):
            out.append(ConfigError("training.momentum", f"applies to sgd only, not {self.optimizer}"))
        return out


@dataclass(frozen=True)
class AggregationConfig(_Section):
    """The algorithms' names and parameters as the job writes them (what is stored and sent to the services);
    their typed, checked view is `fedbroker.algorithms.catalogue.aggregation_settings`."""

    alignment: str = "none"
    alignment_params: Mapping[str, Any] = field(default_factory=dict)
    weighting: str = "fedavg"
    weighting_params: Mapping[str, Any] = field(default_factory=dict)
    selection: str = "all"
    selection_params: Mapping[str, Any] = field(default_factory=dict)
    robust: str = "none"            # a robust rule over the individual updates (median, multi_krum, ...)
    robust_params: Mapping[str, Any] = field(default_factory=dict)
    secure: bool = False            # SecAgg+: the service learns only the round's sum (linear rules, sync mode)
    max_update_value: float = 0.0   # no uploaded value may exceed this in magnitude; 0 = derived from the model
    secure_group_size: int = 0      # secure + robust: a robust rule over the secure sums of groups of ≥ this many

    SECTION: ClassVar[str] = "aggregation"
    # at most 1e20: a round's float32 running sum of such values, weighted by sample counts, stays finite
    LIMITS: ClassVar[Mapping[str, tuple[float, float]]] = {"max_update_value": (0.0, 1e20),
                                                             "secure_group_size": (0, 100_000)}

    def __post_init__(self) -> None:
        # `alignment: {name: nafi, mode: layerwise}` is the name and its parameters in one: kept as the two fields
        if isinstance(self.alignment, Mapping) and isinstance(self.alignment.get("name"), str) \
                and isinstance(self.alignment_params, Mapping) and not set(self.alignment) & set(self.alignment_params):
            params = {key: value for key, value in self.alignment.items() if key != "name"}
            object.__setattr__(self, "alignment_params", {**self.alignment_params, **params})
            object.__setattr__(self, "alignment", self.alignment["name"])
        super().__post_init__()

    def problems(self) -> list[ConfigError]:
        """The section's problems; an alignment written as a mapping needs its `name`, and may not give a
        parameter twice (there and in alignment_params)."""
        if not isinstance(self.alignment, Mapping):
            return super().problems()
        out = [e for e in super().problems() if e.field != "aggregation.alignment"]
        if not isinstance(self.alignment.get("name"), str):
            out.append(ConfigError("aggregation.alignment.name", f"is required when alignment is a mapping (e.g. "
                                                                 f"{{name: nafi, mode: layerwise}}), got "
                                                                 f"{show(self.alignment.get('name'))}"))
        if isinstance(self.alignment_params, Mapping):
            out.extend(ConfigError(f"aggregation.alignment.{key}", "is also given in alignment_params")
                       for key in sorted(set(self.alignment) & set(self.alignment_params)))
        return out


SCHEDULE_MODES = ("sync", "async")
STALENESS_FUNCTIONS = ("constant", "polynomial", "hinge")   # their parameters: fedbroker.algorithms.params


@dataclass(frozen=True)
class ScheduleConfig(_Section):
    """The asynchronous mode's and the rounds' schedule: how many workers, how long, how stale."""

    clients_per_round: int = 0      # 0 = every registered worker of the category
    quorum: int = 0                 # uploads that close a round early; 0 = every selected worker
    min_clients: int = 1            # the fewest uploads a round may close with at its deadline
    min_workers: int = 1            # registered workers needed before round 1 starts
    round_timeout_s: float = 600.0
    wait_for_workers_s: float = 120.0
    # Asynchronous mode (FedBuff, docs/algorithms.md): training.rounds counts global versions instead.
    mode: str = "sync"              # sync | async
    buffer_size: int = 0            # async: updates per new version; 0 = every worker the job starts with
    max_staleness: int = 10         # async: versions an update may lag before it is refused (`stale`)
    staleness: str = "polynomial"   # async: constant | polynomial | hinge
    staleness_params: Mapping[str, Any] = field(default_factory=dict)
    server_lr: float = 1.0          # async: η_g
    time_budget_s: float = 0.0      # async: the job ends after this much wall-clock time (0 = no limit)

    SECTION: ClassVar[str] = "schedule"
    LIMITS: ClassVar[Mapping[str, tuple[float, float]]] = {
        "clients_per_round": (0, 100_000), "quorum": (0, 100_000), "min_clients": (1, 100_000),
        "min_workers": (1, 100_000), "round_timeout_s": (0.1, 7 * 86400), "wait_for_workers_s": (0.0, 7 * 86400),
        "buffer_size": (0, 100_000), "max_staleness": (0, 1000), "server_lr": (1e-6, 100.0),
        "time_budget_s": (0.0, 365 * 86400),
    }
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {"mode": SCHEDULE_MODES, "staleness": STALENESS_FUNCTIONS}

    def problems(self) -> list[ConfigError]:
        """The section's own problems, and min_clients against clients_per_round."""
        out = super().problems()
        if (not any(e.field in ("schedule.clients_per_round", "schedule.min_clients") for e in out)
                and self.clients_per_round and self.min_clients > self.clients_per_round):
            out.append(ConfigError("schedule.min_clients",
                                   f"{self.min_clients} exceeds clients_per_round {self.clients_per_round}"))
        return out


@dataclass(frozen=True)
class EvaluationConfig(_Section):
    """The coordinator's held-out test split (checked with the model at submission: `cross_section_problems`)
    and federated evaluation: every `every`-th round (async: version) the sites score the global model on their
    own held-out splits (docs/evaluation.md); `patience` > 0 ends a job whose score stops improving."""

    dataset: str = ""               # "" = the coordinator holds no evaluation set
    test_fraction: float = 0.2
    split_seed: int = 0
    every: int = 1                  # federated evaluation after every k-th round (and the last); 0 = none
    sites: str = "participants"     # the round's selected sites, or every active site of the category
    patience: int = 0               # evaluated rounds without a better score before the job ends; 0 = never
    score: str = ""                 # the federated score that picks the best round and stops early ("": the task's)
    threshold: float = 0.5          # where sensitivity/specificity (and multilabel F1) are read: a bin edge

    SECTION: ClassVar[str] = "evaluation"
    LIMITS: ClassVar[Mapping[str, tuple[float, float]]] = {"test_fraction": (0.01, 0.9), "split_seed": (0, 2**32 - 1),
                                                           "every": (0, MAX_ROUNDS), "patience": (0, MAX_ROUNDS),
                                                           "threshold": (0.0, 1.0)}
    CHOICES: ClassVar[Mapping[str, tuple[str, ...]]] = {"dataset": ("", *EVALUATION_SETS),
                                                        "sites": ("participants", "category")}


@dataclass(frozen=True)
class JobSpec:
    """A whole job, checked as a whole when it is built."""

    name: str
    category: str
    model: ModelSpec
    training: TrainingConfig
    aggregation: AggregationConfig
    schedule: ScheduleConfig
    evaluation: EvaluationConfig
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)  # preprocessing (fedbroker.job.spec_data)
    task: TaskConfig = field(default_factory=TaskConfig)  # what is predicted (fedbroker.job.task)
    plan: ModelPlan = field(default_factory=ModelPlan)    # start weights, freezing, adapters (fedbroker.weights)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)  # DP the round carries (fedbroker.job.privacy)

    def __post_init__(self) -> None:
        _raise_all(_identity_problems(self.name, self.category, self.seed)
                   or cross_section_problems(model=self.model, training=self.training, evaluation=self.evaluation,
                                             task=self.task)
                   or mode_problems(schedule=self.schedule, aggregation=self.aggregation) or data_problems(self.data, self.model)
                   or self.privacy.problems(secure=self.aggregation.secure, mode=self.schedule.mode,
                                         group_size=self.aggregation.secure_group_size))

    def to_dict(self) -> dict[str, Any]:
        """The job as plain data (its model as a job writes it)."""
        out = {**asdict(self), "model": {**self.model.to_dict(), **self.plan.to_dict()}, "data": self.data.to_dict(),
               "task": self.task.to_dict(), "privacy": self.privacy.to_dict()}
        del out["plan"]
        if not out["privacy"]:
            del out["privacy"]
        return out

    def to_json(self) -> str:
        """The job's one wire form (the coordinator's store)."""
        return json.dumps(self.to_dict(), sort_keys=True)


_SECTIONS = ("name", "category", "model", "training", "aggregation", "schedule", "evaluation", "seed", "data", "task",
             "privacy")


_S = TypeVar("_S", bound=_Section)


def _section(errors: Collector, raw: Mapping[str, Any], name: str, cls: type[_S]) -> _S:
    """Section `name` of `raw` as a `cls`; its problems go to `errors` (and the defaults come back)."""
    values = raw.get(name, {})
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        errors.add(name, f"must be a mapping, got {type(values).__name__}")
        return cls()
    known = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key in known:
            kwargs[key] = value
        else:
            errors.add(f"{name}.{key}", f"unknown field; known: {', '.join(known)}")
    try:
        return cls(**kwargs)
    except ConfigErrors as exc:
        errors.errors.extend(exc.errors)
    except ConfigError as exc:
        errors.errors.append(exc)
    return cls()


def _identity_problems(name: object, category: object, seed: object) -> list[ConfigError]:
    out = [ConfigError(key, f"is required: a non-empty string of 1-128 letters, digits, '_', '.' or '-' starting "
                            f"with a letter or digit, got {show(value)}")
           for key, value in (("name", name), ("category", category))
           if not isinstance(value, str) or not _NAME.fullmatch(value)]
    if not (isinstance(seed, int) and not isinstance(seed, bool) and 0 <= seed < 2**32):
        out.append(ConfigError("seed", f"must be an integer in [0, 2^32), got {show(seed)}"))
    return out


def mode_problems(*, schedule: ScheduleConfig, aggregation: AggregationConfig) -> list[ConfigError]:
    """Asynchronous mode folds one update at a time into a buffer: alignment (FedDNA, PFNM, NAFI) and
    selection (random, GA) need a set of updates at once, so an async job that names them is refused."""
    if schedule.mode != "async":
        return []
    out = []
    if aggregation.alignment != "none":
        out.append(ConfigError("aggregation.alignment", f"must be 'none' with schedule.mode async (it aligns a set of "
                                                        f"updates at once), got {aggregation.alignment!r}"))
    if aggregation.selection != "all":
        out.append(ConfigError("aggregation.selection", f"must be 'all' with schedule.mode async (it chooses among a "
                                                        f"set of updates at once), got {aggregation.selection!r}"))
    return out


def step_bytes(*, model: ModelSpec, training: TrainingConfig) -> int:
    """The memory one training step needs at most, by the layer table's shapes: batch_size × (the input,
    every layer's output, and one per-sample gradient per parameter, as DP-SGD keeps them) × 4 bytes."""
    shapes = output_shapes(model)
    per_sample = math.prod(model.input_shape) + sum(math.prod(shape) for shape in shapes)
    per_sample += sum(math.prod(shape) for shape in parameter_shapes(model).values())
    return 4 * training.batch_size * per_sample


def cross_section_problems(*, model: ModelSpec, training: TrainingConfig, evaluation: EvaluationConfig,
                           task: TaskConfig | None = None) -> list[ConfigError]:
    """What no section can see alone: the model's output against the task (`output_problems`), one training
    step's memory (MAX_STEP_BYTES), and whether the evaluation set fits the model (its sample shape is the
    model's input, its classes the model's outputs; a classification set, so for classification only)."""
    task = task or TaskConfig()
    out: list[ConfigError] = output_problems(task, model)
    try:
        shapes = output_shapes(model)
    except ConfigError:  # the model's own problems are reported where it is parsed
        return out
    if not shapes:
        return out
    need = step_bytes(model=model, training=training)
    if need > MAX_STEP_BYTES:
        out.append(ConfigError("training.batch_size", (
            f"{training.batch_size} makes one training step need {need / 2**30:.1f} GiB (activations and DP "
            f"per-sample gradients of this model), above the limit of {MAX_STEP_BYTES / 2**30:g} GiB; "
            f"use a batch of at most {max(1, training.batch_size * MAX_STEP_BYTES // need)}")))
    out.extend(score_problems(evaluation, task, shapes[-1][0] if len(shapes[-1]) == 1 else 0))
    if evaluation.dataset and task.type != "classification":
        out.append(ConfigError("evaluation.dataset", f"the coordinator's evaluation sets are classification sets; "
                                                     f"task.type {task.type} is scored by the sites (evaluation.every)"))
    elif evaluation.dataset in EVALUATION_SETS:
        sample, classes = EVALUATION_SETS[evaluation.dataset]
        if tuple(model.input_shape) != sample:
            out.append(ConfigError("evaluation.dataset", f"{evaluation.dataset!r} has samples of shape {list(sample)} "
                                                         f"but model.input_shape is {list(model.input_shape)}"))
        elif len(shapes[-1]) == 1 and shapes[-1][0] < classes:
            out.append(ConfigError("evaluation.dataset", f"{evaluation.dataset!r} has {classes} classes but the "
                                                         f"model outputs {shapes[-1][0]} scores"))
    return out


def score_problems(evaluation: EvaluationConfig, task: TaskConfig, width: int) -> list[ConfigError]:
    """`evaluation.score` must be one the task can produce for a model of `width` outputs, and
    `evaluation.threshold` a bin edge of its score histograms (fedbroker.tasks.scores)."""
    out = []
    names = score_names(task, width)
    if evaluation.score and evaluation.score not in names:
        out.append(ConfigError("evaluation.score", f"task.type {task.type} with a model of {width} outputs cannot "
                                                   f"produce {evaluation.score!r}; it can produce: {', '.join(names)}"))
    if task.type in ("classification", "multilabel") and evaluation.threshold != 0.5:
        problem = threshold_problem(task, width, evaluation.threshold)
        if problem:
            out.append(ConfigError("evaluation.threshold", problem))
    return out


def _raise_all(problems: list[ConfigError]) -> None:
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigErrors(problems)


class JobCheck(Protocol):
    """A check beyond the parser's (the algorithm catalogue's: fedbroker.job.submission.accept_job), given the sections
    as parsed so far (training None when it has problems of its own); parse_job reports its problems with its own."""

    def __call__(self, *, aggregation: AggregationConfig, model: ModelSpec, training: TrainingConfig | None,
                 schedule: ScheduleConfig) -> list[ConfigError]:
        """The check's problems, each naming its field."""


def parse_job(raw: Any, *, check: JobCheck | None = None) -> JobSpec:
    """Validate a job given as a mapping (parsed YAML/JSON); raise ConfigError(s) naming each bad field."""
    errors = Collector()
    if not isinstance(raw, Mapping):
        raise ConfigError("job", f"must be a mapping, got {type(raw).__name__}")
    check_plain(raw, "job")
    for key in sorted(set(raw) - set(_SECTIONS)):
        errors.add(key, f"unknown field; known: {', '.join(_SECTIONS)}")
    seed = raw.get("seed", 0)
    errors.errors.extend(_identity_problems(raw.get("name"), raw.get("category"), seed))
    if "model" not in raw:
        errors.add("model", "is required")
        model = ModelSpec((), ())
    else:
        model = parse_model(raw["model"], errors=errors)
    before = len(errors.errors)
    training = _section(errors, raw, "training", TrainingConfig)
    trained_as_written = len(errors.errors) == before
    aggregation = _section(errors, raw, "aggregation", AggregationConfig)
    schedule = _section(errors, raw, "schedule", ScheduleConfig)
    evaluation = _section(errors, raw, "evaluation", EvaluationConfig)
    data = parse_data(raw.get("data"), errors.errors, model)
    task = parse_task(raw.get("task"), errors.errors)
    plan = parse_plan(raw.get("model"), errors=errors)
    privacy = parse_privacy(raw.get("privacy"), errors.errors)
    if not errors.errors and plan != ModelPlan():
        errors.errors.extend(plan_problems(plan, model, alignment=aggregation.alignment, secure=aggregation.secure,
                                           mode=schedule.mode, standardize=data.standardize))
    if not errors.errors:  # across sections: only meaningful once each section is valid on its own
        errors.errors.extend(cross_section_problems(model=model, training=training, evaluation=evaluation, task=task))
        probes = {f"aggregation.{section}.probe_dataset": params.get("probe_dataset") for section, params in (
            ("selection_params", aggregation.selection_params), ("robust_params", aggregation.robust_params))}
        errors.errors.extend(evaluation_set_problems(data, evaluation.dataset, probes=probes))
    # reported with every other problem: a section with problems of its own came back as the defaults (sync,
    # alignment none), which this check passes, so it never echoes them
    errors.errors.extend(mode_problems(schedule=schedule, aggregation=aggregation))
    errors.errors.extend(privacy.problems(secure=aggregation.secure, mode=schedule.mode,
                                          group_size=aggregation.secure_group_size))
    if check is not None:
        errors.errors.extend(check(aggregation=aggregation, model=model, schedule=schedule,
                                   training=training if trained_as_written else None))
    errors.raise_if_any()
    return JobSpec(
        name=raw["name"], category=raw["category"], model=model, training=training,
        aggregation=aggregation, schedule=schedule, evaluation=evaluation, seed=seed, data=data, task=task, plan=plan,
        privacy=privacy,
    )


def job_from_text(text: str, *, check: JobCheck | None = None) -> JobSpec:
    """Parse YAML or JSON text into a JobSpec: the size is checked before the parser runs, and the YAML
    loader is the safe one (no object construction) with a bound on aliases and merge keys
    (fedbroker.job.yamltext), so no text under the size limit can cost more than a few milliseconds."""
    return parse_job(load_yaml(text, where="job", max_bytes=MAX_SPEC_BYTES), check=check)


def job_from_json(text: str) -> JobSpec:
    """A job from its one wire form, `JobSpec.to_json` (the coordinator's store)."""
    return parse_job(json.loads(text))


def training_from_json(text: str) -> TrainingConfig:
    """The training section a round task carries (a JSON object of its fields), checked again by the worker
    that receives it: every problem named, an unknown field included."""
    errors = Collector()
    training = _section(errors, {"training": json.loads(text)}, "training", TrainingConfig)
    errors.raise_if_any()
    return training
