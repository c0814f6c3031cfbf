"""The round loop: select → open at the aggregator → publish tasks → wait for quorum or deadline → close.

One thread per running job, at most `max_running_jobs` of them; later jobs wait `pending`, in submission
order. The coordinator never touches weights beyond checkpointing and evaluating
the global model the aggregation service returns.

Faults (deploy/RELIABILITY.md): a round is recorded in the store before it is opened anywhere, so a
restarted coordinator resumes the open round with the same participants and deadline instead of
starting it over; every call to the aggregation service is idempotent and retried through its outages;
publishing retries through a broker outage until the round's deadline. A job whose round_timeout_s
would let a worker hold its task past the broker's consumer_timeout is refused at submission.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from fedbroker import envelope
from fedbroker.aggregation_client import AggregatorClient
from fedbroker.bus import Bus, Delivery
from fedbroker.coordinator import metrics
from fedbroker.coordinator.asynchronous import AsyncJob
from fedbroker.coordinator.checkpoints import load_checkpoint, save_checkpoint
from fedbroker.coordinator.control import MAX_REASON_CHARS, InvalidControlMessage, check_control
from fedbroker.coordinator.events import JobWatcher
from fedbroker.coordinator.participants import (
    WorkerBudget,
    budget_from_heartbeat,
    data_fit_problems,
    sample_participants,
    why_unaffordable,
)
from fedbroker.coordinator.state import StateStore, StateUnavailable
from fedbroker.errors import (
    BusError,
    ConfigError,
    ConfigErrors,
    Conflict,
    FedbrokerError,
    NotFound,
    Rejection,
)
from fedbroker.metrics import BUSES
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.retry import Backoff, retry_call
from fedbroker.rpc import RemoteError
from fedbroker.spec import JobSpec, job_from_json
from fedbroker.submission import job_problems, schedule_problem

log = logging.getLogger(__name__)

Evaluator = Callable[[JobSpec, str, dict[str, np.ndarray]], "tuple[float, float] | None"]
T = TypeVar("T")

# What a worker needs after its round's deadline to finish an upload it started before it (and to ack).
CONSUMER_TIMEOUT_MARGIN_S = 60.0
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# A job in one of these has ended: nothing more happens to it (a cancel is refused).
FINISHED = frozenset({"completed", "failed", "cancelled"})
# Between tries through an aggregation-service or broker outage.
_OUTAGE_BACKOFF = Backoff(initial_s=0.5, max_s=10.0)


class JobFailed(FedbrokerError):
    reason = "job_failed"


class Coordinator:
    def __init__(self, *, bus: Bus, store: StateStore, aggregator: AggregatorClient, aggregator_target: str,
                 checkpoint_dir: str, heartbeat_timeout_s: float = 60.0, poll_interval_s: float = 0.2,
                 evaluator: Evaluator | None = None, broker_consumer_timeout_s: float | None = None,
                 aggregator_outage_s: float = 300.0, store_outage_s: float = 300.0,
                 max_running_jobs: int = 16, safety_poll_s: float = 2.0) -> None:
        """`broker_consumer_timeout_s`: RabbitMQ's consumer_timeout on this deployment (None: no limit, e.g.
        the in-process bus). `aggregator_outage_s`: how long a job waits for an unreachable aggregation
        service before it fails; `store_outage_s` likewise for a state store that cannot be written (a lock
        held elsewhere, a full disk). `max_running_jobs`: jobs driven at once, one thread each; later jobs
        wait `pending`, first submitted first started. `safety_poll_s`: a round (or an async job) waits on the
        aggregation service's events (coordinator/events.py) and looks at its status at least this often,
        in case an event was lost; `poll_interval_s`: how often waits for workers look at the registry."""
        if isinstance(max_running_jobs, bool) or not isinstance(max_running_jobs, int) or max_running_jobs < 1:
            raise ConfigError("coordinator.max_running_jobs", f"must be an integer >= 1, got {max_running_jobs!r}")
        self.bus = bus
        self.store = store
        self.aggregator = aggregator.without_retries()  # `_call` owns the retrying, so retries never nest
        self.aggregator_target = aggregator_target
        self.checkpoint_dir = checkpoint_dir
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.poll_interval_s = poll_interval_s
        self.evaluator = evaluator
        self.broker_consumer_timeout_s = broker_consumer_timeout_s
        self.aggregator_outage_s = aggregator_outage_s
        self.store_outage_s = store_outage_s
        self.max_running_jobs = max_running_jobs
        if isinstance(safety_poll_s, bool) or not isinstance(safety_poll_s, (int, float)) or not 0 < safety_poll_s <= 3600:
            raise ConfigError("coordinator.safety_poll_s", f"must be a number of seconds in (0, 3600], got {safety_poll_s!r}")
        self.safety_poll_s = float(safety_poll_s)
        self.events = JobWatcher(self.aggregator)
        self._stop = threading.Event()
        self._budgets: dict[str, WorkerBudget] = {}   # by worker: what its last heartbeat said it can afford
        self._budgets_lock = threading.Lock()
        self._jobs_lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}  # the running jobs' threads
        self._queue: collections.deque[tuple[str, JobSpec | None]] = collections.deque()  # jobs waiting for one
        self._done: dict[str, threading.Event] = {}  # set when a job launched here ends (or stop() drops it)
        self._cancels: dict[str, str] = {}  # running jobs to cancel → who asked (their threads act on it)
        self._local = threading.local()     # a job's thread knows its job (`_halt_if_cancelled`)
        self._async_jobs: dict[str, AsyncJob] = {}  # running asynchronous jobs: their task outcomes go to them

    # ----- lifecycle -----

    def start(self) -> None:
        """Consume control messages and resume every job that was running when we last stopped."""
        metrics.REGISTRY_COLLECTOR.bind(self)
        BUSES.watch(self.bus, client="coordinator")
        self.events.start()
        self.bus.consume_control(self.on_control)
        for row in self.store.jobs(status="cancelling"):  # asked to cancel before we stopped: finish that
            self._cancels[row["job_id"]] = row["submitter"]
            self._launch(row["job_id"])
        for row in self.store.jobs(status="running") + self.store.jobs(status="pending"):
            log.info("resuming job %s after round %d", row["job_id"], row["rounds_done"])
            self._launch(row["job_id"])

    def stop(self) -> None:
        self._stop.set()
        with self._jobs_lock:  # queued jobs stay pending in the store: the next start runs them
            for job_id, _ in self._queue:
                self._done[job_id].set()
            self._queue.clear()
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout=10)
        self.events.stop()
        metrics.REGISTRY_COLLECTOR.unbind(self)
        BUSES.unwatch("coordinator")

    def wait(self, job_id: str, timeout: float | None = None) -> str:
        done = self._done.get(job_id)
        if done is not None:
            done.wait(timeout)
        row = self.store.job(job_id)
        return row["status"] if row else "unknown"

    # ----- intake -----

    @property
    def max_round_timeout_s(self) -> float | None:
        """The longest schedule.round_timeout_s this deployment accepts (None: any)."""
        timeout = self.broker_consumer_timeout_s
        if timeout is None:
            return None
        return timeout - min(CONSUMER_TIMEOUT_MARGIN_S, 0.2 * timeout)

    def check_job(self, job: JobSpec) -> None:
        """A worker holds its task's delivery (unacked) until it has uploaded, and gives up at the round's
        deadline: the broker must not reclaim the delivery before, or it closes the worker's channel.
        The algorithm registries check the job's aggregation too, so an in-process caller that parsed the
        job without them (`parse_job`) cannot start rounds that the aggregation service would refuse."""
        schedule_problem(job.schedule)  # an async job's staleness settings
        problems = job_problems(aggregation=job.aggregation, model=job.model)
        # The data its category's active workers reported: a model that cannot take it is refused here, before
        # any round, instead of failing inside every worker's training.
        problems += data_fit_problems(job.model, self.store.workers(job.category, seen_within_s=self.heartbeat_timeout_s),
                                      category=job.category)
        if len(problems) == 1:
            raise problems[0]
        if problems:
            raise ConfigErrors(problems)
        limit, timeout = self.max_round_timeout_s, self.broker_consumer_timeout_s
        if limit is not None and timeout is not None and job.schedule.round_timeout_s > limit:
            raise ConfigError(
                "schedule.round_timeout_s",
                f"must be at most {limit:g} s here, got {job.schedule.round_timeout_s:g}: a worker holds its task "
                f"until the round's deadline, and the broker's consumer_timeout is {timeout:g} s (less "
                f"{timeout - limit:g} s to finish an upload); raise the broker's consumer_timeout and "
                f"broker.consumer_timeout_s together for longer rounds",
            )

    def submit(self, job: JobSpec, *, submitter: str = "") -> str:
        """`submitter`: the identity whose token submitted it (the only one that may cancel or download it)."""
        self.check_job(job)
        job_id = f"{job.name[:40]}-{secrets.token_hex(4)}"
        self.store.add_job(job_id, job.name, job.to_json(), job.training.rounds, job.model.to_json(),
                           submitter=submitter)
        self._launch(job_id, job)
        return job_id

    def cancel(self, job_id: str, *, by: str = "", wait_s: float = 30.0) -> str:
        """Cancel a job; its status after up to `wait_s` (`cancelled`, or `cancelling` while its thread is
        still on its way to the next point where it waits). A queued job is dropped at once; a running one
        stops at that point: its open round is abandoned at the aggregation service, never closed, so no
        half-gathered round becomes a version (`_cancel_job`). A close already under way finishes first."""
        row = self.store.job(job_id)
        if row is None:
            raise NotFound(f"no job {job_id!r}")
        if row["status"] in FINISHED:
            raise Conflict(f"job {job_id!r} is already {row['status']}: there is nothing to cancel")
        with self._jobs_lock:
            queued = [entry for entry in self._queue if entry[0] == job_id]
            running = job_id in self._threads
            for entry in queued:
                self._queue.remove(entry)
                self._done[job_id].set()
            if running:
                self._cancels[job_id] = by
                self.events.poke(job_id)  # a loop waiting on the service's events acts now, not at its safety poll
        if not running:  # never started here (queued, or left pending by a stopped run): no round to abandon
            self.store.cancel_job(job_id, by=by)
            return "cancelled"
        self.store.request_cancel(job_id, by=by)  # durable: a restart before the thread acts finishes it
        self._done[job_id].wait(wait_s)
        after = self.store.job(job_id)
        return str(after["status"]) if after is not None else "cancelled"

    def on_control(self, delivery: Delivery) -> None:
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
            r = env.registration
            # Its task queue exists before any task is published to it: a worker that registered but never
            # consumes holds its task there and is a straggler, instead of an unroutable publish.
            self.bus.declare_worker(r.worker_id)
            self._note_epsilon(r.worker_id, r.epsilon_spent, "registration")
            self.store.upsert_worker(
                worker_id=r.worker_id, categories=r.categories, histogram=r.label_histogram,
                dp_enabled=r.dp_enabled, dp={
                    "noise_multiplier": r.dp_policy.noise_multiplier, "max_grad_norm": r.dp_policy.max_grad_norm,
                    "delta": r.dp_policy.delta, "epsilon_budget": r.dp_policy.epsilon_budget,
                },
                epsilon_spent=r.epsilon_spent, device=r.device, num_samples=r.num_samples,
                input_shape=r.input_shape, num_classes=r.num_classes,
            )
            log.info("worker %s registered (%s, %d samples, categories %s)", r.worker_id, r.device, r.num_samples,
                     list(r.categories))
        elif kind == "heartbeat":
            h = env.heartbeat
            self._note_epsilon(h.worker_id, h.epsilon_spent, "heartbeat")
            if not self.store.touch_worker(h.worker_id, epsilon_spent=h.epsilon_spent, state=h.state):
                log.warning("heartbeat from unknown worker %r ignored", h.worker_id)
            else:
                with self._budgets_lock:
                    self._budgets[h.worker_id] = budget_from_heartbeat(h)
        else:
            o = env.task_outcome
            status = pb.TaskOutcome.Status.Name(o.status).lower()
            metrics.TASK_OUTCOMES.labels(status).inc()
            driver = self._async_jobs.get(o.job_id)
            if driver is not None:  # an asynchronous job's task: round is the task number
                driver.outcome(o.worker_id, o.round, status, o.reason[:MAX_REASON_CHARS])
            elif not self.store.record_outcome(o.job_id, o.round, o.worker_id, status, o.reason[:MAX_REASON_CHARS],
                                               epsilon=o.epsilon if math.isfinite(o.epsilon) else 0.0):
                log.warning("outcome from %r for unknown task (%s, round %d) ignored", o.worker_id, o.job_id, o.round)
            else:
                log.info("worker %s %s round %d of %s: %s", o.worker_id, status, o.round, o.job_id, o.reason)
            self.events.poke(o.job_id)  # the round (or async job) waiting on it looks again now
        delivery.ack()

    def _note_epsilon(self, worker_id: str, reported: float, message: str) -> None:
        """ε never falls silently: the store keeps the highest ε a worker reported (its tasks carry it, and a
        worker whose ledger total is below refuses to train); a lower report is logged and counted here."""
        recorded = self.store.recorded_epsilon(worker_id)
        if recorded is not None and reported < recorded - 1e-9 * max(1.0, recorded):
            metrics.EPSILON_DECREASES.labels(message).inc()
            log.error("worker %s reported ε %.6g in a %s, below the %.6g recorded for it: its privacy ledger was "
                      "lost or replaced; keeping %.6g, and its tasks will be refused until its ledger is restored",
                      worker_id, reported, message, recorded, recorded)

    # ----- the round loop -----

    def _launch(self, job_id: str, job: JobSpec | None = None) -> None:
        """`job`: the spec SubmitJob parsed; None for a job resumed from the store (parsed there, once).
        Queued; it starts at once while fewer than `max_running_jobs` jobs run."""
        with self._jobs_lock:
            if job_id in self._done and not self._done[job_id].is_set():
                return  # already queued or running
            self._done[job_id] = threading.Event()
            self._queue.append((job_id, job))
            self._dispatch()

    def _dispatch(self) -> None:
        """Start queued jobs, oldest first, into free slots (the caller holds `_jobs_lock`)."""
        while self._queue and len(self._threads) < self.max_running_jobs and not self._stop.is_set():
            job_id, job = self._queue.popleft()
            thread = threading.Thread(target=self._run_job, args=(job_id, job), name=f"job-{job_id}", daemon=True)
            self._threads[job_id] = thread
            thread.start()

    def _run_job(self, job_id: str, job: JobSpec | None) -> None:
        self._local.job_id = job_id
        try:
            metrics.job_started(job_id)  # its counters exist at 0 before the first round can count
            try:
                # A store that cannot be written for a while (a lock held elsewhere, a full disk) is ridden
                # out like an aggregation-service outage; past store_outage_s the job fails, visibly.
                with self.store.retrying_writes(for_s=self.store_outage_s, sleep=self._stop.wait,
                                                stopping=self._stop.is_set):
                    self._drive(job_id, job)
            except _Cancelled:
                try:
                    self._cancel_job(job_id)
                except StateUnavailable as exc:  # still `running` in the store: a restart resumes it
                    log.error("job %s: its cancellation could not be recorded (%s); cancel it again", job_id, exc)
            except _Stopped:  # the job stays running in the store; the next start resumes it
                log.info("job %s paused: the coordinator is stopping", job_id)
            except StateUnavailable as exc:
                if self._stop.is_set():
                    log.info("job %s paused: the coordinator is stopping (%s)", job_id, exc)
                else:
                    log.error("job %s failed: %s", job_id, exc)
                    self._record_failure(job_id, str(exc))
            except JobFailed as exc:  # the job's own rules ended it (budgets, too few uploads): no traceback
                log.error("job %s failed: %s", job_id, exc)
                self._record_failure(job_id, str(exc))
            except Exception as exc:  # a job's failure must be recorded, never lost in a thread
                log.exception("job %s failed", job_id)
                self._record_failure(job_id, str(exc))
        finally:
            with self._jobs_lock:
                self._threads.pop(job_id, None)
                self._cancels.pop(job_id, None)
                self._done[job_id].set()
                self._dispatch()

    def _record_failure(self, job_id: str, error: str) -> None:
        """Record the job as failed, retrying through a store outage for as long as it lasts: a job whose
        thread ended must not stay `running` in the store. Only a stopping coordinator gives up (the job is
        then still `running` in the store, and the next start resumes it)."""

        def log_retry(exc: Exception, retry: int, delay: float) -> None:
            log.error("job %s failed, and that could not be recorded yet (%s); retrying in %.1fs", job_id, exc, delay)

        try:
            retry_call(lambda: self.store.set_job_status(job_id, "failed", error), backoff=_OUTAGE_BACKOFF,
                       deadline=math.inf, on_retry=log_retry, sleep=self._stop.wait,
                       retryable=lambda exc: isinstance(exc, StateUnavailable) and not self._stop.is_set())
        except StateUnavailable as exc:
            log.error("job %s failed (%s) but the coordinator stopped before that could be recorded (%s); the next "
                      "start resumes it", job_id, error, exc)

    def _cancel_async_job(self, job_id: str, by: str) -> None:
        """An asynchronous job has no round to abandon: its buffer is closed at the service, so outstanding
        tasks end, late uploads are refused and the updates still in the buffer never become a version."""
        try:
            retry_call(lambda: self.aggregator.close_buffer(job_id), backoff=_OUTAGE_BACKOFF,
                       deadline=time.monotonic() + self.aggregator_outage_s, sleep=self._stop.wait,
                       retryable=lambda exc: isinstance(exc, RemoteError) and exc.code in _TRANSIENT
                       and not self._stop.is_set())
        except RemoteError as exc:
            if self._stop.is_set():  # still `cancelling` in the store: the next start finishes it
                log.info("job %s: cancel left to the next start (the coordinator is stopping)", job_id)
                return
            if exc.reason != Rejection.UNKNOWN_JOB:
                log.error("the buffer of cancelled job %s could not be closed at the aggregation service (%s): "
                          "no version is recorded for it from now on", job_id, exc)
        self.store.cancel_job(job_id, by=by)
        metrics.ROUND_OPEN.labels(job_id).set(0)

    def _halt_if_cancelled(self) -> None:
        """In a job's thread, wherever the round loop waits: end the job there if it was cancelled."""
        job_id = getattr(self._local, "job_id", None)
        if job_id is not None and job_id in self._cancels:
            raise _Cancelled

    def _cancel_job(self, job_id: str) -> None:
        """Abandon the job's open round at the aggregation service (its uploads are dropped, never
        aggregated: no version comes of it; a worker still training gets `round_closed` for its upload,
        and a worker yet to start finds the round closed and trains nothing) and record the job cancelled,
        with the ε the discarded uploads cost their workers."""
        by = self._cancels.get(job_id, "")
        row = self.store.job(job_id)
        if row is not None and json.loads(row["spec_json"]).get("schedule", {}).get("mode") == "async":
            self._cancel_async_job(job_id, by)
            return
        open_rounds = [r["round"] for r in self.store.rounds(job_id) if r["status"] == "open"]
        round_number = open_rounds[-1] if open_rounds else None
        discarded: list[pb.UpdateSummary] = []
        if round_number is not None:
            try:
                discarded = retry_call(
                    lambda: self.aggregator.abandon_round(job_id, round_number), backoff=_OUTAGE_BACKOFF,
                    deadline=time.monotonic() + self.aggregator_outage_s, sleep=self._stop.wait,
                    retryable=lambda exc: isinstance(exc, RemoteError) and exc.code in _TRANSIENT
                    and not self._stop.is_set())
            except RemoteError as exc:  # a service that lost the job holds no round to abandon
                if self._stop.is_set():  # still `cancelling` in the store: the next start finishes it
                    log.info("job %s: cancel left to the next start (the coordinator is stopping)", job_id)
                    return
                if exc.reason != Rejection.UNKNOWN_JOB:
                    log.error("round %d of cancelled job %s could not be abandoned at the aggregation service "
                              "(%s): it is never closed, so no version comes of it", round_number, job_id, exc)
        self.store.cancel_job(job_id, by=by, round_number=round_number,
                              discarded=[(u.worker_id, u.num_samples, u.epsilon, u.train_loss) for u in discarded])
        metrics.ROUND_OPEN.labels(job_id).set(0)
        log.info("job %s cancelled%s%s", job_id, f" by {by}" if by else "",
                 f"; round {round_number} abandoned ({len(discarded)} upload(s) discarded)"
                 if round_number is not None else "")

    def _drive(self, job_id: str, job: JobSpec | None) -> None:
        row = self.store.job(job_id)
        if row is None:
            raise JobFailed(f"job {job_id!r} is not in the coordinator's store")
        if job is None:  # resumed: the store holds the job's one wire form
            job = job_from_json(row["spec_json"])
        self._await_workers(job)
        self.store.set_job_status(job_id, "running")
        done = row["rounds_done"]
        last = self.store.last_checkpoint(job_id)
        if done and last is not None:
            tensors, spec_json = load_checkpoint(last["checkpoint"])
            version = last["model_version"]
        else:
            from fedbroker.model import initial_weights

            spec_json = job.model.to_json()
            tensors = initial_weights(job.model, seed=job.seed)
            version = 1
        run = _Run(job_id, job, version, spec_json, tensors)
        if job.schedule.mode == "async":  # no rounds: coordinator/asynchronous.py
            self._drive_async(run)
            self.store.set_job_status(job_id, "completed")
            return
        # Idempotent at the service: after our own restart it keeps the open round and its uploads.
        self._call(run, "install the global model", lambda: self.aggregator.put_global(job_id, version, spec_json,
                                                                                        tensors))
        for round_number in range(done + 1, job.training.rounds + 1):
            if self._stop.is_set():
                raise _Stopped
            self._halt_if_cancelled()
            try:
                self._round(run, round_number)
            except _Stopped:
                raise
            except Exception:
                metrics.ROUNDS_FAILED.labels(job_id).inc()
                metrics.ROUND_OPEN.labels(job_id).set(0)
                raise
        self.store.set_job_status(job_id, "completed")

    def _drive_async(self, run: _Run) -> None:
        driver = AsyncJob(self, run, stopped=_Stopped, failed=JobFailed)
        with self._jobs_lock:
            self._async_jobs[run.job_id] = driver
        try:
            driver.drive()
        finally:
            with self._jobs_lock:
                self._async_jobs.pop(run.job_id, None)

    def _poll(self, check: Callable[[], tuple[bool, T]], *, within_s: float) -> tuple[bool, T]:
        """`check()` every poll interval until it says done or `within_s` passes; its last answer either way.
        A stopping coordinator ends the wait at once (_Stopped)."""
        deadline = time.monotonic() + within_s
        while True:
            done, value = check()
            if done or time.monotonic() >= deadline:
                return done, value
            if self._stop.wait(self.poll_interval_s):
                raise _Stopped
            self._halt_if_cancelled()

    def _await_workers(self, job: JobSpec) -> None:
        def enough() -> tuple[bool, int]:
            active = self.store.workers(job.category, seen_within_s=self.heartbeat_timeout_s)
            return len(active) >= job.schedule.min_workers, len(active)

        done, active = self._poll(enough, within_s=job.schedule.wait_for_workers_s)
        if not done:
            raise JobFailed(
                f"only {active} active worker(s) of category {job.category!r} registered within "
                f"{job.schedule.wait_for_workers_s:g}s; schedule.min_workers is {job.schedule.min_workers}"
            )

    def _select(self, job_id: str, job: JobSpec, round_number: int) -> list[str]:
        """The round's participants, drawn among the active workers that can afford it (by their heartbeats'
        budgets and costs: participants.why_unaffordable). Fewer than min_clients of them: no round is opened,
        so no worker spends ε on a round that would fail; the job waits up to wait_for_workers_s (a worker
        may register, or an owner raise its budget), then fails naming each worker's reason."""
        def affordability() -> tuple[bool, dict[str, str]]:
            """Each active worker's reason it cannot afford the round ("" when it can)."""
            active = self.store.workers(job.category, seen_within_s=self.heartbeat_timeout_s)
            with self._budgets_lock:
                budgets = dict(self._budgets)
            why = {w.worker_id: why_unaffordable(w, budgets.get(w.worker_id), job_id=job_id, training=job.training)
                   for w in active}
            return sum(not reason for reason in why.values()) >= job.schedule.min_clients, why

        done, why = self._poll(affordability, within_s=job.schedule.wait_for_workers_s)
        able = [w for w, reason in why.items() if not reason]
        if not done:
            reasons = "; ".join(f"{w}: {reason}" for w, reason in why.items() if reason)
            raise JobFailed(
                f"round {round_number} not opened: {len(able)} of {len(why)} active worker(s) of category "
                f"{job.category!r} can afford it, schedule.min_clients is {job.schedule.min_clients}"
                f"{' [' + reasons + ']' if reasons else ''}; no worker trained (no ε spent)")
        return sample_participants(able, job.schedule.clients_per_round, seed=job.seed, round_number=round_number)

    def _population(self, job: JobSpec) -> list[float]:
        """P over every registered worker of the category (DWFed), from their label histograms."""
        histograms = [w.histogram for w in self.store.workers(job.category) if w.histogram]
        if not histograms:
            return []
        width = max(len(h) for h in histograms)
        total = np.zeros(width)
        for h in histograms:
            total[: len(h)] += h
        return (total / total.sum()).tolist() if total.sum() > 0 else []

    def _round(self, run: _Run, round_number: int) -> None:
        job_id, job = run.job_id, run.job
        row = self.store.round(job_id, round_number)
        if row is not None and row["status"] == "open":
            rnd, reply = self._resume_round(run, round_number, row)
        else:
            rnd, reply = self._new_round(run, round_number), None
        metrics.ROUNDS_STARTED.labels(job_id).inc()
        metrics.ROUND.labels(job_id).set(round_number)
        metrics.ROUND_OPEN.labels(job_id).set(1)
        metrics.ROUND_DEADLINE.labels(job_id).set(rnd.deadline)
        metrics.ROUND_PARTICIPANTS.labels(job_id).set(len(rnd.participants))
        if reply is None:
            self._publish_tasks(run, rnd)
            accepted = self._wait_for_quorum(run, rnd)
            if self._stop.is_set():
                raise _Stopped  # the round stays open in the store: a restarted coordinator resumes it
            self._halt_if_cancelled()
            answered = self._answered(job_id, round_number)
            stragglers = len(set(rnd.participants) - set(accepted) - answered)
            if stragglers:
                metrics.STRAGGLERS.labels(job_id).inc(stragglers)
            if len(accepted) < job.schedule.min_clients:
                self.store.fail_round(job_id, round_number, time.time() - rnd.started)
                reasons = "; ".join(
                    f"{p['worker_id']}: {p['status']}{' (' + p['reason'] + ')' if p['reason'] else ''}"
                    for p in self.store.participants(job_id, round_number)
                )
                raise JobFailed(f"round {round_number}: {len(accepted)} upload(s), schedule.min_clients is "
                                f"{job.schedule.min_clients} [{reasons}]")
            # Idempotent at the service: a retry after a lost reply gets the same result back.
            reply = self._call(run, f"close round {round_number}",
                               lambda: self.aggregator.close_round(job_id, round_number))
        self._finish_round(run, rnd, reply)

    def _new_round(self, run: _Run, round_number: int) -> _OpenRound:
        job_id, job = run.job_id, run.job
        participants = self._select(job_id, job, round_number)  # may wait for workers that can afford it
        started = time.time()
        histograms = {w.worker_id: w.histogram for w in self.store.workers(job.category) if w.worker_id in participants}
        rnd = _OpenRound(round_number, participants, started, started + job.schedule.round_timeout_s,
                         asdict(job.aggregation), histograms)
        # Recorded before the service hears of it: a coordinator that dies from here on resumes this round.
        self.store.open_round(job_id, round_number, participants, deadline=rnd.deadline, started=started)
        run.round = rnd
        self._open_at_aggregator(run, rnd)
        return rnd

    def _resume_round(self, run: _Run, round_number: int, row: Any) -> tuple[_OpenRound, pb.CloseRoundReply | None]:
        """The round that was open when this coordinator stopped: same participants, same deadline."""
        job_id, job = run.job_id, run.job
        participants = [p["worker_id"] for p in self.store.participants(job_id, round_number)]
        started = float(row["started"])
        deadline = float(row["deadline"]) if row["deadline"] is not None else started + job.schedule.round_timeout_s
        histograms = {w.worker_id: w.histogram for w in self.store.workers(job.category) if w.worker_id in participants}
        rnd = _OpenRound(round_number, participants, started, deadline, asdict(job.aggregation), histograms,
                         resumed=True)
        log.info("resuming round %d of %s (%d participant(s), deadline in %.0fs)", round_number, job_id,
                 len(participants), deadline - time.time())
        try:
            accepted, is_open = self._call(run, f"status of round {round_number}",
                                           lambda: self.aggregator.status(job_id, round_number))
        except RemoteError as exc:
            if exc.reason != Rejection.UNKNOWN_ROUND:
                raise
            accepted, is_open = [], True  # we died before opening it there: opened below
        if not is_open:
            # Either the service closed it before we died (the close is idempotent: we get its result back),
            # or it never heard of it (we died before opening it there): then it is opened below.
            try:
                reply = self._call(run, f"close round {round_number}",
                                   lambda: self.aggregator.close_round(job_id, round_number), reinstall=False)
                log.info("round %d of %s had been closed by the aggregation service; recording it", round_number,
                         job_id)
                run.round = rnd
                return rnd, reply
            except RemoteError as exc:
                if exc.code != grpc.StatusCode.NOT_FOUND:
                    raise
        if time.time() >= deadline and len(accepted) < job.schedule.min_clients:
            rnd.deadline = time.time() + job.schedule.round_timeout_s  # it expired while we were away
            self.store.set_round_deadline(job_id, round_number, rnd.deadline)
            log.info("round %d of %s expired while the coordinator was down; deadline moved %.0fs ahead",
                     round_number, job_id, job.schedule.round_timeout_s)
        run.round = rnd
        self._open_at_aggregator(run, rnd)
        return rnd, None

    def _open_at_aggregator(self, run: _Run, rnd: _OpenRound, *, reinstall: bool = True) -> None:
        job_id = run.job_id
        # what each participant registered bounds the sample count its upload may claim (its FedAvg weight)
        members = set(rnd.participants)
        registered = {w.worker_id: w.num_samples for w in self.store.workers() if w.worker_id in members}
        rnd.model_version = self._call(run, f"open round {rnd.number}", lambda: self.aggregator.open_round(
            job_id, rnd.number, rnd.participants, rnd.deadline, rnd.aggregation, seed=run.job.seed,
            histograms=rnd.histograms, num_samples=registered), reinstall=reinstall)

    def _answered(self, job_id: str, round_number: int) -> set[str]:
        return {p["worker_id"] for p in self.store.participants(job_id, round_number)
                if p["status"] in ("refused", "failed")}

    def _publish_tasks(self, run: _Run, rnd: _OpenRound, *, only_missing: bool | None = None) -> None:
        """One task per participant; a resumed round re-sends the tasks of participants with no upload yet
        (we may have died halfway through publishing; a worker that already has the task handles the copy
        idempotently: it acks it without training once its update is accepted)."""
        job_id, job = run.job_id, run.job
        if time.time() >= rnd.deadline:  # a resumed round past its deadline: closes with what it has
            rnd.published = True
            return
        task = pb.RoundTask(
            job_id=job_id, round=rnd.number,
            training_json=json.dumps(asdict(job.training)), category=job.category, model_version=rnd.model_version,
            aggregator_target=self.aggregator_target, deadline_unix=rnd.deadline,
            population_distribution=self._population(job), participants=len(rnd.participants),
            seed=job.seed, aggregation_json=json.dumps(rnd.aggregation),
        )
        recipients = list(rnd.participants)
        if rnd.resumed if only_missing is None else only_missing:
            accepted, _ = self._call(run, f"status of round {rnd.number}",
                                     lambda: self.aggregator.status(job_id, rnd.number))
            done = set(accepted) | self._answered(job_id, rnd.number)
            recipients = [w for w in recipients if w not in done]
        # Each worker's task carries the ε recorded for it: a worker whose ledger holds less refuses to train.
        recorded = {w.worker_id: w.epsilon_spent for w in self.store.workers()}

        def body_for(worker_id: str) -> bytes:
            task.recorded_epsilon_spent = recorded.get(worker_id, 0.0)
            return envelope.encode(round_task=task)

        sent = self._publish_batch([(worker_id, body_for(worker_id)) for worker_id in recipients], rnd.deadline)
        rnd.published = True
        log.info("round %d of %s published to %d worker(s)", rnd.number, job_id, len(sent))

    def _publish_batch(self, tasks: list[tuple[str, bytes]], deadline: float) -> set[str]:
        """Persistent tasks with one wait for the broker (`Bus.publish_tasks`); through a broker outage the
        whole batch is retried until `deadline` (a worker that gets a task twice acks the copy once its update
        is in). A task that cannot be sent by then, or that is unroutable (no queue for the worker: no retry
        makes one), makes its worker a straggler at once; the round's quorum rules decide. Returns the worker
        ids whose task went out."""
        if not tasks:
            return set()
        unroutable: list[str] = []

        def publish() -> None:
            try:
                unroutable[:] = self.bus.publish_tasks(tasks)
            except BusError as exc:
                if self._stop.is_set():
                    raise _Stopped from exc
                raise

        def log_retry(exc: Exception, retry: int, delay: float) -> None:
            log.warning("%d task(s) not published (%s); retrying in %.1fs", len(tasks), exc, delay)

        left = deadline - time.time()
        if left <= 0:
            log.error("%d task(s) not published before the deadline", len(tasks))
            return set()
        try:
            retry_call(publish, backoff=_OUTAGE_BACKOFF, retryable=lambda exc: isinstance(exc, BusError),
                       deadline=time.monotonic() + left, on_retry=log_retry, sleep=self._stop.wait)
        except BusError as exc:
            log.error("%d task(s) not published (%s): their workers are stragglers", len(tasks), exc)
            return set()
        for worker_id in unroutable:
            log.error("task for %s is unroutable (no queue for it): it is a straggler", worker_id)
        sent = {worker_id for worker_id, _ in tasks} - set(unroutable)
        metrics.TASKS_PUBLISHED.inc(len(sent))
        return sent

    def _finish_round(self, run: _Run, rnd: _OpenRound, reply: pb.CloseRoundReply) -> None:
        job_id, job, round_number = run.job_id, run.job, rnd.number
        new_version, new_spec_json, tensors = self._call(
            run, f"download global model {reply.model_version}",
            lambda: self.aggregator.download(job_id, reply.model_version), reinstall=False)
        checkpoint = save_checkpoint(self.checkpoint_dir, job_id, round_number, tensors, new_spec_json)
        scores = self.evaluator(job, new_spec_json, tensors) if self.evaluator else None
        accuracy, loss = scores if scores else (None, None)
        seconds = time.time() - rnd.started
        self.store.close_round(
            job_id, round_number, model_version=new_version, aggregated=list(reply.aggregated),
            updates=[(u.worker_id, u.num_samples, u.epsilon, u.train_loss) for u in reply.updates],
            accuracy=accuracy, loss=loss, seconds=seconds, checkpoint=checkpoint, stats=dict(reply.stats),
            model_spec_json=new_spec_json,
        )
        run.version, run.spec_json, run.tensors, run.round = new_version, new_spec_json, tensors, None
        metrics.ROUNDS_COMPLETED.labels(job_id).inc()
        metrics.ROUND_DURATION.observe(seconds)
        metrics.ROUND_OPEN.labels(job_id).set(0)
        metrics.ROUND_AGGREGATED.labels(job_id).set(len(reply.aggregated))
        if accuracy is not None and loss is not None:
            metrics.MODEL_ACCURACY.labels(job_id).set(accuracy)
            metrics.MODEL_LOSS.labels(job_id).set(loss)
        try:  # a notification: the store is the truth, so a broker outage must not fail the job here
            self.bus.publish_event(envelope.encode(round_completed=pb.RoundCompleted(
                job_id=job_id, round=round_number, model_version=new_version, aggregated=len(reply.aggregated),
                accuracy=accuracy or 0.0, loss=loss or 0.0, final=round_number == job.training.rounds,
                seconds=seconds,
            )))
        except BusError as exc:
            log.warning("RoundCompleted event of round %d of %s not published: %s", round_number, job_id, exc)
        log.info("round %d of %s closed: %d aggregated, accuracy %s, %.1fs", round_number, job_id,
                 len(reply.aggregated), f"{accuracy:.4f}" if accuracy is not None else "n/a", seconds)

    def _wait_for_quorum(self, run: _Run, rnd: _OpenRound) -> list[str]:
        job_id, round_number = run.job_id, rnd.number
        quorum = run.job.schedule.quorum or len(rnd.participants)
        accepted: list[str] = []
        while not self._stop.is_set():
            accepted, _ = self._call(run, f"status of round {round_number}",
                                     lambda: self.aggregator.status(job_id, round_number))
            self.store.set_uploaded(job_id, round_number, accepted)
            if len(accepted) >= quorum:
                break
            answered = self._answered(job_id, round_number)
            if len(set(accepted) | answered) >= len(rnd.participants) or time.time() >= rnd.deadline:
                break
            self._await_round_event(job_id, round_number, rnd.deadline,
                                    enough=quorum, everyone=len(rnd.participants) - len(answered))
            self._halt_if_cancelled()  # before the close: a cancelled job's round is abandoned, not closed
        return accepted

    def _await_round_event(self, job_id: str, round_number: int, deadline: float, *, enough: int,
                           everyone: int) -> None:
        """Until the service's events say the round has `enough` uploads (or `everyone` who can still
        upload has), a worker's refusal comes in, the deadline (a one-shot timer) or the safety poll."""
        until = min(deadline, time.time() + self.safety_poll_s)
        while not self._stop.is_set():
            left = until - time.time()
            if left <= 0 or not self.events.wait(job_id, left):
                return
            snapshot = self.events.latest(job_id)
            if snapshot is None or snapshot.round != round_number or not snapshot.open:
                return  # a poke (a refusal), or the round is no longer the one we wait on
            if snapshot.accepted >= min(enough, everyone):
                return

    # ----- the aggregation service's outages -----

    def _call(self, run: _Run, what: str, fn: Callable[[], T], *, reinstall: bool = True) -> T:
        """Call the aggregation service, riding out its outages (the only layer that retries: our client
        calls once).

        UNAVAILABLE (or a deadline) is retried with backoff for up to `aggregator_outage_s`. NOT_FOUND for
        the job means the service restarted without its spool and lost our job: we install the global model
        and the open round again, re-send the round's tasks (the uploads it had accepted are gone; their
        workers acked their tasks) and give the round a fresh deadline, then repeat the call.
        """
        give_up = time.monotonic() + self.aggregator_outage_s

        def attempt() -> T:
            try:
                return fn()
            except RemoteError as exc:
                if self._stop.is_set():
                    raise _Stopped from exc
                raise

        def log_retry(exc: Exception, retry: int, delay: float) -> None:
            log.warning("%s of %s: the aggregation service is unavailable (%s); retrying in %.1fs", what,
                        run.job_id, exc, delay)

        def call() -> T:
            return retry_call(attempt, backoff=_OUTAGE_BACKOFF, deadline=give_up, on_retry=log_retry,
                              retryable=lambda exc: isinstance(exc, RemoteError) and exc.code in _TRANSIENT,
                              sleep=self._stop.wait)

        try:
            return call()
        except RemoteError as exc:
            if not (reinstall and exc.reason == Rejection.UNKNOWN_JOB):
                raise
            self._reinstall(run, str(exc))
        return call()

    def _reinstall(self, run: _Run, why: str) -> None:
        job_id = run.job_id
        log.warning("the aggregation service lost job %s (%s): installing global model %d again%s", job_id, why,
                    run.version, f" and re-opening round {run.round.number}" if run.round else "")
        self._call(run, "reinstall the global model",
                   lambda: self.aggregator.put_global(job_id, run.version, run.spec_json, run.tensors),
                   reinstall=False)
        rnd = run.round
        if rnd is None:
            return
        rnd.deadline = max(rnd.deadline, time.time() + run.job.schedule.round_timeout_s)
        self.store.set_round_deadline(job_id, rnd.number, rnd.deadline)
        self.store.reset_uploads(job_id, rnd.number)
        self._open_at_aggregator(run, rnd, reinstall=False)
        if rnd.published:  # else the round's own publishing comes next
            self._publish_tasks(run, rnd, only_missing=True)


class _Stopped(Exception):
    """Internal: the coordinator is stopping; leave the job where it is, for the next start to resume."""


class _Cancelled(_Stopped):
    """Internal: the job was cancelled (`Coordinator.cancel`); its thread abandons it where it waits."""


@dataclass
class _OpenRound:
    number: int
    participants: list[str]
    started: float
    deadline: float
    aggregation: dict[str, Any]
    histograms: dict[str, list[int]]
    resumed: bool = False
    model_version: int = 0
    published: bool = False   # its tasks went out (a reinstall re-sends them)


@dataclass
class _Run:
    """A running job's place: the global model it is at, and its open round (what a reinstall needs)."""

    job_id: str
    job: JobSpec
    version: int
    spec_json: str
    tensors: dict[str, np.ndarray]
    round: _OpenRound | None = None
