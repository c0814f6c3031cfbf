"""A job's settings as every process of it reads them, installed once per job and parsed once per process.

The coordinator builds the `JobSettings` message from the job it accepted (`settings_message`); it installs them
at the aggregation service (`InstallJob`) and gives them to each worker with its first task. Each process turns
the message into an `InstalledJob` once (`parse_settings`: every section typed and checked, the algorithms'
parameters checked by the catalogue) and keeps it by job and digest; rounds and tasks then carry only the job
id, the round and what is truly per round. A task from an older coordinator still carries the sections as
JSON (`legacy_settings`, for one release).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedbroker.algorithms.catalogue import AggregationSettings, aggregation_settings
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.group_rules import group_problems
from fedbroker.job.pipeline import DataPipeline, pipeline_from_json
from fedbroker.job.privacy import DistributedDP, PrivacyConfig, SiteDP
from fedbroker.job.spec import AggregationConfig, EvaluationConfig, JobSpec, TrainingConfig
from fedbroker.job.spec_data import DataConfig
from fedbroker.job.submission import robust_problems
from fedbroker.job.task import TaskConfig
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.weights.plan import ModelPlan, plan_from_json

_KINDS = ("alignment", "weighting", "selection", "robust")


@dataclass(frozen=True)
class InstalledJob:
    """A job's settings, typed and checked: what a process reads of the job for as long as it runs it."""

    job_id: str
    digest: str
    category: str
    seed: int
    training: TrainingConfig
    aggregation: AggregationConfig    # the section as the job wrote it (names and parameters)
    algorithms: AggregationSettings   # its typed view: each kind's checked parameters and traits
    evaluation: EvaluationConfig
    data: DataConfig
    task: TaskConfig
    message: pb.JobSettings = dataclasses.field(compare=False, repr=False)
    plan: ModelPlan = dataclasses.field(default_factory=ModelPlan)  # what trains (fedbroker.weights.plan); the default: every tensor
    start_digest: str = ""            # the start weights' canonical digest ("" = a seeded random draw)
    privacy: PrivacyConfig = dataclasses.field(default_factory=PrivacyConfig)  # DP the round carries

    @property
    def pipeline(self) -> DataPipeline | None:
        """The job's data pipeline (data.preprocess/augment/expect); None when it has none (today's behaviour)."""
        return self.data.pipeline if self.data.pipeline != DataPipeline() else None


def settings_message(job_id: str, job: JobSpec, *, start_digest: str = "") -> pb.JobSettings:
    """The settings of an accepted job, as they travel (built once, where the job was parsed); `start_digest`:
    its start weights' canonical digest when they are not the seeded random draw."""
    t, a, e, d, k = job.training, job.aggregation, job.evaluation, job.data, job.task
    return pb.JobSettings(
        task=task_message(k),
        job_id=job_id, category=job.category, seed=job.seed,
        training=pb.TrainingSettings(rounds=t.rounds, local_epochs=t.local_epochs, batch_size=t.batch_size,
                                     optimizer=t.optimizer, lr=t.lr, momentum=t.momentum, proximal_mu=t.proximal_mu),
        aggregation=pb.AggregationSettings(secure=a.secure, max_update_value=a.max_update_value,
                                           secure_group_size=a.secure_group_size, **{
            kind: pb.AlgorithmChoice(name=getattr(a, kind), params_json=json.dumps(dict(getattr(a, f"{kind}_params")),
                                                                                   sort_keys=True))
            for kind in _KINDS}),
        evaluation=pb.EvaluationSettings(dataset=e.dataset, test_fraction=e.test_fraction, split_seed=e.split_seed,
                                         every=e.every, sites=e.sites, patience=e.patience),
        data=pb.DataSettings(standardize=d.standardize, lower=[lo for lo, _ in d.bounds],
                             upper=[hi for _, hi in d.bounds],
                             pipeline_json=d.pipeline.to_json() if d.pipeline != DataPipeline() else ""),
        model_plan_json=job.plan.to_json() if job.plan != ModelPlan() else "", start_digest=start_digest,
        privacy=privacy_message(job.privacy))


