"""The coordinator: job intake (submit, check, cancel) and the pool of job threads that drive them.

One thread per running job, at most `max_running_jobs` of them; later jobs wait `pending`, in submission
order. A job's thread waits for its workers, restores the global model it is at, and drives its rounds
(sync_rounds.py) or its asynchronous loop (asynchronous.py). The coordinator never touches weights beyond
checkpointing and evaluating the global model the aggregation service returns.

Faults (deploy/RELIABILITY.md): a restarted coordinator resumes every job that was running, pending or being
cancelled; calls to the aggregation service ride out its outages (service_calls.py); a job's thread rides a
state-store outage out for up to `store_outage_s`, then fails the job visibly. A job whose round_timeout_s
would let a worker hold its task past the broker's consumer_timeout is refused at submission.
"""

from __future__ import annotations

import collections
import logging
import math
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from fedbroker.bus import Bus
from fedbroker.coordinator import metrics
from fedbroker.coordinator.asynchronous import AsyncJob
from fedbroker.coordinator.cancellation import cancel_job
from fedbroker.coordinator.checkpoints import load_checkpoint
from fedbroker.coordinator.control import SenderBinding
from fedbroker.coordinator.control_handler import ControlHandler
from fedbroker.coordinator.events import JobWatcher
from fedbroker.coordinator.job_context import Evaluator, JobContext
from fedbroker.coordinator.job_run import Cancelled, CancelRequests, JobFailed, Run, Stopped
from fedbroker.coordinator.participants import EpsilonBounds, WorkerBudgets, data_fit_problems, submission_projection
from fedbroker.coordinator.service_calls import OUTAGE_BACKOFF, AggregatorCalls
from fedbroker.coordinator.sharing import agreed_model
from fedbroker.coordinator.sites import SiteWatch, note_revoked
from fedbroker.coordinator.start_weights import load_start, save_start
from fedbroker.coordinator.store import StateStore, StateUnavailable
from fedbroker.coordinator.sync_rounds import SyncRounds
from fedbroker.coordinator.waiting import WaitingReasons
from fedbroker.errors import ConfigError, ConfigErrors, Conflict, NotFound
from fedbroker.federated_evaluation import submission_warnings
from fedbroker.job.spec import JobSpec, ModelSpec, job_from_json
from fedbroker.job.status import FINISHED, JobStatus
from fedbroker.job.submission import job_problems
from fedbroker.metrics import BUSES
from fedbroker.retry import retry_call
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.weights.plan import ModelPlan

log = logging.getLogger(__name__)

# What a worker needs after its round's deadline to finish an upload it started before it (and to ack).
CONSUMER_TIMEOUT_MARGIN_S = 60.0


@dataclass(frozen=True)
class Submitted:
    """An accepted job's id, and what the coordinator doubts about it (told to the submitter, and logged)."""

    job_id: str
    warnings: list[str]
    projection: list[str] = field(default_factory=list)  # each site's ε after the job against its budget


