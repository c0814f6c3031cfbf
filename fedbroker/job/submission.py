"""Where a job is accepted (the coordinator's SubmitJob, the CLI): the parser's checks and the catalogue's,
every problem reported at once, so a bad algorithm name or parameter fails at submission, not in round 7.

Besides each algorithm's own parameters, the catalogue's checks read them against the model: an alignment
needs a model whose units it can match, and a GA probe set must be something the model can read.
"""

from __future__ import annotations

from fedbroker.algorithms.catalogue import ALIGNMENTS, aggregation_settings
from fedbroker.algorithms.params import staleness_function
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.alignment_plan import model_nodes, plan_alignment
from fedbroker.job.group_rules import group_problems
from fedbroker.job.spec import (
    EVALUATION_SETS,
    AggregationConfig,
    JobSpec,
    ModelSpec,
    ScheduleConfig,
    TrainingConfig,
    job_from_text,
    output_shapes,
    parse_job,
)
from fedbroker.layers import LAYERS


def alignment_problems(aggregation: AggregationConfig, model: ModelSpec, *, layerwise: bool,
                       training: TrainingConfig | None) -> list[ConfigError]:
    """Why the job's alignment cannot align its model, each problem at the node it names
    (`fedbroker.job.alignment_plan`); and, in layer-wise mode, a training.rounds other than the model's number
    of matched layers (the scheme takes exactly one round per matched layer)."""
    traits = ALIGNMENTS.traits(aggregation.alignment)  # an unknown name is reported by the catalogue
    if (traits is not None and not traits.aligns_units) or not model_nodes(model):
        return []
    name = aggregation.alignment
    plan, refusals = plan_alignment(model)
    problems = [ConfigError(e.field, f"alignment {name!r} cannot align this model: {e.problem}; use alignment "
                                     f"'none'") for e in refusals]
    if traits is not None and traits.resizes_layers and model.is_graph and not refusals:
        problems.append(ConfigError("aggregation.alignment", (
            f"{name!r} infers each matched layer's global width, which may differ from the model's, and a model "
            f"graph (model.nodes) is not resized: write the chain as model.layers, or use alignment 'feddna'")))
    rounds = plan.layerwise_rounds
    if layerwise and not refusals and training is not None and training.rounds != rounds:
        nodes = ", ".join(layer.node for layer in plan.layers)
        problems.append(ConfigError("training.rounds", (
            f"is {training.rounds}, but alignment {name!r} in mode layerwise takes one round per matched layer and "
            f"this model has {rounds} ({nodes}): set training.rounds to {rounds}")))
    return problems


def job_problems(*, aggregation: AggregationConfig, model: ModelSpec, training: TrainingConfig | None = None,
                 schedule: ScheduleConfig | None = None) -> list[ConfigError]:
    """What the catalogue refuses in a job: an unknown algorithm or parameter, an alignment that cannot align
    its model, a probe set the model cannot read, a selection its rounds never use as it says (a GA job whose
    training.rounds never reaches a GA round), an async job's staleness function or parameters, a robust rule
    where it cannot see the individual updates (`robust_problems`). A
    `fedbroker.job.spec.JobCheck`: parse_job reports these with its own."""
    problems: list[ConfigError] = []
    layerwise = False
    if schedule is not None:
        try:
            schedule_problem(schedule)
        except ConfigError as exc:
            problems.extend(getattr(exc, "errors", [exc]))
    try:
        settings = aggregation_settings(aggregation)
    except ConfigErrors as exc:
        problems.extend(exc.errors)
    except ConfigError as exc:
        problems.append(exc)
    else:
        problems.extend(_probe_problems(settings.selection.params.probe_set, model))
        problems.extend(_probe_problems(settings.robust.params.probe_set, model,
                                        field="aggregation.robust_params.probe_dataset"))
        never = settings.selection.params.rounds_problem(training.rounds) if training is not None else None
        problems.extend([never] if never is not None else [])
        layerwise = settings.alignment.params.layerwise
    if aggregation.secure:
        problems.extend(secure_problems(aggregation, schedule))
    problems.extend(group_problems(aggregation, schedule))
    problems.extend(robust_problems(aggregation, schedule))
    problems.extend(alignment_problems(aggregation, model, layerwise=layerwise, training=training))
    return problems


SECURE_MIN_CLIENTS = 3  # with two, each site learns the other's update from the sum; with one, the service does


