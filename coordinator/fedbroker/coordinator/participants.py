"""Which registered workers take part in a round: a pure, seeded choice shared by the scheduler and the simulator,
among the workers that can afford the round (`why_unaffordable`); and how much ε a worker can have spent
(`EpsilonBounds`), which bounds the ε a task outcome may claim for a job.

The same (ids, k, seed, round) gives the same participants on every machine, so a research simulation
and the running service sample identical rounds from one job seed.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedbroker.coordinator import metrics
from fedbroker.coordinator.records import WorkerRecord
from fedbroker.coordinator.store import StateStore
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.pipeline import DataPipeline
from fedbroker.job.spec import ModelSpec, TrainingConfig
from fedbroker.privacy import dp_sample_rate, job_epsilon_after_round, planned_steps, project_epsilon
from fedbroker.proto import fedbroker_pb2 as pb

log = logging.getLogger(__name__)

ISSUED_KEPT_S = 30 * 86400.0  # a task's bound is forgotten this long after its deadline
# A later round's ε never adds more than the first round's (ε after n rounds is a minimum of functions affine in
# n, so concave); the margin covers a history of several policies, and float noise.
COST_MARGIN = 1.01
COST_SLACK = 1e-6
RELATIVE_SLACK = 1e-9  # a claim this close to its bound is float noise, not a jump


def sample_participants(worker_ids: Sequence[str], k: int, *, seed: int, round_number: int) -> list[str]:
    """k distinct ids, sorted; every id (sorted) when k is 0 or at least the number of workers.

    The ids are sorted before drawing so the choice does not depend on the order a registry lists them in.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")
    ids = sorted(worker_ids)
    if len(set(ids)) != len(ids):
        raise ValueError("worker_ids must be distinct")
    if k == 0 or k >= len(ids):
        return ids
    rng = np.random.default_rng([seed, round_number, 1])
    return sorted(str(w) for w in rng.choice(ids, size=int(k), replace=False).tolist())


@dataclass(frozen=True)
class WorkerBudget:
    """What a worker's last heartbeat said it can afford: `left` is its owner's budget less every job's ε on
    its ledger (None: no budget, DP off); `costs` maps each job it knows to the ε its next round would add
    (None: on its ledger, but the worker has not seen the job's settings since it started)."""

    left: float | None
    costs: Mapping[str, float | None] = field(default_factory=dict)


def budget_from_heartbeat(heartbeat: pb.Heartbeat) -> WorkerBudget:
    """What a heartbeat says its worker can afford (a cost it could not compute is None)."""
    if not heartbeat.budget_limited:
        return WorkerBudget(None)
    return WorkerBudget(heartbeat.epsilon_left, {c.job_id: c.next_round_epsilon if c.known else None
                                                 for c in heartbeat.job_costs})


class WorkerBudgets:
    """Each worker's budget by its last heartbeat: written by the control queue's thread, read by every
    job's selection."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_worker: dict[str, WorkerBudget] = {}

    def note(self, worker_id: str, budget: WorkerBudget) -> None:
        """The worker's newest heartbeat's budget replaces what an older one said."""
        with self._lock:
            self._by_worker[worker_id] = budget

    def snapshot(self) -> dict[str, WorkerBudget]:
        """Every worker's budget as of now (a worker with no heartbeat yet is absent)."""
        with self._lock:
            return dict(self._by_worker)


class EpsilonBounds:
    """What the coordinator priced: for every task issued to a worker, the most ε one round (or asynchronous
    training) of that task's job can add under the worker's registered policy, kept in the state store so a
    restart forgets none. A task outcome's claim for a job above what its tasks were priced at (a forged
    report, say) is refused, never stored (control_handler.py): a site's recorded ε is the sum of its jobs'
    (store.recorded_epsilon), so no message can raise it above what the coordinator asked of the site."""

    def __init__(self, store: StateStore) -> None:
        self.store = store

    def note_tasks(self, job_id: str, workers: Sequence[str], deadline: float, training: TrainingConfig) -> None:
        """Before round tasks of job `job_id` with `training` go out to `workers`: what each can add to its
        worker's ε (the most its report for the job may claim)."""
        registered = {w.worker_id: w for w in self.store.workers()}
        rows = [(worker_id, job_id, deadline, _task_cost(registered.get(worker_id), training)) for worker_id in workers]
        self.store.note_issued_epsilon(rows, forget_before=time.time() - ISSUED_KEPT_S)

    def limit(self, worker_id: str, job_id: str) -> float:
        """The most ε the worker's report may claim for `job_id`: what the tasks of it issued to the worker can
        have cost (0 for a job that issued it none)."""
        return self.store.issued_epsilon(worker_id, job_id)

    def allows(self, worker_id: str, job_id: str, claimed: float, *, message: str) -> bool:
        """Whether a claim of ε `claimed` for `job_id` on the worker's data is within `limit`: the one rule for
        every ε a site's message can put into the job's record (a task outcome's, an asynchronous update's that no
        version holds). One above it is refused, never stored: counted by `message` and logged naming the worker."""
        limit = self.limit(worker_id, job_id)
        if claimed <= limit + RELATIVE_SLACK * max(1.0, limit):
            return True
        metrics.EPSILON_JUMPS.labels(message).inc()
        log.error("worker %s claimed ε %.6g for job %s (%s), above the %.6g its tasks of that job can have cost: "
                  "the claim is refused, not stored (a forged or inflated report)", worker_id, claimed, job_id,
                  message, limit)
        return False


