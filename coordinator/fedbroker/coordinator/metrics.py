"""The coordinator's metrics, defined once per process (see `fedbroker.metrics` for why the default registry).

Round counters carry a `job_id` label: jobs are few and submitted by people, unlike rounds or samples,
which never become labels (the round number is a gauge's value). The label is `job_id`, not `job`,
which Prometheus reserves for the scrape job. Worker and job counts are read from the state store at
scrape time, so "active" is always judged against the current clock.

Every labelled counter has its series at 0 from the moment its label value is known (`job_started`; fixed
label sets at import): a series that first appears at 1 hides its first increase from `increase()` and
`rate()`, so an alert on it could never fire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Metric
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

import fedbroker.metrics  # noqa: F401  (the shared gRPC and broker metrics belong to every process)
from fedbroker.coordinator.control import INVALID_REASONS, SENDER_REASONS
from fedbroker.coordinator.records import WorkerRecord
from fedbroker.coordinator.store import StateStore
from fedbroker.job.status import JobStatus
from fedbroker.metrics import zeroed
from fedbroker.proto import fedbroker_pb2 as pb

log = logging.getLogger(__name__)

ROUNDS_STARTED = Counter("fedbroker_coordinator_rounds_started_total", "Rounds opened, per job.", ["job_id"])
ROUNDS_COMPLETED = Counter(
    "fedbroker_coordinator_rounds_completed_total", "Rounds closed into a new global model, per job.", ["job_id"])
ROUNDS_FAILED = Counter(
    "fedbroker_coordinator_rounds_failed_total",
    "Rounds that ended without a new global model (too few uploads, an error), per job.", ["job_id"])
ROUND_DURATION = Histogram(
    "fedbroker_coordinator_round_duration_seconds", "Wall time of a round, from selection to checkpoint.",
    buckets=(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0),
)
ROUND = Gauge("fedbroker_coordinator_round", "Number of the job's current (or last) round.", ["job_id"])
ROUND_OPEN = Gauge("fedbroker_coordinator_round_open", "1 while a round of the job is open, else 0.", ["job_id"])
ROUND_DEADLINE = Gauge(
    "fedbroker_coordinator_round_deadline_timestamp_seconds", "Unix time the job's current round must close by.",
    ["job_id"])
ROUND_PARTICIPANTS = Gauge(
    "fedbroker_coordinator_round_participants", "Workers selected for the job's current round.", ["job_id"])
ROUND_AGGREGATED = Gauge(
    "fedbroker_coordinator_round_aggregated", "Updates aggregated in the job's last closed round.", ["job_id"])
TASKS_PUBLISHED = Counter(
    "fedbroker_coordinator_tasks_published_total", "Round tasks published to workers (persistent, confirmed).")
TASK_OUTCOMES = Counter(
    "fedbroker_coordinator_task_outcomes_total", "Refusals and failures reported by workers, by status.",
    ["status"])
JOBS_REJECTED = Counter(
    "fedbroker_coordinator_jobs_rejected_total",
    "Job submissions refused, by reason (invalid_config: the spec failed validation; unauthenticated, "
    "permission_denied: the caller's token).", ["reason"])
CONTROL_REJECTED = Counter(
    "fedbroker_coordinator_control_messages_rejected_total",
    "Control-queue messages dead-lettered because they could not be decoded or checked, or because their broker "
    "user may not speak for their worker (unidentified_sender, foreign_sender), by reason.", ["reason"])
EPSILON_JUMPS = zeroed(Counter(
    "fedbroker_coordinator_epsilon_jumps_refused_total",
    "Task outcomes (and asynchronous updates no version holds) whose ε claim for a job was above what the job's "
    "tasks to their worker were priced at: the claim is refused, never stored, by message (a site's own total is "
    "advisory, never stored).", ["message"]),
    "task_outcome", "not_aggregated")
EPSILON_DECREASES = zeroed(Counter(
    "fedbroker_coordinator_epsilon_decreases_total",
    "Registrations and heartbeats that reported a lower ε than recorded for their worker (a lost or replaced "
    "ledger; the claim is never stored), by message.", ["message"]),
    "registration", "heartbeat")
STRAGGLERS = Counter(
    "fedbroker_coordinator_stragglers_total",
    "Selected workers that neither uploaded nor answered before their round closed, per job.", ["job_id"])
MODEL_ACCURACY = Gauge(
    "fedbroker_coordinator_model_accuracy", "Accuracy (0-1) of the job's latest global model on its evaluation set.",
    ["job_id"])
MODEL_LOSS = Gauge(
    "fedbroker_coordinator_model_loss", "Mean loss of the job's latest global model on its evaluation set.",
    ["job_id"])
# Federated evaluation (coordinator/federated.py): the sites' scores of the global model on their held-out splits.
FEDERATED_ACCURACY = Gauge(
    "fedbroker_coordinator_federated_accuracy",
    "Accuracy (0-1) of the job's latest site-evaluated global model on the sites' held-out splits, their scores "
    "weighted by their counts (federated evaluation; as reports arrive).", ["job_id"])
FEDERATED_LOSS = Gauge(
    "fedbroker_coordinator_federated_loss",
    "Mean loss of the job's latest site-evaluated global model on the sites' held-out splits (weighted by count).",
    ["job_id"])
FEDERATED_SITES = Gauge(
    "fedbroker_coordinator_federated_evaluated_sites",
    "Sites whose score is in the job's latest federated accuracy.", ["job_id"])
EVALUATION_TASKS_PUBLISHED = Counter(
    "fedbroker_coordinator_evaluation_tasks_published_total", "Federated evaluation tasks published to sites.")
EVALUATION_REPORTS = Counter(
    "fedbroker_coordinator_evaluation_reports_total",
    "Sites' evaluation reports recorded, per site and status (evaluated: a score; refused: the site's policy or "
    "a problem it reported).", ["worker_id", "status"])
EVALUATION_REPORTS_REFUSED = Counter(
    "fedbroker_coordinator_evaluation_reports_refused_total",
    "Evaluation reports not recorded, by reason: not_asked (no such task was sent to that worker: forged or "
    "misrouted), wrong_version, late (after the round's evaluation deadline), conflict (a second, different report "
    "for one task), implausible_count (more held-out samples than the worker's registration allows).", ["reason"])
EVALUATION_REFUSAL_REASONS = ("not_asked", "wrong_version", "late", "conflict", "implausible_count")
# Sites' forwarded warnings and errors (coordinator/sites.py), by what became of them.
SITE_LOG_RECORDS = Counter(
    "fedbroker_coordinator_site_log_records_total",
    "Warnings and errors sites forwarded, by outcome: stored; misattributed (stored under the site its broker user "
    "speaks for, though it named another); rate_limited (over the site's allowance: dropped); unknown_site (no "
    "registered site); foreign_sender (its broker user speaks for no site).", ["outcome"])
SITE_LOG_OUTCOMES = ("stored", "misattributed", "rate_limited", "unknown_site", "foreign_sender")
# Per-site series (a worker_id label) only for a bounded set: the provisioned sites where senders are bound
# (coordinator.worker_broker_users), else at most this many registered sites, by id.
MAX_SITE_SERIES = 64

# Counters labelled by job, given a 0 series when a job starts (or resumes) in this process.
# Asynchronous mode (schedule.mode async): versions instead of rounds.
VERSIONS = Counter("fedbroker_coordinator_versions_total",
                   "Global versions an asynchronous job's buffer published (and the coordinator checkpointed), per job.",
                   ["job_id"])
LAST_VERSION_TIME = Gauge(
    "fedbroker_coordinator_last_version_timestamp_seconds",
    "Unix time of the asynchronous job's newest version (or of its start): the no-progress alert reads it.",
    ["job_id"])
BUFFER_FILL = Gauge("fedbroker_coordinator_buffer_fill_ratio",
                    "Updates in the asynchronous job's buffer over its buffer_size, at the last look.", ["job_id"])
ASYNC_RUNNING = Gauge("fedbroker_coordinator_async_job_running", "1 while an asynchronous job runs, else 0.",
                      ["job_id"])
# The standby coordinator (coordinator/standby.py): which of the two leads, and at which fencing term.
LEADER = Gauge("fedbroker_coordinator_leader",
               "1 while this coordinator holds the lease `coordinator` and runs jobs; 0 while it stands by.")
LEASE_TERM = Gauge("fedbroker_coordinator_lease_term",
                   "The fencing term of the lease `coordinator` this process leads at (0: it does not lead): "
                   "each takeover raises it by one.")
JOB_COUNTERS = (ROUNDS_STARTED, ROUNDS_COMPLETED, ROUNDS_FAILED, STRAGGLERS)
# Label values known in advance: the outcomes a worker reports, the refusal reasons of SubmitJob and the
# control queue.
TASK_STATUSES = tuple(name.lower() for name, number in pb.TaskOutcome.Status.items() if number)
JOB_REJECTION_REASONS = ("invalid_config", "unauthenticated", "permission_denied")
CONTROL_REJECTION_REASONS = ("malformed_message", *INVALID_REASONS.values(), *SENDER_REASONS)
zeroed(TASK_OUTCOMES, *TASK_STATUSES)
zeroed(JOBS_REJECTED, *JOB_REJECTION_REASONS)
zeroed(CONTROL_REJECTED, *CONTROL_REJECTION_REASONS)
zeroed(EVALUATION_REPORTS_REFUSED, *EVALUATION_REFUSAL_REASONS)
zeroed(SITE_LOG_RECORDS, *SITE_LOG_OUTCOMES)
# Jobs that need their category's workers (the category gauges count them).
_WAITING = (JobStatus.PENDING, JobStatus.RUNNING)
# How long a scrape waits for the broker's count of dead letters before it leaves the series out.
DEAD_LETTER_TIMEOUT_S = 2.0


def job_started(job_id: str) -> None:
    """Create the job's counter series at 0, so its first round counted is an increase Prometheus sees."""
    for counter in JOB_COUNTERS:
        counter.labels(job_id)


