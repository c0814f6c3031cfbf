"""The coordinator's metrics, defined once per process (see `fedbroker.metrics` for why the default registry).

Round counters carry a `job_id` label: jobs are few and submitted by people, unlike rounds or samples,
which never become labels (the round number is a gauge's value). The label is `job_id`, not `job`,
which Prometheus reserves for the scrape job. Worker and job counts are read from the state store at
scrape time, so "active" is always judged against the current clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

import fedbroker.metrics  # noqa: F401  (the shared gRPC and broker metrics belong to every process)
from fedbroker.coordinator.state import StateStore

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
    "Control-queue messages dead-lettered because they could not be decoded, by reason.", ["reason"])
STRAGGLERS = Counter(
    "fedbroker_coordinator_stragglers_total",
    "Selected workers that neither uploaded nor answered before their round closed, per job.", ["job_id"])
MODEL_ACCURACY = Gauge(
    "fedbroker_coordinator_model_accuracy", "Accuracy (0-1) of the job's latest global model on its evaluation set.",
    ["job_id"])
MODEL_LOSS = Gauge(
    "fedbroker_coordinator_model_loss", "Mean loss of the job's latest global model on its evaluation set.",
    ["job_id"])


class Registry(Protocol):
    """What the collector reads of the bound coordinator: its store and heartbeat timeout."""

    @property
    def store(self) -> StateStore: ...

    @property
    def heartbeat_timeout_s(self) -> float: ...


class RegistryCollector(Collector):
    """Workers registered/active and jobs by status, read from the bound coordinator's store per scrape."""

    def __init__(self) -> None:
        self._coordinator: Registry | None = None
        self._lock = threading.Lock()

    def bind(self, coordinator: Registry) -> None:
        with self._lock:
            self._coordinator = coordinator

    def unbind(self, coordinator: Registry) -> None:
        with self._lock:
            if self._coordinator is coordinator:
                self._coordinator = None

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            coordinator = self._coordinator
        return self._families(coordinator)

    @staticmethod
    def _families(coordinator: Registry | None = None) -> list[Metric]:
        registered = GaugeMetricFamily("fedbroker_coordinator_workers_registered", "Workers that ever registered.")
        active = GaugeMetricFamily(
            "fedbroker_coordinator_workers_active", "Workers whose last heartbeat is within the heartbeat timeout.")
        jobs = GaugeMetricFamily("fedbroker_coordinator_jobs", "Jobs by status.", labels=["status"])
        if coordinator is not None:
            try:
                now = time.time()
                workers = coordinator.store.workers()
                counts = {status: 0 for status in ("pending", "running", "completed", "failed")}
                for row in coordinator.store.jobs():
                    counts[row["status"]] = counts.get(row["status"], 0) + 1
            except Exception as exc:  # a closed store: report nothing rather than fail the whole scrape
                log.debug("coordinator metrics unavailable: %s", exc)
                return [registered, active, jobs]
            registered.add_metric([], float(len(workers)))
            active.add_metric([], float(sum(now - w.last_seen <= coordinator.heartbeat_timeout_s for w in workers)))
            for status, count in counts.items():
                jobs.add_metric([status], float(count))
        return [registered, active, jobs]


REGISTRY_COLLECTOR = RegistryCollector()
REGISTRY.register(REGISTRY_COLLECTOR)
