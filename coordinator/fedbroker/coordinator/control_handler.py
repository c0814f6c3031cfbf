"""What the coordinator does with its control queue's messages once they passed `control.check_control` and
their sender may speak for their worker (`control.SenderBinding`): a registration declares the worker's task
queue and records it, a heartbeat refreshes it and its budget, a task outcome is recorded against its round (or
against its asynchronous job) and wakes the job's loop, a share reply is recorded against its job's share
phase once it holds what the job asked (sharing.receive_reply; else it is refused like an invalid message), an
evaluation report against the task it answers (coordinator/federated.py), a site's forwarded log record under the
site its sender speaks for (sites.SiteLogIntake). What it learns about a site (registered, restarted, refused a
task and why, failed, refused to evaluate, a message naming it from another broker user) goes into that site's
own history (store_sites.py) for the operator (`fedbroker sites show`).

A site's recorded ε comes only from what the coordinator priced (store.recorded_epsilon): a registration's or
heartbeat's total is advisory, never stored (where broker users are shared, anyone could send one, and a record
above the site's ledger locks it out); one below the record is logged (a lost ledger). A task outcome's ε for a
job is kept in the job's record only within what the job's tasks to that worker were priced at
(participants.EpsilonBounds); above it the claim is refused, counted
(`fedbroker_coordinator_epsilon_jumps_refused_total{message}`) and never stored, and the rest of the message is
handled (a forger able to send it could send the same message with a plausible ε).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fedbroker.bus import Bus, Delivery, envelope
from fedbroker.config import DPPolicy
from fedbroker.coordinator import metrics
from fedbroker.coordinator.asynchronous import AsyncJob
from fedbroker.coordinator.control import (
    MAX_REASON_CHARS,
    ForeignSender,
    InvalidControlMessage,
    SenderBinding,
    check_control,
)
from fedbroker.coordinator.events import JobWatcher
from fedbroker.coordinator.federated import accept_report
from fedbroker.coordinator.participants import EpsilonBounds, WorkerBudgets, budget_from_heartbeat
from fedbroker.coordinator.sharing import receive_reply
from fedbroker.coordinator.sites import SiteLogIntake, registration_changes, registration_summary
from fedbroker.coordinator.store import StateStore, StateUnavailable
from fedbroker.coordinator.store_evaluation import EvaluationVerdict
from fedbroker.job.status import ParticipantStatus, WorkerState
from fedbroker.printable import printable, printable_fields
from fedbroker.proto import fedbroker_pb2 as pb

log = logging.getLogger(__name__)


class ControlHandler:
    """The control queue's consumer; `async_job(job_id)`: the running asynchronous job of that id, if any
    (its task outcomes go to it: its task numbers are not rounds). `senders`: who may speak for which worker
    (default: nobody is checked); `bounds`: how much ε each worker can have spent."""

    def __init__(self, *, bus: Bus, store: StateStore, events: JobWatcher, budgets: WorkerBudgets,
                 async_job: Callable[[str], AsyncJob | None], bounds: EpsilonBounds,
                 senders: SenderBinding | None = None) -> None:
        self.bus = bus
        self.store = store
        self.events = events
        self.budgets = budgets
        self.bounds = bounds
        self.senders = senders or SenderBinding({})
        self.site_logs = SiteLogIntake(store, self.senders)
        self._async_job = async_job

    def on_control(self, delivery: Delivery) -> None:
        """Handle one message and ack it; one that cannot be decoded or checked, or whose sender may not speak
        for its worker, is dead-lettered with a reason, never stored."""
        try:
            env = envelope.decode(delivery.body, expect=("registration", "heartbeat", "task_outcome", "share_reply",
                                                         "evaluation_report", "site_log"))
            check_control(env)  # never stored, never selected: a job never meets a worker id it cannot route
            printable_fields(env, limit=MAX_REASON_CHARS)  # every string it holds, before any is logged or stored
            if env.WhichOneof("message") == "site_log":  # filed under its sender's site, whatever it claims
                self.site_logs.receive(env.site_log, delivery.sender)
                delivery.ack()
                return
            self.senders.check(env, delivery.sender)
            if env.WhichOneof("message") == "share_reply":  # a late, unasked or mismatched one is refused here
                excluded = receive_reply(self.store, env.share_reply)
                delivery.ack()
                if excluded:  # the site's own history says so too (`sites show`)
                    self._site_event(env.share_reply.worker_id, "statistics_excluded",
                                     f"job {env.share_reply.job_id}: " + "; ".join(excluded), error=True)
                return
        except (envelope.MalformedMessage, InvalidControlMessage, ForeignSender) as exc:
            log.warning("dead-lettering a control message: %s", printable(str(exc), limit=MAX_REASON_CHARS))
            metrics.CONTROL_REJECTED.labels(exc.reason).inc()
            delivery.nack(requeue=False)
            if isinstance(exc, ForeignSender):  # the site it claims to be learns of it (a registered one only)
                kind = env.WhichOneof("message") or ""
                self._site_event(str(getattr(env, kind).worker_id), "refused_sender",
                                 f"a {kind} naming this site from broker user {(delivery.sender or '')[:140]!r} "
                                 f"was refused ({exc.reason})")
            return
        kind = env.WhichOneof("message")
        if kind == "registration":
            self._register(env.registration, delivery.sender)
        elif kind == "heartbeat":
            self._heartbeat(env.heartbeat)
        elif kind == "evaluation_report":  # a site's score of a global model: coordinator/federated.py
            self._evaluation(env.evaluation_report)
        else:
            self._outcome(env.task_outcome)
        delivery.ack()

    def _register(self, r: pb.Registration, sender: str | None = None) -> None:
        # Its task queue exists before any task is published to it: a worker that registered but never
        # consumes holds its task there and is a straggler, instead of an unroutable publish.
        self.bus.declare_worker(r.worker_id)
        self._note_claim(r.worker_id, r.epsilon_spent, "registration")
        p = r.dp_policy  # checked when enabled (check_control); a disabled policy's numbers are never used
        dp = DPPolicy(enabled=r.dp_enabled, noise_multiplier=p.noise_multiplier, max_grad_norm=p.max_grad_norm,
                      delta=p.delta, epsilon_budget=p.epsilon_budget, mode=p.mode or "local",  # "": before dp.mode
                      local_floor_epsilon=p.local_floor_epsilon)
        if r.label_histogram:  # a site shares its histogram with the jobs that need it, never at registration
            log.info("worker %s registered a label histogram: not stored (a site shares it only with the jobs "
                        "whose algorithms need it, before their round 1)", r.worker_id)
        old = next((w for w in self.store.workers() if w.worker_id == r.worker_id), None)
        self.store.upsert_worker(
            worker_id=r.worker_id, categories=r.categories, histogram=(), dp=dp,
            epsilon_spent=0.0, device=r.device, num_samples=r.num_samples,
            input_shape=r.input_shape, num_classes=r.num_classes, evaluation_samples=r.evaluation_samples,
        )
        log.info("worker %s registered (%s, %d samples, categories %s)", r.worker_id, r.device, r.num_samples,
                 list(r.categories))
        self._quietly(self.store.note_registration, r.worker_id, software_version=r.software_version,
                      started=r.started_unix, broker_user=sender or "", summary=registration_summary(r),
                      changes=registration_changes(old, r))

    def _heartbeat(self, h: pb.Heartbeat) -> None:
        self._note_claim(h.worker_id, h.epsilon_spent, "heartbeat")
        if not self.store.touch_worker(h.worker_id, state=WorkerState(h.state)):
            log.warning("heartbeat from unknown worker %r ignored", h.worker_id)
        else:
            self.budgets.note(h.worker_id, budget_from_heartbeat(h))
            self._quietly(self.store.note_heard, h.worker_id)

    def _outcome(self, o: pb.TaskOutcome) -> None:
        status = ParticipantStatus(pb.TaskOutcome.Status.Name(o.status).lower())
        metrics.TASK_OUTCOMES.labels(status).inc()
        reason = o.reason  # printable and cut on entry (on_control)
        # The job's ε on the worker's data (checked finite by check_control), within what its tasks were priced at
        epsilon = o.epsilon if self._within_bound(o.worker_id, o.epsilon, o.job_id) else 0.0
        driver = self._async_job(o.job_id)
        job = self.store.job(o.job_id) if driver is None else None
        if driver is not None or (job is not None and job.mode == "async"):  # round is the task number
            if epsilon > 0:  # trained, and no version holds it (even one reported after the job ended)
                self.store.record_async_training(o.job_id, o.worker_id, task=o.round, status=status, reason=reason,
                                                 epsilon=epsilon)
            if driver is not None:
                driver.outcome(o.worker_id, o.round, status, reason)
        elif not self.store.record_outcome(o.job_id, o.round, o.worker_id, status, reason, epsilon=epsilon):
            log.warning("outcome from %r for unknown task (%s, round %d) ignored", o.worker_id, o.job_id, o.round)
        else:
            log.info("worker %s %s round %d of %s: %s", o.worker_id, status, o.round, o.job_id, reason)
            if o.epsilon_local_floor > 0:  # distributed DP: its own share's ε, kept beside the ε (never charged)
                self._quietly(self.store.record_local_floor, o.job_id, o.round, o.worker_id, o.epsilon_local_floor)
        if status in (ParticipantStatus.REFUSED, ParticipantStatus.FAILED):
            where = f"task {o.round}" if driver is not None or (job is not None and job.mode == "async") else \
                f"round {o.round}"
            self._site_event(o.worker_id, str(status), f"{where} of job {o.job_id}: {reason}",
                             error=status == ParticipantStatus.FAILED)
        self.events.poke(o.job_id)  # the round (or async job) waiting on it looks again now

    def _evaluation(self, r: pb.EvaluationReport) -> None:
        """Record a site's score (coordinator/federated.py); a refusal, the site's or ours, goes into its history."""
        verdict = accept_report(self.store, r)
        where = f"round {r.round} of job {r.job_id}"
        if verdict == EvaluationVerdict.RECORDED and r.refused:
            self._site_event(r.worker_id, "evaluation_refused", f"{where}: {r.reason}")
        elif verdict not in (EvaluationVerdict.RECORDED, EvaluationVerdict.DUPLICATE):
            self._site_event(r.worker_id, "evaluation_report_rejected", f"{where}: {verdict}")

    def _site_event(self, worker_id: str, kind: str, message: str, *, error: bool = False) -> None:
        self._quietly(self.store.note_site_event, worker_id, kind, message, error=error)

    @staticmethod
    def _quietly(write: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """A write to a site's history: a store outage loses that line (logged), never the message it is about."""
        try:
            write(*args, **kwargs)
        except StateUnavailable as exc:
            log.warning("a site's history was not written: %s", exc)

    def _within_bound(self, worker_id: str, reported: float, job_id: str) -> bool:
        return self.bounds.allows(worker_id, job_id, reported, message="task_outcome")

    def _note_claim(self, worker_id: str, reported: float, message: str) -> None:
        """A site's own total is advisory: never stored, but one below its record means its ledger was lost or
        replaced (its tasks will be refused until the ledger is restored), which the operator must hear of."""
        recorded = self.store.recorded_epsilon(worker_id)
        if recorded is not None and reported < recorded - 1e-9 * max(1.0, recorded):
            metrics.EPSILON_DECREASES.labels(message).inc()
            log.error("worker %s reported ε %.6g in a %s, below the %.6g recorded for it from the tasks this "
                      "coordinator priced: its privacy ledger was lost or replaced, and its tasks will be refused "
                      "until its ledger is restored", worker_id, reported, message, recorded)
