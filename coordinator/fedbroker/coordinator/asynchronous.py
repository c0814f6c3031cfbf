"""The asynchronous job loop (schedule.mode async, FedBuff): no round barrier.

Every worker that can afford it holds one task at a time. The aggregation service numbers the tasks and
names their base version (always the newest: `IssueTasks`), folds each accepted update into its buffer
and publishes a version every `buffer_size` updates. The coordinator watches the service
(`BufferStatus`): a worker whose update was accepted gets its next task at once, each new version is
downloaded, checkpointed, evaluated and recorded as one row of the job's table (row k = version k + 1,
so `fedbroker status` and a resumed coordinator count versions where a synchronous job counts rounds).
The job ends after `training.rounds` versions or `schedule.time_budget_s` of wall-clock time.

Faults: the service's spool holds the buffer, the issued tasks and the versions, so a restarted
coordinator asks the service where the job is (never re-installs a model over it) and re-sends every
outstanding task (a worker acks a copy of a task whose update was accepted without training again); a
service that lost the job gets the last checkpoint and a fresh buffer. A worker that refused or failed a
task (its budget, a stale update) or let its task's deadline pass is given a new one after a backoff;
a worker that cannot afford the job gets none.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from fedbroker import envelope
from fedbroker.coordinator import metrics
from fedbroker.coordinator.checkpoints import load_checkpoint, save_checkpoint
from fedbroker.coordinator.participants import why_unaffordable
from fedbroker.errors import BusError, Rejection
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.retry import Backoff
from fedbroker.rpc import RemoteError

log = logging.getLogger(__name__)

# A worker whose task came back refused or failed waits this long before its next one (doubling, capped).
RETRY_BACKOFF = Backoff(initial_s=1.0, max_s=60.0)


@dataclass
class _Held:
    """A task a worker holds: its number and until when the worker may work on it."""

    task: int
    deadline: float


class AsyncJob:
    """One asynchronous job's loop; `coordinator` is the scheduler's Coordinator (its store, bus, calls)."""

    def __init__(self, coordinator: Any, run: Any, *, stopped: type[Exception], failed: type[Exception]) -> None:
        """`coordinator`: the scheduler's Coordinator; `run`: its _Run for the job; `stopped` and `failed`:
        its exceptions for a coordinator that stops and a job that fails (the scheduler imports this module)."""
        self.c = coordinator
        self._stopped = stopped
        self._failed = failed
        self.run = run
        self.job = run.job
        self.held: dict[str, _Held] = {}
        self.failures: dict[str, int] = {}        # worker → refused/failed tasks in a row
        self.resting: dict[str, float] = {}       # worker → when it may get a task again
        self._outcomes: list[tuple[str, int, str, str]] = []
        self._lock = threading.Lock()

    # ----- the loop -----

    def drive(self) -> None:
        job_id, job = self.run.job_id, self.job
        metrics.ASYNC_RUNNING.labels(job_id).set(1)
        try:
            self._install()
            row = self.c.store.job(job_id)
            started = float(row["created"]) if row is not None else time.time()
            metrics.LAST_VERSION_TIME.labels(job_id).set(time.time())
            unaffordable_since: float | None = None
            while True:
                if self.c._stop.is_set():
                    raise self._stopped
                status = self._status()
                self._record_versions(status)
                if self._done(started):
                    self.c._call(self.run, "close the buffer", lambda: self.c.aggregator.close_buffer(job_id),
                                 reinstall=False)
                    break
                self._settle(status)
                idle, why = self._idle_workers()
                if idle:
                    self._issue(idle)
                    unaffordable_since = None
                elif not self.held:  # nobody trains and nobody can: wait for a worker, then give up
                    unaffordable_since = unaffordable_since or time.monotonic()
                    if time.monotonic() - unaffordable_since > job.schedule.wait_for_workers_s:
                        reasons = "; ".join(f"{w}: {r}" for w, r in sorted(why.items()) if r)
                        raise self._failed(f"no worker of category {job.category!r} can take a task of this "
                                        f"asynchronous job after {job.schedule.wait_for_workers_s:g}s"
                                        f"{' [' + reasons + ']' if reasons else ''}")
                # the next accepted update (or a refusal) wakes us at once; a held task's deadline, a new worker
                # or a lost event within the safety poll
                self.c.events.wait(job_id, self.c.safety_poll_s)
                if self.c._stop.is_set():
                    raise self._stopped
                self.c._halt_if_cancelled()  # the buffer is closed, never folded into a version (_cancel_job)
        finally:
            metrics.ASYNC_RUNNING.labels(job_id).set(0)

    def _done(self, started: float) -> bool:
        job = self.job
        done = self._versions_recorded()
        if done >= job.training.rounds:
            log.info("asynchronous job %s: %d version(s), done", self.run.job_id, done)
            return True
        if job.schedule.time_budget_s and time.time() - started >= job.schedule.time_budget_s:
            log.info("asynchronous job %s: time budget of %gs spent after %d version(s)", self.run.job_id,
                     job.schedule.time_budget_s, done)
            return True
        return False

    def _versions_recorded(self) -> int:
        row = self.c.store.job(self.run.job_id)
        return int(row["rounds_done"]) if row is not None else 0

    # ----- the service -----

    def _install(self) -> None:
        """Where the service has the job, leave it there (its versions may be ahead of our checkpoints);
        else install the last checkpoint (or the initial model) and open the buffer."""
        run = self.run
        try:
            self.c._call(run, "buffer status", lambda: self.c.aggregator.buffer_status(run.job_id), reinstall=False)
            known, in_async = True, True
        except RemoteError as exc:
            if exc.reason == Rejection.UNKNOWN_JOB:
                known, in_async = False, False
            elif exc.code == grpc.StatusCode.FAILED_PRECONDITION:  # holds the model, buffer not opened yet
                known, in_async = True, False
            else:
                raise
        if not known:
            self._from_checkpoint()
            self.c._call(run, "install the global model", lambda: self.c.aggregator.put_global(
                run.job_id, run.version, run.spec_json, run.tensors), reinstall=False)
        if not in_async:
            self._open_buffer()
        self._resend_outstanding()

    def _from_checkpoint(self) -> None:
        rows = [r for r in self.c.store.rounds(self.run.job_id) if r["status"] == "closed" and r["checkpoint"]]
        if rows:
            tensors, spec_json = load_checkpoint(rows[-1]["checkpoint"])
            self.run.version, self.run.spec_json, self.run.tensors = int(rows[-1]["model_version"]), spec_json, tensors

    def _open_buffer(self) -> None:
        run, schedule = self.run, self.job.schedule
        registered = {w.worker_id: w.num_samples for w in self.c.store.workers(self.job.category)}
        size = schedule.buffer_size or max(1, len(self.c.store.workers(
            self.job.category, seen_within_s=self.c.heartbeat_timeout_s)))
        self.c._call(run, "open the buffer", lambda: self.c.aggregator.open_buffer(
            run.job_id, aggregation=asdict(self.job.aggregation), buffer_size=size,
            max_staleness=schedule.max_staleness, staleness=schedule.staleness,
            staleness_params=dict(schedule.staleness_params), server_lr=schedule.server_lr, seed=self.job.seed,
            num_samples=registered), reinstall=False)
        log.info("asynchronous job %s: buffer of %d update(s) opened on version %d", run.job_id, size, run.version)

    def _status(self) -> pb.BufferStatusReply:
        run = self.run
        last = self.c.store.last_checkpoint(run.job_id)
        since = int(last["model_version"]) if last is not None else 0
        def status() -> pb.BufferStatusReply:
            reply: pb.BufferStatusReply = self.c._call(
                run, "buffer status", lambda: self.c.aggregator.buffer_status(run.job_id, since), reinstall=False)
            return reply

        try:
            return status()
        except RemoteError as exc:
            if exc.reason != Rejection.UNKNOWN_JOB:
                raise
            log.warning("the aggregation service lost asynchronous job %s (%s): installing it again", run.job_id, exc)
            self._install()
            return status()

    def _resend_outstanding(self) -> None:
        """After our restart (or the service's): every task the service holds as outstanding goes out again,
        with a fresh deadline; a worker that has it already acks the copy once its update is in."""
        status = self.c._call(self.run, "buffer status", lambda: self.c.aggregator.buffer_status(self.run.job_id),
                              reinstall=False)
        if status.outstanding:
            self._publish(list(status.outstanding), status.buffer_size)

    # ----- versions -----

    def _record_versions(self, status: pb.BufferStatusReply) -> None:
        job_id = self.run.job_id
        metrics.BUFFER_FILL.labels(job_id).set(status.buffered / status.buffer_size if status.buffer_size else 0.0)
        for row in sorted(status.versions, key=lambda r: r.version):
            last = self.c.store.last_checkpoint(job_id)
            if last is not None and int(last["model_version"]) >= row.version:
                continue
            number = self._versions_recorded() + 1
            if number > self.job.training.rounds:
                return
            self._record(number, row)

    def _record(self, number: int, row: pb.VersionRow) -> None:
        run, job_id = self.run, self.run.job_id
        checkpoint, spec_json = "", run.spec_json
        try:
            version, spec_json, tensors = self.c._call(
                run, f"download version {row.version}", lambda: self.c.aggregator.download(job_id, row.version),
                reinstall=False)
            checkpoint = save_checkpoint(self.c.checkpoint_dir, job_id, number, tensors, spec_json)
            run.version, run.spec_json, run.tensors = version, spec_json, tensors
        except RemoteError as exc:  # the service keeps max_staleness + 1 versions; we fell that far behind
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            log.warning("version %d of %s is no longer kept by the service: recorded without a checkpoint",
                        row.version, job_id)
            tensors = None
        scores = self.c.evaluator(self.job, spec_json, tensors) if self.c.evaluator and tensors else None
        accuracy, loss = scores if scores else (None, None)
        last = {u.worker_id: u for u in row.updates}  # a fast worker may be in one buffer twice: its last update
        previous = self.c.store.round(job_id, number - 1)  # seconds: between the service's publications
        started = (float(json.loads(previous["stats_json"] or "{}").get("created_unix", previous["started"]))
                   if previous is not None else float(self.c.store.job(job_id)["created"]))
        seconds = max(0.0, row.created_unix - started)
        self.c.store.open_round(job_id, number, sorted(last), started=started)
        stats = {"mean_staleness": sum(row.staleness) / len(row.staleness) if row.staleness else 0.0,
                 "max_staleness": float(max(row.staleness, default=0)), "updates": float(len(row.updates)),
                 "created_unix": row.created_unix}
        self.c.store.close_round(
            job_id, number, model_version=row.version, aggregated=sorted(last),
            updates=[(u.worker_id, u.num_samples, u.epsilon, u.train_loss) for u in last.values()],
            accuracy=accuracy, loss=loss, seconds=seconds, checkpoint=checkpoint, stats=stats,
            model_spec_json=spec_json)
        metrics.VERSIONS.labels(job_id).inc()
        metrics.ROUNDS_COMPLETED.labels(job_id).inc()
        metrics.ROUND.labels(job_id).set(number)
        metrics.LAST_VERSION_TIME.labels(job_id).set(time.time())
        if accuracy is not None and loss is not None:
            metrics.MODEL_ACCURACY.labels(job_id).set(accuracy)
            metrics.MODEL_LOSS.labels(job_id).set(loss)
        try:  # a notification: the store is the truth
            self.c.bus.publish_event(envelope.encode(round_completed=pb.RoundCompleted(
                job_id=job_id, round=number, model_version=row.version, aggregated=len(row.updates),
                accuracy=accuracy or 0.0, loss=loss or 0.0, final=number == self.job.training.rounds,
                seconds=seconds)))
        except BusError as exc:
            log.warning("event of version %d of %s not published: %s", row.version, job_id, exc)
        log.info("version %d of %s (%d of %d): %d update(s), mean staleness %.2f, accuracy %s", row.version, job_id,
                 number, self.job.training.rounds, len(row.updates), stats["mean_staleness"],
                 f"{accuracy:.4f}" if accuracy is not None else "n/a")

    # ----- tasks -----

    def outcome(self, worker_id: str, task: int, status: str, reason: str) -> None:
        """A worker's report that it refused or failed a task (from the control queue's thread)."""
        with self._lock:
            self._outcomes.append((worker_id, task, status, reason))

    def _settle(self, status: pb.BufferStatusReply) -> None:
        """Which workers still hold a task: the service's outstanding ones, less those reported refused or
        failed and those past their deadline (they rest, then get a new task)."""
        now = time.time()
        outstanding = {t.worker_id: t.task for t in status.outstanding}
        with self._lock:
            outcomes, self._outcomes = self._outcomes, []
        reported = {(w, t) for w, t, s, _ in outcomes if s in ("refused", "failed")}
        for worker_id, task, status_name, reason in outcomes:
            log.info("worker %s %s task %d of %s: %s", worker_id, status_name, task, self.run.job_id, reason)
        for worker_id in list(self.held):
            held = self.held[worker_id]
            if outstanding.get(worker_id) != held.task:  # accepted (or superseded): free for the next one
                del self.held[worker_id]
                self.failures.pop(worker_id, None)
            elif (worker_id, held.task) in reported or now > held.deadline:
                del self.held[worker_id]
                failures = self.failures.get(worker_id, 0)
                self.failures[worker_id] = failures + 1
                self.resting[worker_id] = now + RETRY_BACKOFF.delay(failures)

    def _idle_workers(self) -> tuple[list[str], dict[str, str]]:
        """Active workers of the category that hold no task, are not resting, and can afford one more; and
        each active worker's reason it cannot ("" when it can)."""
        job, job_id, now = self.job, self.run.job_id, time.time()
        active = self.c.store.workers(job.category, seen_within_s=self.c.heartbeat_timeout_s)
        with self.c._budgets_lock:
            budgets = dict(self.c._budgets)
        why = {w.worker_id: why_unaffordable(w, budgets.get(w.worker_id), job_id=job_id, training=job.training)
               for w in active}
        idle = [w for w, reason in sorted(why.items())
                if not reason and w not in self.held and self.resting.get(w, 0.0) <= now]
        return idle, why

    def _issue(self, workers: list[str]) -> None:
        run = self.run
        issued = self.c._call(run, "issue tasks", lambda: self.c.aggregator.issue_tasks(run.job_id, workers),
                              reinstall=False)
        status_size = self.job.schedule.buffer_size or len(workers)
        self._publish(issued, status_size)

    def _publish(self, tasks: list[pb.IssuedTask], buffer_size: int) -> None:
        run, job = self.run, self.job
        deadline = time.time() + job.schedule.round_timeout_s
        recorded = {w.worker_id: w.epsilon_spent for w in self.c.store.workers()}
        population = self.c._population(job)
        batch = []
        for issued in tasks:
            task = pb.RoundTask(
                job_id=run.job_id, round=issued.task, training_json=json.dumps(asdict(job.training)),
                category=job.category, model_version=issued.base_version, aggregator_target=self.c.aggregator_target,
                deadline_unix=deadline, population_distribution=population, participants=buffer_size,
                seed=job.seed, aggregation_json=json.dumps(asdict(job.aggregation)),
                recorded_epsilon_spent=recorded.get(issued.worker_id, 0.0))
            self.held[issued.worker_id] = _Held(issued.task, deadline)
            batch.append((issued.worker_id, envelope.encode(round_task=task)))
        sent = self.c._publish_batch(batch, deadline)
        for worker_id, _ in batch:
            if worker_id not in sent:
                self.held[worker_id].deadline = 0.0  # never sent: reissued after a rest
        log.debug("asynchronous job %s: %d task(s) published", run.job_id, len(tasks))