def privacy_message(privacy: PrivacyConfig) -> pb.PrivacySettings:
    """The job's privacy section as it travels (empty when neither option is enabled)."""
    out = pb.PrivacySettings()
    if privacy.distributed.enabled:
        out.distributed.CopyFrom(pb.DistributedDPSettings(**dataclasses.asdict(privacy.distributed)))
    if privacy.site.enabled:
        out.site.CopyFrom(pb.SiteDPSettings(**dataclasses.asdict(privacy.site)))
    return out


def privacy_config(message: pb.PrivacySettings) -> PrivacyConfig:
    """The section from its message, each option checking itself (raises ConfigError(s) naming the field)."""
    options: dict[str, Any] = {}
    for name, cls in (("distributed", DistributedDP), ("site", SiteDP)):
        if message.HasField(name) and getattr(message, name).enabled:
            sent = getattr(message, name)
            option = cls(**{f.name: getattr(sent, f.name) for f in dataclasses.fields(cls)})
            problems = option.problems()
            if problems:
                raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
            options[name] = option
    return PrivacyConfig(**options)


def settings_digest(message: pb.JobSettings) -> str:
    """The name of a job's settings: the SHA-256 of their deterministic serialisation."""
    return hashlib.sha256(message.SerializeToString(deterministic=True)).hexdigest()


def parse_settings(message: pb.JobSettings) -> InstalledJob:
    """The one parse of a job's settings in a process: every section built (each checks itself), the algorithms'
    names and parameters checked by the catalogue, a robust rule beside an alignment refused. Every problem is
    raised at once as ConfigError(s) naming its field."""
    problems: list[ConfigError] = []

    def section(build: Any) -> Any:
        try:
            return build()
        except ConfigErrors as exc:
            problems.extend(exc.errors)
        except (ConfigError, TypeError, ValueError) as exc:
            problems.append(exc if isinstance(exc, ConfigError) else ConfigError("job", str(exc)))
        return None

    t, a, e, d = message.training, message.aggregation, message.evaluation, message.data
    training = section(lambda: TrainingConfig(
        rounds=t.rounds, local_epochs=t.local_epochs, batch_size=t.batch_size, optimizer=t.optimizer, lr=t.lr,
        momentum=t.momentum, proximal_mu=t.proximal_mu))
    aggregation = section(lambda: AggregationConfig(secure=a.secure, max_update_value=a.max_update_value,
                                                     secure_group_size=a.secure_group_size, **{
        name: value for kind in _KINDS for name, value in _choice(kind, getattr(a, kind)).items()}))
    algorithms = section(lambda: aggregation_settings(aggregation)) if aggregation is not None else None
    if aggregation is not None:
        problems.extend(robust_problems(aggregation, None) + group_problems(aggregation, None))
    evaluation = section(lambda: EvaluationConfig(dataset=e.dataset, test_fraction=e.test_fraction,
                                                  split_seed=e.split_seed, every=e.every, sites=e.sites,
                                                  patience=e.patience))
    if len(d.lower) != len(d.upper):
        problems.append(ConfigError("data.bounds", f"{len(d.lower)} lower bounds but {len(d.upper)} upper ones"))
    pipeline = section(lambda: pipeline_from_json(d.pipeline_json))  # checked again here: never trust the sender
    data = section(lambda: DataConfig(standardize=d.standardize, bounds=tuple(zip(d.lower, d.upper)),
                                      pipeline=pipeline or DataPipeline()))
    task = section(lambda: task_config(message.task))
    plan = section(lambda: plan_from_json(message.model_plan_json))
    privacy = section(lambda: privacy_config(message.privacy))
    if privacy is not None and aggregation is not None:
        problems.extend(privacy.problems(secure=aggregation.secure, mode="sync" if privacy.distributed.enabled else "",
                                         group_size=aggregation.secure_group_size))
    if not message.job_id:
        problems.append(ConfigError("job_id", "is empty"))
    if problems or algorithms is None:
        raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
    return InstalledJob(job_id=message.job_id, digest=settings_digest(message), category=message.category,
                        seed=message.seed, training=training, aggregation=aggregation, algorithms=algorithms,
                        evaluation=evaluation, data=data, task=task, message=message, plan=plan or ModelPlan(),
                        start_digest=message.start_digest, privacy=privacy or PrivacyConfig())