def _task_cost(worker: WorkerRecord | None, training: TrainingConfig) -> float:
    """The most ε one round of `training` adds to the worker's total: 0 without DP (or for a worker not
    registered: its first registration is not bounded); its whole budget when the accountant cannot price it."""
    if worker is None or not worker.dp.enabled:
        return 0.0
    cost = _first_round_cost(worker.dp.noise_multiplier, worker.dp.delta, worker.num_samples, training)
    return worker.dp.epsilon_budget if cost is None else cost * COST_MARGIN + COST_SLACK


@dataclass(frozen=True)
class Shortfall:
    """A worker whose ε budget cannot cover a job's next round: spent ε never comes back, so it cannot take part
    until its owner raises the budget (`budget`: its registered policy's; `cost` None: the worker's to judge)."""

    budget: float
    left: float
    cost: float | None

    def __str__(self) -> str:
        cost = f"a round of this job costs ε {self.cost:.3f}" if self.cost is not None else "its budget is spent"
        return f"budget ε {self.budget:g}, {self.budget - self.left:.3f} spent, {self.left:.3f} left: {cost}"


def budget_shortfall(worker: WorkerRecord, budget: WorkerBudget | None, *, job_id: str,
                     training: TrainingConfig) -> Shortfall | None:
    """Whether `worker`'s ε budget cannot cover `job_id`'s next round (None: it can, or it has no budget).

    From the worker's own report where it has one (its heartbeat's cost for the job). A job the worker
    does not list has no history on its ledger, so its cost is the first round's, computed here from the
    policy and sample count the worker registered; the same when no heartbeat came yet (a budget known
    only from the registration). A cost the worker could not compute (it restarted and has not seen the
    job's settings since) leaves the decision to the worker, which refuses by itself, before training.
    """
    if budget is None:  # no heartbeat yet: the budget the registration gave
        if not worker.dp.enabled:
            return None
        left = worker.dp.epsilon_budget - worker.epsilon_spent
    elif budget.left is None:
        return None
    else:
        left = budget.left
    if budget is not None and job_id in budget.costs:
        cost = budget.costs[job_id]
    else:
        cost = _first_round_cost(worker.dp.noise_multiplier, worker.dp.delta, worker.num_samples, training)
    if (cost is None and left <= 0) or (cost is not None and cost > left + 1e-9):
        return Shortfall(worker.dp.epsilon_budget, left, cost)
    return None


def why_unaffordable(worker: WorkerRecord, budget: WorkerBudget | None, *, job_id: str,
                     training: TrainingConfig) -> str:
    """Why `worker` cannot afford `job_id`'s next round ("" when it can: `budget_shortfall`), so that a round
    is opened only with workers that will train it: a refusal after opening would leave the others' ε spent
    on a round that fails on min_clients."""
    short = budget_shortfall(worker, budget, job_id=job_id, training=training)
    if short is None:
        return ""
    if short.cost is None:
        return f"its ε budget is spent ({short.left:.3f} left)"
    return f"the round would cost ε {short.cost:.3f}, {short.left:.3f} left of its budget"


def projected_epsilon(worker: WorkerRecord, budget: WorkerBudget | None, training: TrainingConfig) -> str:
    """`fedbroker submit`'s line for one site of the job's category: its ε after the job if it trained every
    round, against its registered budget ("" for a site without DP)."""
    if not worker.dp.enabled:
        return ""
    left = worker.dp.epsilon_budget - worker.epsilon_spent if budget is None or budget.left is None else budget.left
    spent = worker.dp.epsilon_budget - left
    try:
        job = project_epsilon([], noise_multiplier=worker.dp.noise_multiplier, delta=worker.dp.delta,
                              sample_rate=dp_sample_rate(worker.num_samples, training),
                              steps=planned_steps(worker.num_samples, training) * training.rounds)
    except ConfigError:  # a registration the accountant cannot use (no samples): the worker decides
        return f"{worker.worker_id}: ε {spent:.3f} spent of its budget {worker.dp.epsilon_budget:g}"
    verdict = "fits" if spent + job <= worker.dp.epsilon_budget + 1e-9 else "over its budget"
    return (f"{worker.worker_id}: ε {spent:.3f} spent + up to {job:.3f} for this job ({training.rounds} round(s)) "
            f"= {spent + job:.3f} of its budget {worker.dp.epsilon_budget:g} ({verdict})")


