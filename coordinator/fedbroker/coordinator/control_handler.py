"""What the coordinator does with its control queue's messages once they passed `control.check_control`:
a registration declares the worker's task queue and records it, a heartbeat refreshes it and its budget,
a task outcome is recorded against its round (or handed to its asynchronous job) and wakes the job's loop.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from fedbroker import envelope
from fedbroker.bus import Bus, Delivery
from fedbroker.config import DPPolicy
from fedbroker.coordinator import metrics
from fedbroker.coordinator.asynchronous import AsyncJob
from fedbroker.coordinator.control import MAX_REASON_CHARS, InvalidControlMessage, check_control
from fedbroker.coordinator.events import JobWatcher
from fedbroker.coordinator.participants import WorkerBudgets, budget_from_heartbeat
from fedbroker.coordinator.records import ParticipantStatus, WorkerState
from fedbroker.coordinator.store import StateStore
from fedbroker.proto import fedbroker_pb2 as pb

log = logging.getLogger(__name__)


class ControlHandler:
    """The control queue's consumer; `async_job(job_id)`: the running asynchronous job of that id, if any
    (its task outcomes go to it: its task numbers are not rounds)."""

    def __init__(self, *, bus: Bus, store: StateStore, events: JobWatcher, budgets: WorkerBudgets,
                 async_job: Callable[[str], AsyncJob | None]) -> None:
        self.bus = bus
        self.store = store
        self.events = events
        self.budgets = budgets
        self._async_job = async_job

    def on_control(self, delivery: Delivery) -> None:
        """Handle one message and ack it; one that cannot be decoded or checked is dead-lettered with a
        reason, never stored."""
        try:
            env = envelope.decode(delivery.body, expect=("registration", "heartbeat", "task_outcome"))
        except envelope.MalformedMessage as exc:
            log.warning("dead-lettering a control message: %s", exc)
            metrics.CONTROL_REJECTED.labels(exc.reason).inc()
            delivery.nack(requeue=False)
            return
        try:
            check_control(env)  # never stored, never selected: a job never meets a worker id it cannot route
        except InvalidControlMessage as exc:
            log.warning("dead-lettering a control message: %s", exc)
            metrics.CONTROL_REJECTED.labels(exc.reason).inc()
            delivery.nack(requeue=False)
            return
        kind = env.WhichOneof("message")
        if kind == "registration":
            self._register(env.registration)
        elif kind == "heartbeat":
            self._heartbeat(env.heartbeat)
        else:
            self._outcome(env.task_outcome)
        delivery.ack()

    def _register(self, r: pb.Registration) -> None:
        # Its task queue exists before any task is published to it: a worker that registered but never
        # consumes holds its task there and is a straggler, instead of an unroutable publish.
        self.bus.declare_worker(r.worker_id)
        self._note_epsilon(r.worker_id, r.epsilon_spent, "registration")
        p = r.dp_policy  # checked when enabled (check_control); a disabled policy's numbers are never used
        dp = DPPolicy(enabled=r.dp_enabled, noise_multiplier=p.noise_multiplier, max_grad_norm=p.max_grad_norm,
                      delta=p.delta, epsilon_budget=p.epsilon_budget)
        self.store.upsert_worker(
            worker_id=r.worker_id, categories=r.categories, histogram=r.label_histogram, dp=dp,
            epsilon_spent=r.epsilon_spent, device=r.device, num_samples=r.num_samples,
            input_shape=r.input_shape, num_classes=r.num_classes,
        )
        log.info("worker %s registered (%s, %d samples, categories %s)", r.worker_id, r.device, r.num_samples,
                 list(r.categories))

    def _heartbeat(self, h: pb.Heartbeat) -> None:
        self._note_epsilon(h.worker_id, h.epsilon_spent, "heartbeat")
        if not self.store.touch_worker(h.worker_id, epsilon_spent=h.epsilon_spent, state=WorkerState(h.state)):
            log.warning("heartbeat from unknown worker %r ignored", h.worker_id)
        else:
            self.budgets.note(h.worker_id, budget_from_heartbeat(h))

    def _outcome(self, o: pb.TaskOutcome) -> None:
        status = ParticipantStatus(pb.TaskOutcome.Status.Name(o.status).lower())
        metrics.TASK_OUTCOMES.labels(status).inc()
        reason = o.reason[:MAX_REASON_CHARS]
        driver = self._async_job(o.job_id)
        if driver is not None:  # an asynchronous job's task: round is the task number
            driver.outcome(o.worker_id, o.round, status, reason)
        elif not self.store.record_outcome(o.job_id, o.round, o.worker_id, status, reason,
                                           epsilon=o.epsilon if math.isfinite(o.epsilon) else 0.0):
            log.warning("outcome from %r for unknown task (%s, round %d) ignored", o.worker_id, o.job_id, o.round)
        else:
            log.info("worker %s %s round %d of %s: %s", o.worker_id, status, o.round, o.job_id, o.reason)
        self.events.poke(o.job_id)  # the round (or async job) waiting on it looks again now

    def _note_epsilon(self, worker_id: str, reported: float, message: str) -> None:
        """ε never falls silently: the store keeps the highest ε a worker reported (its tasks carry it, and a
        worker whose ledger total is below refuses to train); a lower report is logged and counted here."""
        recorded = self.store.recorded_epsilon(worker_id)
        if recorded is not None and reported < recorded - 1e-9 * max(1.0, recorded):
            metrics.EPSILON_DECREASES.labels(message).inc()
            log.error("worker %s reported ε %.6g in a %s, below the %.6g recorded for it: its privacy ledger was "
                      "lost or replaced; keeping %.6g, and its tasks will be refused until its ledger is restored",
                      worker_id, reported, message, recorded, recorded)
