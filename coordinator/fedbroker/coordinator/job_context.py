"""What every job's loop works with, synchronous (sync_rounds.py) or asynchronous (asynchronous.py): the
store, the bus, the aggregation service and its events, the deployment's timings, and the few things both
loops do the same way (wait for a condition, weigh budgets, publish tasks, describe the population).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from fedbroker.bus import Bus
from fedbroker.coordinator import metrics
from fedbroker.coordinator.control import SenderBinding
from fedbroker.coordinator.events import JobWatcher
from fedbroker.coordinator.job_run import CancelRequests, JobFailed, Stopped
from fedbroker.coordinator.participants import EpsilonBounds, WorkerBudgets, budget_shortfall, why_unaffordable
from fedbroker.coordinator.records import WorkerRecord
from fedbroker.coordinator.service_calls import OUTAGE_BACKOFF, AggregatorCalls
from fedbroker.coordinator.store import StateStore
from fedbroker.coordinator.store_shares import ShareStatus
from fedbroker.coordinator.waiting import WaitingReasons
from fedbroker.errors import BusError
from fedbroker.job.spec import JobSpec, TrainingConfig
from fedbroker.retry import retry_call
from fedbroker.rpc.aggregation_client import AggregatorClient

log = logging.getLogger(__name__)
T = TypeVar("T")

# (job, global model spec JSON, its tensors) → (accuracy, loss) on the job's evaluation set, or None.
Evaluator = Callable[[JobSpec, str, dict[str, np.ndarray]], "tuple[float, float] | None"]


@dataclass(frozen=True, kw_only=True)
class JobContext:
    """Shared by every job's thread; built once by the Coordinator (its constructor documents the timings)."""

    bus: Bus
    store: StateStore
    aggregator: AggregatorClient      # calls once: `calls` does the retrying
    calls: AggregatorCalls
    events: JobWatcher
    stop: threading.Event             # set: the coordinator is stopping
    cancels: CancelRequests
    budgets: WorkerBudgets
    aggregator_target: str            # what a task tells its worker to upload to
    checkpoint_dir: str
    evaluator: Evaluator | None
    heartbeat_timeout_s: float
    poll_interval_s: float
    safety_poll_s: float
    waiting: WaitingReasons           # why each job has not started its next round (JobRow.waiting)
    epsilon_bounds: EpsilonBounds | None = None  # told of every task before it goes out (None: bounds nothing)
    senders: SenderBinding | None = None  # who may speak for which site: a site no user may is revoked
    excluded: set[tuple[str, str]] = field(default_factory=set)  # (job, worker) told out of budget (an event)

    def halt_if_cancelled(self) -> None:
        """In a job's thread, wherever its loop waits: end the job there if it was cancelled."""
        self.cancels.halt_if_requested()

    def poll(self, check: Callable[[], tuple[bool, T]], *, within_s: float) -> tuple[bool, T]:
        """`check()` every poll interval until it says done or `within_s` passes; its last answer either way.
        A stopping coordinator ends the wait at once (`Stopped`), a cancel at its next look (the first one
        included: a cancelled job does not start waiting, nor say why it would)."""
        deadline = time.monotonic() + within_s
        self.halt_if_cancelled()
        while True:
            done, value = check()
            if done or time.monotonic() >= deadline:
                return done, value
            if self.stop.wait(self.poll_interval_s):
                raise Stopped
            self.halt_if_cancelled()

    def active_workers(self, category: str) -> list[WorkerRecord]:
        """The workers of `category` a job may select: heard within the heartbeat timeout, and not revoked (where
        senders are checked, some broker user may still speak for it: `provision revoke` removes its binding, and
        the coordinator follows its config, so a revoked site leaves selection at once)."""
        active = self.store.workers(category, seen_within_s=self.heartbeat_timeout_s)
        bound = self.senders.provisioned() if self.senders is not None else frozenset()
        return [w for w in active if w.worker_id in bound] if bound else active

    def why_unaffordable(self, job_id: str, job: JobSpec) -> dict[str, str]:
        """Each active worker of the job's category, and why it cannot take the job's next round or task ("" when
        it can): it did not share what the job asked of its sites before round 1 (coordinator/sharing.py), or
        cannot afford it by its heartbeat's budget, else its registration's (participants.why_unaffordable)."""
        active = self.active_workers(job.category)
        budgets = self.budgets.snapshot()
        why = {w.worker_id: why_unaffordable(w, budgets.get(w.worker_id), job_id=job_id, training=job.training)
               for w in active}
        phase = self.store.share_phase(job_id)
        if phase is not None and not phase.open:
            shares = {s.worker_id: s for s in self.store.shares(job_id)}
            late = [w for w in why if w not in shares]
            if late:  # registered after the phase: told once, in the job's events
                self.store.note_not_shared(job_id, late, "registered after the job's sites shared")
            for worker_id in why:
                share = shares.get(worker_id)
                if share is None or share.status != ShareStatus.SHARED:
                    part = f"{share.status}{': ' + share.reason if share.reason else ''}" if share else "not asked"
                    why[worker_id] = f"did not share what this job needs before round 1 ({part})"
        return why

    def fail_if_out_of_budget(self, job_id: str, job: JobSpec, *, needed: int, what: str) -> None:
        """Spent ε never comes back: a registered site of the category whose budget cannot cover the job's next
        round is excluded, said once per job (an `excluded` event naming its budget); when fewer than `needed`
        sites are left that could ever take part, JobFailed at once names them all, instead of a wait for
        budget that cannot return (the owner raises a site's budget, then the job is submitted again)."""
        bound = self.senders.provisioned() if self.senders is not None else frozenset()
        registered = [w for w in self.store.workers(job.category) if not bound or w.worker_id in bound]
        budgets = self.budgets.snapshot()
        short = {w.worker_id: s for w in registered
                 if (s := budget_shortfall(w, budgets.get(w.worker_id), job_id=job_id, training=job.training))}
        for worker_id, shortfall in sorted(short.items()):
            if (job_id, worker_id) not in self.excluded:
                self.excluded.add((job_id, worker_id))
                log.warning("job %s: worker %s excluded: %s", job_id, worker_id, shortfall)
                self.store.note_event(job_id, "excluded", f"out of ε budget, not selected: {shortfall}",
                                      worker_id=worker_id)
        if short and len(registered) - len(short) < needed:
            sites = "; ".join(f"{w}: {s}" for w, s in sorted(short.items()))
            raise JobFailed(f"{what} cannot start: {len(registered) - len(short)} site(s) of category "
                            f"{job.category!r} can ever afford it, {needed} needed; out of ε budget: {sites}; "
                            f"no worker trained (no ε spent)")

    def recorded_epsilon(self) -> dict[str, float]:
        """The ε recorded for each worker: a task carries its worker's, and a worker whose ledger holds less
        refuses to train."""
        return {w.worker_id: w.epsilon_spent for w in self.store.workers()}

    def histograms(self, job_id: str, workers: Collection[str] | None = None) -> dict[str, list[int]]:
        """The label histograms the job's sites shared with it before round 1 (of `workers`, or every site's);
        registrations carry none."""
        return {s.worker_id: list(s.histogram) for s in self.store.shares(job_id)
                if s.status == ShareStatus.SHARED and s.histogram and (workers is None or s.worker_id in workers)}

    def population(self, job_id: str) -> list[float]:
        """P over every site that shared its label histogram with the job (DWFed); [] when none did."""
        histograms = list(self.histograms(job_id).values())
        if not histograms:
            return []
        width = max(len(h) for h in histograms)
        total = np.zeros(width)
        for h in histograms:
            total[: len(h)] += h
        return [float(p) for p in total / total.sum()] if total.sum() > 0 else []

    def publish_tasks(self, tasks: list[tuple[str, bytes]], deadline: float, *, evaluation: bool = False,
                      training: TrainingConfig | None = None, job_id: str = "") -> set[str]:
        """Persistent tasks with one wait for the broker (`Bus.publish_tasks`); through a broker outage the
        whole batch is retried until `deadline` (a worker that gets a task twice acks the copy once its update
        is in). A task that cannot be sent by then, or that is unroutable (no queue for the worker: no retry
        makes one), makes its worker a straggler at once; the round's quorum rules decide. Returns the worker
        ids whose task went out. `evaluation`: federated evaluation tasks (coordinator/federated.py), counted
        apart from round tasks; `training` and `job_id`: the job's, for round tasks (what each can cost its worker in
        ε)."""
        if not tasks:
            return set()
        if self.epsilon_bounds is not None and training is not None:  # first: a worker's report of what a task
            self.epsilon_bounds.note_tasks(job_id, [w for w, _ in tasks], deadline, training)  # cost is never ahead of it
        unroutable: list[str] = []

        def publish() -> None:
            try:
                unroutable[:] = self.bus.publish_tasks(tasks)
            except BusError as exc:
                if self.stop.is_set():
                    raise Stopped from exc
                raise

        def log_retry(exc: Exception, retry: int, delay: float) -> None:
            log.warning("%d task(s) not published (%s); retrying in %.1fs", len(tasks), exc, delay)

        left = deadline - time.time()
        if left <= 0:
            log.error("%d task(s) not published before the deadline", len(tasks))
            return set()
        try:
            retry_call(publish, backoff=OUTAGE_BACKOFF, retryable=lambda exc: isinstance(exc, BusError),
                       deadline=time.monotonic() + left, on_retry=log_retry, sleep=self.stop.wait)
        except BusError as exc:
            log.error("%d task(s) not published (%s): their workers are stragglers", len(tasks), exc)
            return set()
        for worker_id in unroutable:
            log.error("task for %s is unroutable (no queue for it): it is a straggler", worker_id)
        sent = {worker_id for worker_id, _ in tasks} - set(unroutable)
        (metrics.EVALUATION_TASKS_PUBLISHED if evaluation else metrics.TASKS_PUBLISHED).inc(len(sent))
        return sent
