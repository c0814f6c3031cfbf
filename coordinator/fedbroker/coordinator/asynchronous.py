"""The asynchronous job loop (schedule.mode async, FedBuff): no round barrier.

Every worker that can afford it holds one task at a time. The aggregation service numbers the tasks and
names their base version (always the newest: `IssueTasks`), folds each accepted update into its buffer
and publishes a version every `buffer_size` updates. The coordinator watches the service
(`BufferStatus`): a worker whose update was accepted gets its next task at once, each new version is
downloaded, checkpointed, evaluated and recorded as one row of the job's table (row k = version k + 1,
so `fedbroker status` and a resumed coordinator count versions where a synchronous job counts rounds), and
every `evaluation.every` rows the sites that made it are asked to score it (federated.py).
The job ends after `training.rounds` versions or `schedule.time_budget_s` of wall-clock time.

Each task carries its worker's registered sample count to the service (`IssueTasks`), so a worker that
registered after the buffer opened is bounded like the others: its update cannot claim more samples than it
has, and so cannot outweigh everybody else's.

Faults: the service's spool holds the buffer, the issued tasks and the versions, so a restarted
coordinator asks the service where the job is (never re-installs a model over it) and re-sends every
outstanding task (a worker acks a copy of a task whose update was accepted without training again); a
service that lost the job gets the last checkpoint and a fresh buffer. A worker that refused or failed a
task (its budget, a stale update) or let its task's deadline pass is given a new one after a backoff;
a worker that cannot afford the job gets none.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np

from fedbroker.bus import envelope
from fedbroker.coordinator import federated, metrics
from fedbroker.coordinator.checkpoints import load_checkpoint, save_checkpoint
from fedbroker.coordinator.job_context import JobContext
from fedbroker.coordinator.job_run import JobFailed, Run, Stopped
from fedbroker.coordinator.waiting import unaffordable
from fedbroker.errors import BusError, Rejection
from fedbroker.job.status import ParticipantStatus, RoundStatus
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.retry import Backoff
from fedbroker.rpc.plumbing import RemoteError

log = logging.getLogger(__name__)
T = TypeVar("T")

# A worker whose task came back refused or failed waits this long before its next one (doubling, capped).
RETRY_BACKOFF = Backoff(initial_s=1.0, max_s=60.0)


@dataclass
class _Held:
    """A task a worker holds: its number and until when the worker may work on it."""

    task: int
    deadline: float


class AsyncJob:
    """One asynchronous job's loop, in the job's thread; `outcome` is called from the control queue's."""

    def __init__(self, ctx: JobContext, run: Run) -> None:
        self.ctx = ctx
        self.run = run
        self.job = run.job
        self.held: dict[str, _Held] = {}
        self.failures: dict[str, int] = {}        # worker → refused/failed tasks in a row
        self.resting: dict[str, float] = {}       # worker → when it may get a task again
        self._outcomes: list[tuple[str, int, ParticipantStatus, str]] = []
        self._lock = threading.Lock()

    # ----- the loop -----

    def drive(self) -> None:
        """Until `training.rounds` versions are recorded or the time budget is spent; then the buffer closes."""
        job_id, ctx = self.run.job_id, self.ctx
        metrics.ASYNC_RUNNING.labels(job_id).set(1)
        try:
            self._install()
            row = ctx.store.job(job_id)
            started = row.created if row is not None else time.time()
            metrics.LAST_VERSION_TIME.labels(job_id).set(time.time())
            unaffordable_since: float | None = None
            while True:
                if ctx.stop.is_set():
                    raise Stopped
                status = self._status()
                self._record_versions(status)
                if self._done(started) or federated.stopped_early(ctx, self.run):  # evaluation.patience
                    self._close()
                    break
                self._settle(status)
                unaffordable_since = self._hand_out_tasks(unaffordable_since)
                # the next accepted update (or a refusal) wakes us at once; a held task's deadline, a new worker
                # or a lost event within the safety poll
                ctx.events.wait(job_id, ctx.safety_poll_s)
                if ctx.stop.is_set():
                    raise Stopped
                ctx.halt_if_cancelled()  # the buffer is closed, never folded into a version (cancellation.py)
            federated.await_last(ctx, self.run)  # the final federated score is in before the job completes
        finally:
            metrics.ASYNC_RUNNING.labels(job_id).set(0)

    def _hand_out_tasks(self, unaffordable_since: float | None) -> float | None:
        """A task for every idle worker that can afford one; when nobody trains and nobody can, the job
        waits wait_for_workers_s for a worker (saying why: JobRow.waiting), then fails. Returns since when nobody
        could (None: somebody can)."""
        job, job_id = self.job, self.run.job_id
        idle, why = self._idle_workers()
        if idle:
            self._issue(idle)
            self.ctx.waiting.clear(job_id)
            return None
        if self.held:
            self.ctx.waiting.clear(job_id)
            return unaffordable_since
        self.ctx.fail_if_out_of_budget(job_id, job, needed=1, what="a task of this asynchronous job")
        now = time.time()
        why = {w: r or (f"resting after {self.failures.get(w, 0)} refused or failed task(s)"
                        if self.resting.get(w, 0.0) > now else "") for w, r in why.items()}
        reason = unaffordable(why, what="a task of this asynchronous job", category=job.category,
                              rule="one is needed")
        self.ctx.waiting.note(job_id, reason)
        unaffordable_since = unaffordable_since or time.monotonic()
        if time.monotonic() - unaffordable_since > job.schedule.wait_for_workers_s:
            raise JobFailed(f"no task handed out for {job.schedule.wait_for_workers_s:g}s: {reason}")
        return unaffordable_since

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
        row = self.ctx.store.job(self.run.job_id)
        return row.rounds_done if row is not None else 0

    # ----- the service -----

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """`fn()` through the service's outages; a service that lost the job is handled here (`_status`)."""
        return self.ctx.calls.call(self.run.job_id, what, fn)

    def _install(self) -> None:
        """Where the service has the job, leave it there (its versions may be ahead of our checkpoints);
        else install the last checkpoint (or the initial model) and open the buffer."""
        run, aggregator = self.run, self.ctx.aggregator
        self._call("install the job", lambda: aggregator.install_job(run.settings))  # idempotent: kept if held
        try:
            self._call("buffer status", lambda: aggregator.buffer_status(run.job_id))
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
            self._call("install the global model", lambda: aggregator.put_global(
                run.job_id, run.version, run.spec_json, run.tensors))
        if not in_async:
            self._open_buffer()
        self._resend_outstanding()

    def _from_checkpoint(self) -> None:
        """The job's last checkpointed version, if it has one (else the model it is at stays)."""
        for r in reversed(self.ctx.store.rounds(self.run.job_id)):
            if r.status == RoundStatus.CLOSED and r.checkpoint and r.model_version is not None:
                tensors, spec_json = load_checkpoint(r.checkpoint)
                self.run.version, self.run.spec_json, self.run.tensors = r.model_version, spec_json, tensors
                return

    def _open_buffer(self) -> None:
        run, schedule, store = self.run, self.job.schedule, self.ctx.store
        registered = {w.worker_id: w.num_samples for w in store.workers(self.job.category)}
        size = schedule.buffer_size or max(1, len(self.ctx.active_workers(self.job.category)))
        self._call("open the buffer", lambda: self.ctx.aggregator.open_buffer(
            run.job_id, buffer_size=size,
            max_staleness=schedule.max_staleness, staleness=schedule.staleness,
            staleness_params=dict(schedule.staleness_params), server_lr=schedule.server_lr, seed=self.job.seed,
            num_samples=registered))
        log.info("asynchronous job %s: buffer of %d update(s) opened on version %d", run.job_id, size, run.version)

    def _status(self) -> pb.BufferStatusReply:
        run = self.run
        last = self.ctx.store.last_checkpoint(run.job_id)
        since = (last.model_version or 0) if last is not None else 0

        def status() -> pb.BufferStatusReply:
            return self._call("buffer status", lambda: self.ctx.aggregator.buffer_status(run.job_id, since))

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
        status = self._call("buffer status", lambda: self.ctx.aggregator.buffer_status(self.run.job_id))
        if status.outstanding:
            self._publish(list(status.outstanding), status.buffer_size)

    def _close(self) -> None:
        """Close the buffer, then record the ε of every accepted update the job's rows do not hold: an upload
        accepted as the job reached its last version is in the buffer at the close, or in a version published
        after the last one recorded (`training.rounds` reached, or the job's time budget spent)."""
        job_id, ctx = self.run.job_id, self.ctx
        closed = self._call("close the buffer", lambda: ctx.aggregator.close_buffer(job_id))
        status = self._status()  # no version comes after the close: these are all there will be
        last = max((r.model_version or 0 for r in ctx.store.rounds(job_id)), default=0)
        late = [(u, f"in version {row.version}, published after the job's last ({last})")
                for row in status.versions if row.version > last for u in row.updates]
        record_not_aggregated(ctx, job_id, [*late, *((u, "in the buffer when it closed") for u in closed.discarded)])

    # ----- versions -----

    def _record_versions(self, status: pb.BufferStatusReply) -> None:
        job_id = self.run.job_id
        metrics.BUFFER_FILL.labels(job_id).set(status.buffered / status.buffer_size if status.buffer_size else 0.0)
        for row in sorted(status.versions, key=lambda r: r.version):
            last = self.ctx.store.last_checkpoint(job_id)
            if last is not None and (last.model_version or 0) >= row.version:
                continue
            number = self._versions_recorded() + 1
            if number > self.job.training.rounds:
                return
            self._record(number, row)

    def _record(self, number: int, row: pb.VersionRow) -> None:
        """Version `row` as the job's `number`-th row: checkpointed (while the service still keeps it),
        evaluated, recorded as one opened-and-closed round, announced."""
        job_id, store = self.run.job_id, self.ctx.store
        checkpoint, spec_json, tensors = self._download(number, row.version)
        scores = self.ctx.evaluator(self.job, spec_json, tensors) if self.ctx.evaluator and tensors else None
        accuracy, loss = scores if scores else (None, None)
        last = {u.worker_id: u for u in row.updates}  # a fast worker may be in one buffer twice: its last update
        started = self._previous_publication(number)  # seconds: between the service's publications
        seconds = max(0.0, row.created_unix - started)
        store.open_round(job_id, number, sorted(last), started=started)
        stats = {"mean_staleness": sum(row.staleness) / len(row.staleness) if row.staleness else 0.0,
                 "max_staleness": float(max(row.staleness, default=0)), "updates": float(len(row.updates)),
                 "created_unix": row.created_unix}
        store.close_round(
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
            self.ctx.bus.publish_event(envelope.encode(round_completed=pb.RoundCompleted(
                job_id=job_id, round=number, model_version=row.version, aggregated=len(row.updates),
                accuracy=accuracy or 0.0, loss=loss or 0.0, final=number == self.job.training.rounds,
                seconds=seconds)))
        except BusError as exc:
            log.warning("event of version %d of %s not published: %s", row.version, job_id, exc)
        log.info("version %d of %s (%d of %d): %d update(s), mean staleness %.2f, accuracy %s", row.version, job_id,
                 number, self.job.training.rounds, len(row.updates), stats["mean_staleness"],
                 f"{accuracy:.4f}" if accuracy is not None else "n/a")
        if tensors is not None:  # every evaluation.every versions the sites score it (a version gone: nothing to score)
            federated.after_round(self.ctx, self.run, number, row.version, sorted(last))

    def _download(self, number: int, version: int) -> tuple[str, str, dict[str, np.ndarray] | None]:
        """(checkpoint path, model spec JSON, tensors) of a published version; ("", the spec we are at, None)
        when the service no longer keeps it (it keeps max_staleness + 1 versions: we fell that far behind)."""
        run, job_id = self.run, self.run.job_id
        try:
            downloaded, spec_json, tensors = self._call(
                f"download version {version}", lambda: self.ctx.aggregator.download(job_id, version))
        except RemoteError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            log.warning("version %d of %s is no longer kept by the service: recorded without a checkpoint",
                        version, job_id)
            return "", run.spec_json, None
        checkpoint = save_checkpoint(self.ctx.checkpoint_dir, job_id, number, tensors, spec_json)
        run.version, run.spec_json, run.tensors = downloaded, spec_json, tensors
        return checkpoint, spec_json, tensors

    def _previous_publication(self, number: int) -> float:
        """When the version before the `number`-th was published (the job's submission for the first)."""
        previous = self.ctx.store.round(self.run.job_id, number - 1)
        if previous is not None:
            return float(previous.stats.get("created_unix", previous.started))
        job = self.ctx.store.job(self.run.job_id)
        return job.created if job is not None else time.time()

    # ----- tasks -----

    def outcome(self, worker_id: str, task: int, status: ParticipantStatus, reason: str) -> None:
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
        reported = {(w, t) for w, t, s, _ in outcomes if s in (ParticipantStatus.REFUSED, ParticipantStatus.FAILED)}
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
        now = time.time()
        why = self.ctx.why_unaffordable(self.run.job_id, self.job)
        idle = [w for w, reason in sorted(why.items())
                if not reason and w not in self.held and self.resting.get(w, 0.0) <= now]
        return idle, why

    def _issue(self, workers: list[str]) -> None:
        """Tasks for `workers`, each bounded by the sample count it registered, whenever that was (the
        service admits no upload claiming more, and issues no task to a worker whose count it is not told)."""
        run = self.run
        wanted = set(workers)
        registered = {w.worker_id: w.num_samples for w in self.ctx.store.workers() if w.worker_id in wanted}
        issued = self._call("issue tasks", lambda: self.ctx.aggregator.issue_tasks(run.job_id, workers,
                                                                                   num_samples=registered))
        status_size = self.job.schedule.buffer_size or len(workers)
        self._publish(issued, status_size)

    def _publish(self, tasks: list[pb.IssuedTask], buffer_size: int) -> None:
        run, job = self.run, self.job
        deadline = time.time() + job.schedule.round_timeout_s
        recorded = self.ctx.recorded_epsilon()
        population = self.ctx.population(run.job_id)
        batch = []
        for issued in tasks:
            task = pb.RoundTask(
                job_id=run.job_id, round=issued.task, category=job.category, model_version=issued.base_version,
                aggregator_target=self.ctx.aggregator_target, deadline_unix=deadline,
                population_distribution=population, participants=buffer_size, seed=job.seed,
                recorded_epsilon_spent=recorded.get(issued.worker_id, 0.0))
            run.task_settings(task, issued.worker_id)
            self.held[issued.worker_id] = _Held(issued.task, deadline)
            batch.append((issued.worker_id, envelope.encode(round_task=task)))
        sent = self.ctx.publish_tasks(batch, deadline, training=job.training, job_id=run.job_id)
        run.settings_sent |= sent
        for worker_id, _ in batch:
            if worker_id not in sent:
                self.held[worker_id].deadline = 0.0  # never sent: reissued after a rest
        log.debug("asynchronous job %s: %d task(s) published", run.job_id, len(tasks))


def record_not_aggregated(ctx: JobContext, job_id: str, updates: list[tuple[pb.UpdateSummary, str]]) -> None:
    """Accepted updates that no version of the job's record holds, each with where it is: their ε is spent on
    their sites' data all the same, so each is the site's not-aggregated row (store.record_async_training). The ε is
    the update header's, the site's own word: as a task outcome's, it is kept only within what the job's tasks to
    that site were priced at (`EpsilonBounds.allows`), else refused and counted."""
    bounds = ctx.epsilon_bounds
    for update, where in updates:
        log.info("asynchronous job %s: task %d of worker %s accepted, not aggregated (%s)", job_id, update.task,
                 update.worker_id, where)
        if update.epsilon > 0 and (bounds is None or bounds.allows(update.worker_id, job_id, update.epsilon,
                                                                   message="not_aggregated")):
            ctx.store.record_async_training(job_id, update.worker_id, task=update.task,
                                            status=ParticipantStatus.DISCARDED,
                                            reason=f"accepted as the job ended, {where}", epsilon=update.epsilon)
