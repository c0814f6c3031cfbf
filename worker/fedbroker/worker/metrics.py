"""The worker's metrics, defined once per process (see `fedbroker.metrics` for why the default registry).

Every series carries `worker_id`: in a cluster each pod has one worker, and in the in-process demo several
agents share these objects, told apart by that label. Workers are few and long-lived (one per data
owner), so the label stays bounded; a job, round or sample never becomes a label.

A worker's counters get their series at 0 when it starts (`worker_started`): a series that first appears
at 1 hides that increase from `increase()` and `rate()`.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

import fedbroker.metrics  # noqa: F401  (the shared broker metrics belong to every process)

if TYPE_CHECKING:
    from fedbroker.worker.training import TrainResult

log = logging.getLogger(__name__)

TASKS_RECEIVED = Counter("fedbroker_worker_tasks_received_total", "Round tasks delivered to the worker.",
                         ["worker_id"])
TASKS_REDELIVERED = Counter(
    "fedbroker_worker_tasks_redelivered_total",
    "Task deliveries that were delivered before (a crash, a requeue, a lost connection).", ["worker_id"])
TASKS_ACKED = Counter("fedbroker_worker_tasks_acked_total", "Task messages acked (done, refused or failed for good).",
                      ["worker_id"])
TASKS = Counter(
    "fedbroker_worker_tasks_total",
    "Task outcomes: uploaded, already_uploaded, refused, failed, requeued (retried later), malformed, "
    "foreign_sender (published by another broker user than the coordinator's: dead-lettered, never trained).",
    ["worker_id", "outcome"])
TRAINING_SECONDS = Histogram(
    "fedbroker_worker_training_seconds", "Local training time of one task.", ["worker_id"],
    buckets=(0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0),
)
TRAINED_SAMPLES = Counter(
    "fedbroker_worker_trained_samples_total", "Samples processed by local training (every epoch counts).",
    ["worker_id"])
SAMPLES_PER_SECOND = Gauge(
    "fedbroker_worker_training_samples_per_second", "Training throughput of the worker's last task.", ["worker_id"])
PEAK_MEMORY = Gauge("fedbroker_worker_peak_memory_bytes",
                    "The worker process's peak resident memory (ru_maxrss) after its last training task.", ["worker_id"])
TRAIN_LOSS = Gauge("fedbroker_worker_train_loss", "Mean training loss of the worker's last task.", ["worker_id"])
EPSILON_SPENT = Gauge(
    "fedbroker_worker_epsilon_spent", "Privacy loss ε spent by this data owner so far, over every job (δ fixed).",
    ["worker_id"])
EPSILON_BUDGET = Gauge("fedbroker_worker_epsilon_budget", "The data owner's total ε budget.", ["worker_id"])
EPSILON_REMAINING = Gauge(
    "fedbroker_worker_epsilon_budget_remaining", "ε the data owner can still spend (budget minus spent, at least 0).",
    ["worker_id"])
NEXT_ROUND_EPSILON = Gauge(
    "fedbroker_worker_epsilon_next_round_cost",
    "ε the worker's next round would add to its spending, as last projected when it checked a task against "
    "its budget (a round like that one: same job, same training settings). Above the budget remaining, the "
    "worker refuses such rounds.", ["worker_id"])
TASKS_REFUSED = Counter(
    "fedbroker_worker_tasks_refused_total",
    "Tasks refused before training, by reason: task_refused (category, deadline, round closed, a model whose "
    "input preprocessing contradicts data.standardize), "
    "privacy_budget_exceeded, ledger_behind (the ledger holds less ε than the coordinator recorded: it was lost "
    "or replaced; the worker trains no more until it is restored), model_over_limits (the model is over the "
    "site's worker.limits).", ["worker_id", "reason"])
REFUSAL_REASONS = ("task_refused", "privacy_budget_exceeded", "ledger_behind", "model_over_limits")
TASKS_FAILED = Counter(
    "fedbroker_worker_tasks_failed_total",
    "Tasks failed for good and acked (never retried), by reason: data_mismatch (the job's model does not fit "
    "this worker's data), deadline_passed (training outlived the round), update_refused (the aggregation "
    "service refused the update for good).",
    ["worker_id", "reason"])
SHARE_REQUESTS = Counter(
    "fedbroker_worker_share_requests_total",
    "Jobs' share requests (label histogram, feature statistics before round 1), by outcome: shared, refused "
    "(the site's policy, budget or a bad range: the reply says why), expired (past its deadline, unanswered).",
    ["worker_id", "outcome"])
SHARE_OUTCOMES = ("shared", "refused", "expired")
SENT_BYTES = Counter("fedbroker_worker_sent_bytes_total", "Tensor bytes uploaded to the aggregation service.",
                     ["worker_id"])
RECEIVED_BYTES = Counter(
    "fedbroker_worker_received_bytes_total", "Tensor bytes of global models downloaded.", ["worker_id"])


def set_privacy(worker_id: str, *, spent: float, budget: float | None) -> None:
    """ε gauges; a worker without DP exports none (it has no budget to exhaust)."""
    if budget is None:
        return
    EPSILON_SPENT.labels(worker_id).set(spent)
    EPSILON_BUDGET.labels(worker_id).set(budget)
    EPSILON_REMAINING.labels(worker_id).set(max(0.0, budget - spent))


# The outcomes `TASKS` counts, each given a 0 series when a worker starts.
TASK_OUTCOMES = ("uploaded", "already_uploaded", "refused", "failed", "requeued", "malformed", "foreign_sender")
EVALUATIONS = Counter(
    "fedbroker_worker_evaluations_total",
    "Federated evaluation tasks, by outcome: evaluated (scored on the held-out split and reported), refused "
    "(reported with the reason: the owner's worker.evaluation deny, no held-out data, a model it could not fetch "
    "or that does not fit), late (past the deadline: acked, not reported), malformed (dead-lettered).",
    ["worker_id", "outcome"])
EVALUATION_OUTCOMES = ("evaluated", "refused", "late", "malformed")
PRESENCE_BEATS = Counter(
    "fedbroker_worker_presence_beats_total",
    "Heartbeats at the aggregation service (WorkerPresence.KeepAlive, worker/presence.py), by outcome: accepted, "
    "early (before the due time the service set: waited out), refused (another worker's token, no valid token, a "
    "service without KeepAlive: tried again every 10 minutes), failed (the service down or unreachable: backed off).",
    ["worker_id", "outcome"])
PRESENCE_OUTCOMES = ("accepted", "early", "refused", "failed")


def presence_started(worker_id: str) -> None:
    """The presence counters of this worker at 0 (only a worker that beats has them)."""
    for outcome in PRESENCE_OUTCOMES:
        PRESENCE_BEATS.labels(worker_id, outcome)


def worker_started(worker_id: str) -> None:
    """Create every counter (and the training-time histogram) of this worker at 0."""
    for counter in (TASKS_RECEIVED, TASKS_REDELIVERED, TASKS_ACKED, TRAINED_SAMPLES, SENT_BYTES, RECEIVED_BYTES):
        counter.labels(worker_id)
    for outcome in TASK_OUTCOMES:
        TASKS.labels(worker_id, outcome)
    for reason in REFUSAL_REASONS:
        TASKS_REFUSED.labels(worker_id, reason)
    for outcome in SHARE_OUTCOMES:
        SHARE_REQUESTS.labels(worker_id, outcome)
    for outcome in EVALUATION_OUTCOMES:
        EVALUATIONS.labels(worker_id, outcome)
    TRAINING_SECONDS.labels(worker_id)


def export_training(worker_id: str, result: TrainResult, *, memory_mib: int) -> None:
    """A trained task's time, throughput and loss, and the process's peak memory against the data budget."""
    from fedbroker.worker.batches import peak_memory_bytes  # torch's module: only a process that trains needs it

    TRAINING_SECONDS.labels(worker_id).observe(result.seconds)
    if math.isfinite(result.samples_per_second):
        TRAINED_SAMPLES.labels(worker_id).inc(round(result.samples_per_second * result.seconds))
        SAMPLES_PER_SECOND.labels(worker_id).set(result.samples_per_second)
    TRAIN_LOSS.labels(worker_id).set(result.train_loss)
    peak = peak_memory_bytes()
    PEAK_MEMORY.labels(worker_id).set(peak)
    log.info("worker %s: peak memory %.0f MiB (the data budget worker.data.memory_mib: %d MiB)", worker_id,
             peak / 2**20, memory_mib)


def set_next_round_cost(worker_id: str, *, epsilon: float) -> None:
    """The projected ε of the worker's next round, for the alert "cannot afford the next round"."""
    NEXT_ROUND_EPSILON.labels(worker_id).set(max(0.0, epsilon))