def submission_projection(workers: Sequence[WorkerRecord], budgets: Mapping[str, WorkerBudget], *, job_id: str,
                          training: TrainingConfig) -> tuple[list[str], list[str]]:
    """What `fedbroker submit` shows of a new job's ε: one line per DP site of its category (`projected_epsilon`),
    and a warning for each site whose budget cannot cover the job's first round (it cannot take part)."""
    lines = [line for w in workers if (line := projected_epsilon(w, budgets.get(w.worker_id), training))]
    warnings = [f"site {w.worker_id} cannot take part: {short}" for w in workers
                if (short := budget_shortfall(w, budgets.get(w.worker_id), job_id=job_id, training=training))]
    return lines, warnings


@functools.lru_cache(maxsize=1024)
def _first_round_cost(noise_multiplier: float, delta: float, num_samples: int,
                      training: TrainingConfig) -> float | None:
    try:
        return job_epsilon_after_round([], num_samples=num_samples, config=training,
                                       noise_multiplier=noise_multiplier, delta=delta)
    except ConfigError:  # a registration the accountant cannot use (no samples): the worker decides
        return None


def data_fit_problems(model: ModelSpec, workers: Sequence[WorkerRecord], *, category: str,
                      who: Callable[[Sequence[WorkerRecord]], str] | None = None,
                      pipeline: DataPipeline | None = None) -> list[ConfigError]:
    """What in a job's model does not fit the data its category's workers reported at registration (one
    sample's shape, the number of classes), each naming the model's field: such a job would only fail inside
    every worker's training. Workers that reported neither (older than the fields) are not judged. `who`
    names the workers at fault in the message (default: their ids). With the job's data `pipeline` (a non-empty
    one), a worker's samples are judged as it prepares them; a 0 in a reported shape is a size that differs
    between its files, which only a pipeline that resizes, crops or pads fits."""
    who = who or _some
    problems = []
    if pipeline is not None and pipeline != DataPipeline():
        problems += _pipeline_fit_problems(model, workers, category=category, who=who, pipeline=pipeline)
    else:
        wrong_shape = sorted((w for w in workers if w.input_shape and tuple(w.input_shape) != tuple(model.input_shape)),
                             key=lambda w: w.worker_id)
        if wrong_shape:
            shapes = sorted({tuple(w.input_shape) for w in wrong_shape})
            varying = " (0: a size that differs between its files; the job's data section must resize, crop or pad)" \
                if any(0 in s for s in shapes) else ""
            problems.append(ConfigError("model.input_shape", (
                f"is {list(model.input_shape)} but the samples of {who(wrong_shape)} (category {category!r}) have "
                f"shape {' or '.join(str(list(s)) for s in shapes)}{varying}")))
    outputs = model.num_outputs
    too_many = sorted((w for w in workers if w.num_classes > outputs), key=lambda w: w.worker_id)
    if too_many:
        last = max((i for i, layer in enumerate(model.layers) if "out_features" in layer.params), default=None)
        field = f"model.layers[{last}].out_features" if last is not None else "model.layers"
        if model.is_graph:
            field = f"model.nodes.{model.output}"
        problems.append(ConfigError(field, (
            f"the model outputs {outputs} class scores but the data of {who(too_many)} (category {category!r}) "
            f"has {max(w.num_classes for w in too_many)} classes")))
    return problems


def _pipeline_fit_problems(model: ModelSpec, workers: Sequence[WorkerRecord], *, category: str,
                           who: Callable[[Sequence[WorkerRecord]], str], pipeline: DataPipeline) -> list[ConfigError]:
    """The workers whose samples the pipeline cannot take, or prepares to another shape than the model's input,
    grouped by what is wrong (each group names its workers)."""
    wrong: dict[tuple[str, str], list[WorkerRecord]] = {}
    for w in sorted((w for w in workers if w.input_shape), key=lambda w: w.worker_id):
        try:
            prepared = pipeline.output_shape(tuple(w.input_shape))
        except ConfigError as exc:
            errors = exc.errors if isinstance(exc, ConfigErrors) else [exc]
            for e in errors:
                wrong.setdefault((e.field, f"cannot take the samples of {{who}}, of shape {list(w.input_shape)}: "
                                            f"{e.problem}"), []).append(w)
            continue
        if prepared != tuple(model.input_shape):
            wrong.setdefault(("model.input_shape", f"is {list(model.input_shape)} but the job's data section prepares "
                                                   f"the samples of {{who}} to shape {list(prepared)}"), []).append(w)
    return [ConfigError(field, text.replace("{who}", f"{who(group)} (category {category!r})"))
            for (field, text), group in wrong.items()]


def _some(workers: Sequence[WorkerRecord], shown: int = 5) -> str:
    ids = [w.worker_id for w in workers]
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return f"worker{'s' if len(ids) > 1 else ''} {', '.join(ids[:shown])}{more}"