def task_message(task: TaskConfig) -> pb.TaskSettings:
    """The job's task as it travels (in its settings, and in each evaluation task)."""
    return pb.TaskSettings(type=task.type, class_weights=list(task.class_weights), label_smoothing=task.label_smoothing,
                           labels=task.labels, loss=task.loss, huber_delta=task.huber_delta, classes=task.classes,
                           dice_weight=task.dice_weight)


def task_config(k: pb.TaskSettings) -> TaskConfig:
    """The job's task as a message carries it (checked: ConfigError(s)); none (a job or coordinator from before
    tasks) is classification."""
    if not k.type:
        return TaskConfig()
    return TaskConfig(type=k.type, class_weights=tuple(k.class_weights), label_smoothing=k.label_smoothing,
                      labels=k.labels, loss=k.loss or "mse", huber_delta=k.huber_delta or 1.0, classes=k.classes,
                      dice_weight=k.dice_weight)


def _choice(kind: str, choice: pb.AlgorithmChoice) -> dict[str, Any]:
    """One kind's name and parameters as AggregationConfig fields (an absent choice: the section's default)."""
    out: dict[str, Any] = {}
    if choice.name:
        out[kind] = choice.name
    if choice.params_json:
        try:
            params = json.loads(choice.params_json)
        except ValueError as exc:
            raise ConfigError(f"aggregation.{kind}_params", f"is not a JSON object: {exc}") from None
        if not isinstance(params, Mapping):
            raise ConfigError(f"aggregation.{kind}_params", f"must be a JSON object, got {type(params).__name__}")
        out[f"{kind}_params"] = dict(params)
    return out


def legacy_settings(job_id: str, *, training_json: str = "", aggregation_json: str = "") -> pb.JobSettings:
    """The settings message of an old-style round task or request (its sections as JSON objects, read for one
    release): parse it with `parse_settings` like any other. A JSON error raises ConfigError."""
    try:
        training, aggregation = json.loads(training_json or "{}"), json.loads(aggregation_json or "{}")
    except ValueError as exc:
        raise ConfigError("task", f"its settings are not JSON: {exc}") from None
    if not isinstance(training, Mapping) or not isinstance(aggregation, Mapping):
        raise ConfigError("task", "its training and aggregation settings must be JSON objects")
    return sections_settings(job_id, training=training, aggregation=aggregation)


def sections_settings(job_id: str, *, training: Mapping[str, Any] | None = None,
                      aggregation: Mapping[str, Any] | None = None) -> pb.JobSettings:
    """The settings message of a job given as its training and aggregation sections (the rest: defaults), as an
    older coordinator sent them and as a test writes them. An unknown field or a wrong type raises ConfigError."""
    training, aggregation = dict(training or {}), dict(aggregation or {})
    unknown = sorted({f"training.{k}" for k in training if k not in _fields(TrainingConfig)}
                     | {f"aggregation.{k}" for k in aggregation if k not in _fields(AggregationConfig)})
    if unknown:
        raise ConfigErrors([ConfigError(name, "unknown field") for name in unknown])
    values = {**dataclasses.asdict(TrainingConfig()), **training}
    try:
        return pb.JobSettings(
            job_id=job_id,
            training=pb.TrainingSettings(**{k: values[k] for k in _fields(TrainingConfig)}),
            aggregation=pb.AggregationSettings(secure=aggregation.get("secure", False),
                                               max_update_value=aggregation.get("max_update_value", 0.0),
                                               secure_group_size=aggregation.get("secure_group_size", 0), **{
                kind: pb.AlgorithmChoice(name=aggregation.get(kind, getattr(AggregationConfig, kind)),
                                         params_json=json.dumps(aggregation.get(f"{kind}_params") or {},
                                                                sort_keys=True))
                for kind in _KINDS}),
            # evaluation.score and .threshold are the coordinator's alone (it scores the sites' sums): not sent
            evaluation=pb.EvaluationSettings(**{k: v for k, v in dataclasses.asdict(EvaluationConfig()).items()
                                                if k in pb.EvaluationSettings.DESCRIPTOR.fields_by_name}),
            data=pb.DataSettings(standardize=DataConfig().standardize))
    except (TypeError, ValueError) as exc:  # a value of the wrong type for its field
        raise ConfigError("job", f"a setting has a value of the wrong type: {exc}") from None


def _fields(cls: type[Any]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}