class Coordinator:
    """Accepts jobs and runs each in its own thread; `start` resumes the jobs a previous run left."""

    def __init__(self, *, bus: Bus, store: StateStore, aggregator: AggregatorClient, aggregator_target: str,
                 checkpoint_dir: str, heartbeat_timeout_s: float = 60.0, poll_interval_s: float = 0.2,
                 evaluator: Evaluator | None = None, broker_consumer_timeout_s: float | None = None,
                 aggregator_outage_s: float = 300.0, store_outage_s: float = 300.0,
                 max_running_jobs: int = 16, safety_poll_s: float = 2.0,
                 worker_broker_users: Mapping[str, Sequence[str]] | None = None,
                 follow_broker_users: Callable[[], Mapping[str, Sequence[str]]] | None = None,
                 strict_categories: bool = False) -> None:
        """`broker_consumer_timeout_s`: RabbitMQ's consumer_timeout on this deployment (None: no limit, e.g.
        the in-process bus). `aggregator_outage_s`: how long a job waits for an unreachable aggregation
        service before it fails; `store_outage_s` likewise for a state store that cannot be written (a lock
        held elsewhere, a full disk). `max_running_jobs`: jobs driven at once, one thread each; later jobs
        wait `pending`, first submitted first started. `safety_poll_s`: a round (or an async job) waits on the
        aggregation service's events (coordinator/events.py) and looks at its status at least this often,
        in case an event was lost; `poll_interval_s`: how often waits for workers look at the registry.
        `worker_broker_users`: broker user → the worker ids it may speak for on the control queue (None or
        empty: not checked; control.SenderBinding); `follow_broker_users`: that map as it is now, while the
        coordinator runs (its config file, followed). `strict_categories`: refuse a job whose category no registered
        worker serves (else it is accepted with a warning naming the known categories)."""
        if isinstance(max_running_jobs, bool) or not isinstance(max_running_jobs, int) or max_running_jobs < 1:
            raise ConfigError("coordinator.max_running_jobs", f"must be an integer >= 1, got {max_running_jobs!r}")
        if isinstance(safety_poll_s, bool) or not isinstance(safety_poll_s, (int, float)) or not 0 < safety_poll_s <= 3600:
            raise ConfigError("coordinator.safety_poll_s", f"must be a number of seconds in (0, 3600], got {safety_poll_s!r}")
        self.bus = bus
        self.store = store
        self.aggregator = aggregator.without_retries()  # `calls` owns the retrying, so retries never nest
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.broker_consumer_timeout_s = broker_consumer_timeout_s
        self.store_outage_s = store_outage_s
        self.max_running_jobs = max_running_jobs
        self.strict_categories = strict_categories
        self.events = JobWatcher(self.aggregator)
        # a ConfigError for a bad worker id, before anything; unbound senders are a warning where a broker has users
        senders = SenderBinding(worker_broker_users or {}, shared_broker=bool(getattr(bus, "user", None)),
                                follow=follow_broker_users)
        self.epsilon_bounds = EpsilonBounds(store)
        self._stop = threading.Event()
        self.context = JobContext(
            bus=bus, store=store, aggregator=self.aggregator, events=self.events, stop=self._stop,
            calls=AggregatorCalls(outage_s=aggregator_outage_s, stop=self._stop), cancels=CancelRequests(),
            budgets=WorkerBudgets(), aggregator_target=aggregator_target, checkpoint_dir=checkpoint_dir,
            evaluator=evaluator, heartbeat_timeout_s=heartbeat_timeout_s, poll_interval_s=poll_interval_s,
            safety_poll_s=float(safety_poll_s), waiting=WaitingReasons(store), epsilon_bounds=self.epsilon_bounds,
            senders=senders)
        self.control = ControlHandler(bus=bus, store=store, events=self.events, budgets=self.context.budgets,
                                      async_job=self._async_job, bounds=self.epsilon_bounds, senders=senders)
        self.site_watch = SiteWatch(store, heartbeat_timeout_s=heartbeat_timeout_s)  # `expired` site events
        self._jobs_lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}  # the running jobs' threads
        self._queue: collections.deque[tuple[str, JobSpec | None]] = collections.deque()  # jobs waiting for one
        self._done: dict[str, threading.Event] = {}  # set when a job launched here ends (or stop() drops it)
        self._async_jobs: dict[str, AsyncJob] = {}  # running asynchronous jobs: their task outcomes go to them

    # ----- lifecycle -----

    def start(self) -> None:
        """Consume control messages and resume every job that was running when we last stopped."""
        metrics.REGISTRY_COLLECTOR.bind(self)
        BUSES.watch(self.bus, client="coordinator")
        self.events.start()
        note_revoked(self.store, self.control.senders)   # and, from now on, as the followed map changes
        self.site_watch.start()
        self.bus.consume_control(self.control.on_control)
        for row in self.store.jobs(status=JobStatus.CANCELLING):  # asked to cancel before we stopped: finish that
            self.context.cancels.request(row.job_id, row.submitter)
            self._launch(row.job_id)
        for row in self.store.jobs(status=JobStatus.RUNNING) + self.store.jobs(status=JobStatus.PENDING):
            log.info("resuming job %s after round %d", row.job_id, row.rounds_done)
            self._launch(row.job_id)

    def stop(self) -> None:
        """Pause every job where it waits (the next start resumes them) and stop consuming."""
        self._stop.set()
        with self._jobs_lock:  # queued jobs stay pending in the store: the next start runs them
            for job_id, _ in self._queue:
                self._done[job_id].set()
            self._queue.clear()
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout=10)
        self.events.stop()
        self.site_watch.stop()
        metrics.REGISTRY_COLLECTOR.unbind(self)
        BUSES.unwatch("coordinator")

    def wait(self, job_id: str, timeout: float | None = None) -> str:
        """The job's status once its thread here has ended (or `timeout` passed); "unknown" for no such job."""
        done = self._done.get(job_id)
        if done is not None:
            done.wait(timeout)
        row = self.store.job(job_id)
        return row.status if row else "unknown"

    def log_consumer_timeout(self) -> None:
        """Say which consumer timeout the broker applies to held tasks, which every round is kept inside: the
        deployment's (broker.consumer_timeout_s, set on every task queue and consumer) on RabbitMQ 3.12 to 4.2;
        on older brokers their own broker-wide `consumer_timeout`, which AMQP cannot read, so the setting must
        equal it."""
        timeout = self.broker_consumer_timeout_s
        honoured = getattr(self.bus, "consumer_timeout_honoured", None)
        version = ".".join(str(v) for v in getattr(self.bus, "broker_version", None) or ()) or "unknown"
        if timeout is None or honoured is None:
            return
        if honoured:
            log.info("RabbitMQ %s applies broker.consumer_timeout_s (%g s) to every task: rounds are kept within "
                     "%g s", version, timeout, self.max_round_timeout_s or timeout)
        else:
            log.warning("RabbitMQ %s applies its own broker-wide consumer_timeout to held tasks (per-queue "
                        "x-consumer-timeout needs 3.12): broker.consumer_timeout_s (%g s) must equal it, or a task "
                        "held longer is redelivered", version, timeout)

    def revoked_sites(self) -> frozenset[str]:
        """The registered sites no broker user may speak for any more (empty when senders are not checked): never
        selected, and shown revoked by `fedbroker sites`."""
        bound = self.control.senders.provisioned()
        return frozenset(w.worker_id for w in self.store.workers() if w.worker_id not in bound) if bound \
            else frozenset()

    @property
    def provisioned_sites(self) -> frozenset[str]:
        """The worker ids some broker user may speak for (empty: senders are not checked): the bounded set of sites
        the per-site metrics are exported for."""
        return self.control.senders.provisioned()

    # ----- intake -----

    @property
    def max_round_timeout_s(self) -> float | None:
        """The longest schedule.round_timeout_s this deployment accepts (None: any)."""
        timeout = self.broker_consumer_timeout_s
        if timeout is None:
            return None
        return timeout - min(CONSUMER_TIMEOUT_MARGIN_S, 0.2 * timeout)

    def check_job(self, job: JobSpec) -> list[str]:
        """A worker holds its task's delivery (unacked) until it has uploaded, and gives up at the round's
        deadline: the broker must not reclaim the delivery before, or it closes the worker's channel.
        The algorithm registries check the job's aggregation too, so an in-process caller that parsed the
        job without them (`parse_job`) cannot start rounds that the aggregation service would refuse.
        Returns the warnings of a job accepted with doubts (a category no registered worker serves)."""
        problems = job_problems(aggregation=job.aggregation, model=job.model, training=job.training,
                                schedule=job.schedule)
        unserved = self._unserved(job)
        warnings = [f"{unserved}; the job waits up to schedule.wait_for_workers_s "
                    f"({job.schedule.wait_for_workers_s:g}s) for one to register"] if unserved else []
        if unserved and self.strict_categories:
            problems.append(ConfigError("category", f"{unserved}, and coordinator.strict_categories is on"))
            warnings = []
        # The data its category's active workers reported: a model that cannot take it is refused here, before
        # any round, instead of failing inside every worker's training.
        problems += data_fit_problems(job.model, self.context.active_workers(job.category),
                                      category=job.category, pipeline=job.data.pipeline)
        limit, timeout = self.max_round_timeout_s, self.broker_consumer_timeout_s
        if limit is not None and timeout is not None and job.schedule.round_timeout_s > limit:
            problems.append(ConfigError(
                "schedule.round_timeout_s",
                f"must be at most {limit:g} s here, got {job.schedule.round_timeout_s:g}: a worker holds its task "
                f"until the round's deadline, and the broker's consumer_timeout is {timeout:g} s (less "
                f"{timeout - limit:g} s to finish an upload); raise the broker's consumer_timeout and "
                f"broker.consumer_timeout_s together for longer rounds",
            ))
        if len(problems) == 1:
            raise problems[0]
        if problems:
            raise ConfigErrors(problems)
        return warnings

    def _unserved(self, job: JobSpec) -> str:
        """Why no registered worker serves the job's category ("" when one does): a misspelt category would
        only wait, then fail."""
        known = sorted({c for w in self.store.workers() for c in w.categories})
        if job.category in known:
            return ""
        return f"no registered worker serves category {job.category!r} (known: {', '.join(known) or 'none yet'})"

    def submit(self, job: JobSpec, *, submitter: str = "") -> str:
        """`submitter`: the identity whose token submitted it (the only one that may cancel or download it)."""
        return self.submit_job(job, submitter=submitter).job_id

    def submit_job(self, job: JobSpec, *, submitter: str = "", start: Mapping[str, np.ndarray] | None = None) -> Submitted:
        """Check, record and start a job; its id and warnings (each also an event of the job, and logged).
        `start`: its checked start weights (`start_weights.resolve_start`), kept before the job is recorded."""
        warnings = [*self.check_job(job), *submission_warnings(job)]
        job_id = f"{job.name[:40]}-{secrets.token_hex(4)}"
        projection, out_of_budget = submission_projection(
            self.context.active_workers(job.category), self.context.budgets.snapshot(), job_id=job_id,
            training=job.training)
        warnings += out_of_budget
        if start is not None:
            save_start(self.context.checkpoint_dir, job_id, start)
        self.store.add_job(job_id, job.name, job.to_json(), job.training.rounds, job.model.to_json(),
                           submitter=submitter)
        for warning in warnings:  # accepted, but the submitter should know (`jobs logs`)
            log.info("job %s accepted with a warning: %s", job_id, warning)
            try:
                self.store.note_event(job_id, "warning", warning)
            except StateUnavailable as exc:  # the job is recorded: it runs, and the submitter is told anyway
                log.error("job %s: its warning could not be recorded (%s)", job_id, exc)
        self._launch(job_id, job)
        return Submitted(job_id, warnings, projection)

    def waiting(self, job_id: str) -> str:
        """Why the job has not started its next round ("" when it is not waiting): its loop's reason, or, for a
        job queued behind max_running_jobs running ones, that."""
        with self._jobs_lock:
            queued = any(entry[0] == job_id for entry in self._queue)
            running = len(self._threads)
        if queued:
            return f"queued: {running} job(s) running, coordinator.max_running_jobs is {self.max_running_jobs}"
        return self.context.waiting.get(job_id)

    def cancel(self, job_id: str, *, by: str = "", wait_s: float = 30.0) -> str:
        """Cancel a job; its status after up to `wait_s` (`cancelled`, or `cancelling` while its thread is
        still on its way to the next point where it waits). A queued job is dropped at once; a running one
        stops at that point: its open round is abandoned at the aggregation service, never closed, so no
        half-gathered round becomes a version (cancellation.py). A close already under way finishes first.

        The status is read under `_jobs_lock`, which a job's thread holds to leave `_threads` after writing
        how it ended: a job not running here has its final status in the store already. The store changes
        only a job that has not ended, so a cancel landing as the job completes never turns it cancelled."""
        with self._jobs_lock:
            row = self.store.job(job_id)
            if row is None:
                raise NotFound(f"no job {job_id!r}")
            if row.status in FINISHED:
                raise Conflict(f"job {job_id!r} is already {row.status}: there is nothing to cancel")
            queued = [entry for entry in self._queue if entry[0] == job_id]
            running = job_id in self._threads
            for entry in queued:
                self._queue.remove(entry)
                self._done[job_id].set()
            if not running:  # never started here (queued, or left pending by a stopped run): no round to abandon
                if not self.store.cancel_job(job_id, by=by):
                    ended = self.store.job(job_id)
                    raise Conflict(f"job {job_id!r} is already {ended.status if ended else 'gone'}: there is "
                                   f"nothing to cancel")
                return JobStatus.CANCELLED
            self.context.cancels.request(job_id, by)
            self.events.poke(job_id)  # a loop waiting on the service's events acts now, not at its safety poll
        self.store.request_cancel(job_id, by=by)  # durable: a restart before the thread acts finishes it
        self._done[job_id].wait(wait_s)
        after = self.store.job(job_id)
        return after.status if after is not None else JobStatus.CANCELLED

    # ----- the job threads -----

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
        """A job's thread: drive it, and record however it ends (a pause leaves it for the next start)."""
        self.context.cancels.bind(job_id)
        try:
            metrics.job_started(job_id)  # its counters exist at 0 before the first round can count
            try:
                # A store that cannot be written for a while (a lock held elsewhere, a full disk) is ridden
                # out like an aggregation-service outage; past store_outage_s the job fails, visibly.
                with self.store.retrying_writes(for_s=self.store_outage_s, sleep=self._stop.wait,
                                                stopping=self._stop.is_set):
                    self._drive(job_id, job)
            except Cancelled:
                try:
                    cancel_job(self.context, job_id)
                except StateUnavailable as exc:  # still `running` in the store: a restart resumes it
                    log.error("job %s: its cancellation could not be recorded (%s); cancel it again", job_id, exc)
            except Stopped:  # the job stays running in the store; the next start resumes it
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
            self.context.waiting.clear(job_id)
            with self._jobs_lock:
                self._threads.pop(job_id, None)
                self.context.cancels.forget(job_id)
                self._done[job_id].set()
                self._dispatch()

    def _record_failure(self, job_id: str, error: str) -> None:
        """Record the job as failed, retrying through a store outage for as long as it lasts: a job whose
        thread ended must not stay `running` in the store. Only a stopping coordinator gives up (the job is
        then still `running` in the store, and the next start resumes it)."""

        def log_retry(exc: Exception, retry: int, delay: float) -> None:
            log.error("job %s failed, and that could not be recorded yet (%s); retrying in %.1fs", job_id, exc, delay)

        try:
            retry_call(lambda: self.store.set_job_status(job_id, JobStatus.FAILED, error), backoff=OUTAGE_BACKOFF,
                       deadline=math.inf, on_retry=log_retry, sleep=self._stop.wait,
                       retryable=lambda exc: isinstance(exc, StateUnavailable) and not self._stop.is_set())
        except StateUnavailable as exc:
            log.error("job %s failed (%s) but the coordinator stopped before that could be recorded (%s); the next "
                      "start resumes it", job_id, error, exc)

    # ----- one job's path -----

    def _drive(self, job_id: str, job: JobSpec | None) -> None:
        row = self.store.job(job_id)
        if row is None:
            raise JobFailed(f"job {job_id!r} is not in the coordinator's store")
        if row.status in FINISHED:  # cancelled as `start` launched it: nothing to wait for
            log.info("job %s is %s: not started", job_id, row.status)
            return
        if job is None:  # resumed: the store holds the job's one wire form
            job = job_from_json(row.spec_json)
        self._await_workers(job_id, job)
        if not self.store.set_job_status(job_id, JobStatus.RUNNING):
            self._not_running(job_id)
            return
        # before round 1, the sites share what the job needs (and agree on its standardisation): sharing.py
        model = agreed_model(self.context, job_id, job, first_round=row.rounds_done == 0)
        run = self._restore(job_id, job, model, rounds_done=row.rounds_done)
        if job.schedule.mode == "async":  # no rounds: coordinator/asynchronous.py
            self._drive_async(run)
        else:
            SyncRounds(self.context, run).drive(first_round=row.rounds_done + 1)
        self.store.set_job_status(job_id, JobStatus.COMPLETED)

    def _not_running(self, job_id: str) -> None:
        """The store would not mark the job running: one asked to cancel is cancelled now (`Cancelled`), one
        that ended meanwhile (a cancel landing as its thread started) is left as it ended."""
        row = self.store.job(job_id)
        if row is not None and row.status == JobStatus.CANCELLING:
            raise Cancelled()
        log.info("job %s is %s: not started", job_id, row.status if row is not None else "gone")

    def _restore(self, job_id: str, job: JobSpec, model: ModelSpec, *, rounds_done: int) -> Run:
        """The global model the job is at: its last checkpoint, or the initial weights of `model` (the job's, or
        with its agreed standardisation in front) before its first round."""
        last = self.store.last_checkpoint(job_id)
        # (an asynchronous version recorded without a checkpoint leaves the model to AsyncJob._install)
        if rounds_done and last is not None and last.checkpoint and last.model_version is not None:
            tensors, spec_json = load_checkpoint(last.checkpoint)
            return Run(job_id, job, last.model_version, spec_json, tensors)
        from fedbroker.model import initial_weights

        plan = job.plan
        if plan == ModelPlan():
            return Run(job_id, job, 1, model.to_json(), initial_weights(model, seed=job.seed))
        from fedbroker.weights.adapters import start_state

        base = load_start(self.context.checkpoint_dir, job_id) if plan.initial_weights or plan.from_job else None
        return Run(job_id, job, 1, model.to_json(), start_state(model, plan, seed=job.seed, base=base))

    def _drive_async(self, run: Run) -> None:
        driver = AsyncJob(self.context, run)
        with self._jobs_lock:
            self._async_jobs[run.job_id] = driver
        try:
            driver.drive()
        finally:
            with self._jobs_lock:
                self._async_jobs.pop(run.job_id, None)

    def _async_job(self, job_id: str) -> AsyncJob | None:
        return self._async_jobs.get(job_id)

    def _await_workers(self, job_id: str, job: JobSpec) -> None:
        """Until schedule.min_workers workers of the category are active, saying so (JobRow.waiting)."""
        def enough() -> tuple[bool, int]:
            active = self.context.active_workers(job.category)
            done = len(active) >= job.schedule.min_workers
            if not done:
                unserved = self._unserved(job)
                self.context.waiting.note(job_id, f"{len(active)} of {job.schedule.min_workers} worker(s) of category "
                                                  f"{job.category!r} active (schedule.min_workers)"
                                                  + (f"; {unserved}" if unserved else ""))
            return done, len(active)

        done, active = self.context.poll(enough, within_s=job.schedule.wait_for_workers_s)
        if not done:
            raise JobFailed(
                f"only {active} active worker(s) of category {job.category!r} registered within "
                f"{job.schedule.wait_for_workers_s:g}s; schedule.min_workers is {job.schedule.min_workers}"
                + (f"; {unserved}" if (unserved := self._unserved(job)) else ""))
        self.context.waiting.clear(job_id)