class DeadLetters(Protocol):
    """What the collector reads of the coordinator's bus."""

    def dead_letter_count(self, *, timeout_s: float = ...) -> int:
        """Messages in the dead-letter queue; raises when the broker does not answer within `timeout_s`."""
        ...


class Registry(Protocol):
    """What the collector reads of the bound coordinator: its store, heartbeat timeout and bus."""

    @property
    def store(self) -> StateStore:
        """Workers and jobs, read at scrape time."""
        ...

    @property
    def heartbeat_timeout_s(self) -> float:
        """A worker seen within this many seconds is active."""
        ...

    @property
    def bus(self) -> DeadLetters:
        """Asked for the dead-letter queue's depth."""
        ...

    @property
    def provisioned_sites(self) -> frozenset[str]:
        """The worker ids broker users may speak for (empty: senders are not checked)."""
        ...


class RegistryCollector(Collector):
    """Workers registered/active and jobs by status, read from the bound coordinator's store per scrape."""

    def __init__(self) -> None:
        self._coordinator: Registry | None = None
        self._lock = threading.Lock()

    def bind(self, coordinator: Registry) -> None:
        """Scrapes read this coordinator from now on (a process runs one)."""
        with self._lock:
            self._coordinator = coordinator

    def unbind(self, coordinator: Registry) -> None:
        """A stopped coordinator is read no more (unless another was bound since)."""
        with self._lock:
            if self._coordinator is coordinator:
                self._coordinator = None

    def describe(self) -> Iterable[Metric]:
        """The families without samples: registering must not read a store."""
        return self._families()

    def collect(self) -> Iterable[Metric]:
        """The families with this scrape's samples (none while no coordinator is bound)."""
        with self._lock:
            coordinator = self._coordinator
        return self._families(coordinator)

    @staticmethod
    def _families(coordinator: Registry | None = None) -> list[Metric]:
        registered = GaugeMetricFamily("fedbroker_coordinator_workers_registered", "Workers that ever registered.")
        active = GaugeMetricFamily(
            "fedbroker_coordinator_workers_active", "Workers whose last heartbeat is within the heartbeat timeout.")
        jobs = GaugeMetricFamily("fedbroker_coordinator_jobs", "Jobs by status.", labels=["status"])
        category_active = GaugeMetricFamily(
            "fedbroker_coordinator_category_workers_active",
            "Active workers serving each data category that a worker serves or a pending or running job needs "
            "(0 for a category jobs wait on and no worker serves).", labels=["category"])
        category_jobs = GaugeMetricFamily(
            "fedbroker_coordinator_category_jobs", "Pending and running jobs by data category.",
            labels=["category", "status"])
        dead = GaugeMetricFamily(
            "fedbroker_coordinator_dead_letter_messages",
            "Messages in the broker's dead-letter queue (<namespace>.dead): tasks and control messages that "
            "failed on every attempt or could not be read. Left out when the broker does not answer.")
        ages = GaugeMetricFamily(
            "fedbroker_coordinator_site_heartbeat_age_seconds",
            "Seconds since each site's last registration or heartbeat (the provisioned sites; without "
            f"worker_broker_users, the first {MAX_SITE_SERIES} registered by id).", labels=["worker_id"])
        site_logs = CounterMetricFamily(
            "fedbroker_coordinator_site_log_records_stored",
            "Warnings and errors each site forwarded and the coordinator kept, all time (the sites of "
            "fedbroker_coordinator_site_heartbeat_age_seconds).", labels=["worker_id"])
        families: list[Metric] = [registered, active, jobs, category_active, category_jobs, dead, ages, site_logs]
        if coordinator is None:
            return families
        try:
            now = time.time()
            workers = coordinator.store.workers()
            counts = dict.fromkeys(JobStatus, 0)
            waiting: dict[tuple[str, JobStatus], int] = {}
            for row in coordinator.store.jobs():
                counts[row.status] += 1
                if row.status in _WAITING:
                    waiting[(row.category, row.status)] = waiting.get((row.category, row.status), 0) + 1
        except Exception as exc:  # a closed store: report nothing rather than fail the whole scrape
            log.debug("coordinator metrics unavailable: %s", exc)
            return families
        live = [w for w in workers if now - w.last_seen <= coordinator.heartbeat_timeout_s]
        registered.add_metric([], float(len(workers)))
        active.add_metric([], float(len(live)))
        for status, count in counts.items():
            jobs.add_metric([status], float(count))
        categories = {c for w in workers for c in w.categories} | {category for category, _ in waiting}
        for category in sorted(categories):
            category_active.add_metric([category], float(sum(category in w.categories for w in live)))
            for status in _WAITING:
                category_jobs.add_metric([category, status], float(waiting.get((category, status), 0)))
        _add_sites(ages, site_logs, coordinator, workers, now)
        try:
            dead.add_metric([], float(coordinator.bus.dead_letter_count(timeout_s=DEAD_LETTER_TIMEOUT_S)))
        except Exception as exc:  # a broker outage: no sample, and FedbrokerBrokerConnectionLost says why
            log.debug("dead-letter queue depth unavailable: %s", exc)
        return families


def _add_sites(ages: GaugeMetricFamily, site_logs: CounterMetricFamily, coordinator: Registry,
               workers: list[WorkerRecord], now: float) -> None:
    """Each site's heartbeat age and forwarded records, for a bounded set of sites (MAX_SITE_SERIES)."""
    provisioned = coordinator.provisioned_sites
    shown = [w for w in workers if w.worker_id in provisioned] if provisioned else workers[:MAX_SITE_SERIES]
    try:
        infos = coordinator.store.site_infos()
    except Exception as exc:  # as above: leave the series out rather than fail the scrape
        log.debug("site metrics unavailable: %s", exc)
        return
    for w in shown:
        ages.add_metric([w.worker_id], max(0.0, now - w.last_seen))
        info = infos.get(w.worker_id)
        site_logs.add_metric([w.worker_id], float(info.log_records if info is not None else 0))


REGISTRY_COLLECTOR = RegistryCollector()
REGISTRY.register(REGISTRY_COLLECTOR)