def secure_problems(aggregation: AggregationConfig, schedule: ScheduleConfig | None) -> list[ConfigError]:
    """What `aggregation.secure` cannot be combined with, every problem at once. Secure aggregation gives the
    service only the round's weighted sum, so every rule must be a fixed linear combination of the updates
    whose coefficients come from what the service sees anyway (sample counts, DWFed's ISH): FedAvg, uniform and
    DWFed are; alignment (it matches units inside each update), a selection at the close (random and GA choose
    among the updates themselves; `schedule.clients_per_round` already draws a seeded random subset of workers
    before the round, which is sound), a robust rule (it reads each update), a `max_share` cap (its coefficients
    depend on which updates arrive) and asynchronous mode (it folds one update at a time) are not."""
    def refuse(field: str, why: str) -> None:
        problems.append(ConfigError(field, f"cannot be combined with aggregation.secure: {why}"))

    problems: list[ConfigError] = []
    if aggregation.alignment != "none":
        refuse("aggregation.alignment", f"{aggregation.alignment!r} matches units inside each update, which the "
                                        f"service never sees in the clear (use 'none')")
    if aggregation.selection != "all":
        refuse("aggregation.selection", f"{aggregation.selection!r} chooses among the updates themselves at the close "
                                        f"(use 'all'; schedule.clients_per_round draws a random subset of workers "
                                        f"before each round, which is sound)")
    if aggregation.robust != "none" and not aggregation.secure_group_size:  # grouped: fedbroker.job.group_rules
        refuse("aggregation.robust", f"{aggregation.robust!r} reads each update; secure aggregation reveals only "
                                     f"their sum (use 'none', or aggregation.secure_group_size to run it over the "
                                     f"secure sums of groups)")
    share = aggregation.weighting_params.get("max_share", 1.0)  # a bad value is the catalogue's to report
    if isinstance(share, (int, float)) and not isinstance(share, bool) and share < 1.0:
        refuse("aggregation.weighting_params.max_share", "a cap makes each coefficient depend on which updates "
                                                         "arrive; secure weights are fixed before masking")
    if schedule is None:
        return problems
    if schedule.mode != "sync":
        refuse("schedule.mode", f"{schedule.mode!r} folds one update at a time; secure rounds are synchronous")
    for name in ("min_clients", "min_workers"):
        value = getattr(schedule, name)
        if value < SECURE_MIN_CLIENTS:
            refuse(f"schedule.{name}", f"is {value}, below {SECURE_MIN_CLIENTS}: a round's sum over fewer "
                                       f"updates gives them away (the threshold needs at least "
                                       f"{SECURE_MIN_CLIENTS} workers)")
    if 0 < schedule.clients_per_round < SECURE_MIN_CLIENTS:
        refuse("schedule.clients_per_round", f"is {schedule.clients_per_round}, below {SECURE_MIN_CLIENTS} "
                                             f"(see schedule.min_clients)")
    return problems


def robust_problems(aggregation: AggregationConfig, schedule: ScheduleConfig | None) -> list[ConfigError]:
    """A robust rule (`aggregation.robust`) reads every update of a round apart, as a vector beside the global
    model's; the settings under which it cannot are refused:

    - asynchronous mode: FedBuff folds each update into its buffer's running sum as it arrives, staleness-scaled,
      so no set of individual updates ever exists to take a median of;
    - an alignment: it permutes (and may re-count) each client's units before averaging, so Δ_i = x_i − x_global
      compares unmatched units, and the aligned model's widths may differ from the global one's.
    (A rule with `aggregation.secure` is refused by `secure_problems`, once.)
    """
    if aggregation.robust == "none":
        return []
    field, rule = "aggregation.robust", aggregation.robust
    out = []
    if schedule is not None and schedule.mode == "async":
        out.append(ConfigError(field, f"{rule!r} needs every update of a round apart, but schedule.mode async folds "
                                      f"each update into a running buffer as it arrives; use robust: none or "
                                      f"schedule.mode sync"))
    if aggregation.alignment != "none":
        out.append(ConfigError(field, f"{rule!r} cannot follow alignment {aggregation.alignment!r}: it compares the "
                                      f"updates unit by unit against the global model, which an alignment permutes "
                                      f"(and may resize); use alignment: none or robust: none"))
    return out


def _probe_problems(dataset: str, model: ModelSpec, *,
                    field: str = "aggregation.selection_params.probe_dataset") -> list[ConfigError]:
    """A probe set the model cannot read (its samples are not the model's input, or it has more classes
    than the model has outputs) would fail every round that reads it (the GA's, FLTrust's): refuse it at
    submission."""
    if dataset and model.is_graph:  # the probe runs a chain's layers in numpy (aggregators/selection/probe.py)
        return [ConfigError(field, f"{dataset!r} is read by a probe that runs a chain of layers (model.layers); "
                                   f"this model is a graph (model.nodes)")]
    if not dataset or not model.layers:
        return []
    try:
        shapes = output_shapes(model)
    except ConfigError:  # the model's own problems are reported where it is parsed
        return []
    unknown = [f"layers[{i}] ({layer.type})" for i, layer in enumerate(model.layers)
               if not LAYERS[layer.type].probe_forward]
    if unknown:
        return [ConfigError(field, f"the probe set's forward pass (numpy, on the aggregation side) does not compute "
                                   f"{', '.join(unknown)}; it computes "
                                   f"{', '.join(n for n, t in LAYERS.items() if t.probe_forward)}")]
    sample, classes = EVALUATION_SETS[dataset]
    if tuple(model.input_shape) != sample:
        return [ConfigError(field, f"{dataset!r} has samples of shape {list(sample)} but model.input_shape is "
                                   f"{list(model.input_shape)}")]
    if shapes and (len(shapes[-1]) != 1 or shapes[-1][0] < classes):
        return [ConfigError(field, f"{dataset!r} has {classes} classes but the model outputs {list(shapes[-1])}")]
    return []


def schedule_problem(schedule: ScheduleConfig) -> None:
    """An async job's staleness function and its parameters (raises the ConfigError naming the field)."""
    if schedule.mode == "async":
        staleness_function(schedule.staleness, schedule.staleness_params)


def accept_job(raw: object) -> JobSpec:
    """A job given as a mapping (parsed YAML/JSON), validated in full; raises ConfigError(s) naming each bad field."""
    return parse_job(raw, check=job_problems)


def accept_job_text(text: str) -> JobSpec:
    """A job given as YAML or JSON text, validated in full (see accept_job)."""
    return job_from_text(text, check=job_problems)
