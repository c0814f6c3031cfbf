"""A data owner's worker: registers, consumes its round tasks, trains under its own DP policy, uploads.

The AMQP message is acked only after the aggregation service's receipt, so a worker that dies mid-task
gets the task redelivered; a redelivered task whose update was already accepted is acked without
training again (no second privacy cost, no double count).

The worker holds a task's delivery no longer than the round lasts: it refuses a task whose deadline has
passed and abandons training when the deadline passes, so a deployment whose RabbitMQ consumer_timeout
exceeds every job's round_timeout_s (the coordinator refuses other jobs) never has a channel closed
under a training worker. Calls to the aggregation service retry an outage until the task's deadline: for
as long as the round can still use the update. Other failures are classified in `on_task`: permanent ones
are reported and acked (or dead-lettered when the task itself is unreadable), transient ones are retried
with a backoff until the bus dead-letters the task after `max_attempts`.

A worker never trains from a ledger that holds less ε than the coordinator recorded for it (a lost or
replaced ledger), nor past its owner's ε budget: it refuses the task (worker/budget.py, which also writes
its heartbeats).

Every control message it publishes carries its broker user (the bus sets the validated `user_id`), which the
coordinator binds to its worker id. With `worker.coordinator_broker_user` set, it trains only tasks that user
published: a task another broker user put in its queue (a site may publish to the tasks exchange) could ask
for any training settings, and is dead-lettered untrained.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from fedbroker.bus import Bus, BusError, Delivery, envelope
from fedbroker.config import DPPolicy, WorkerConfig
from fedbroker.datasets import load_worker_data, strata, train_test_split
from fedbroker.errors import ConfigError, FedbrokerError, Rejection, TaskRefused
from fedbroker.job.alignment_plan import alignment_plan
from fedbroker.job.spec import ModelSpec, TrainingConfig, parse_model
from fedbroker.job.task import TaskConfig
from fedbroker.label_stats import reported_ish
from fedbroker.metrics import BUSES
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.retry import Backoff
from fedbroker.rpc.aggregation_client import AggregatorClient, Model
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.rpc.plumbing import RemoteError
from fedbroker.secagg import SecAggError
from fedbroker.version import installed_version
from fedbroker.weights.plan import ModelPlan, trainable_names
from fedbroker.worker import metrics
from fedbroker.worker.batches import job_pipeline

if TYPE_CHECKING:
    from fedbroker.job.pipeline import DataPipeline
from fedbroker.worker.budget import JOB_COSTS_KEPT, SiteBudget
from fedbroker.worker.distributed_step import refuse_without_dp, step_for
from fedbroker.worker.evaluation import SiteEvaluation
from fedbroker.worker.global_model import build_global, fit_problem
from fedbroker.worker.job_settings import JobSettingsCache
from fedbroker.worker.ledger import PrivacyLedger
from fedbroker.worker.log_forward import LogForwarder, remove
from fedbroker.worker.partition import partition
from fedbroker.worker.presence import PresenceLoop
from fedbroker.worker.secure_task import SecureRun, SecureStepFailed, SecureSteps
from fedbroker.worker.sharing import Sharing
from fedbroker.worker.training import TrainResult, check_batch_memory, pick_device, train_local

log = logging.getLogger(__name__)


REGISTER_EVERY_BEATS = 6


class _PoisonTask(FedbrokerError):
    """Internal: a task no retry can run (its training config or model is invalid): dead-letter it."""


class _DeadlinePassed(FedbrokerError):
    """Internal: training outlived the round's deadline; the update is abandoned."""


class _DataMismatch(FedbrokerError):
    """Internal: the job's model cannot take this worker's data; no retry can change that, so the task is
    reported as failed with the reason and acked, never retried into the dead-letter queue."""


_FAILURE_REASONS: dict[type[Exception], str] = {
    _DataMismatch: "data_mismatch", _DeadlinePassed: "deadline_passed",
    SecureStepFailed: Rejection.SECURE_PROTOCOL, SecAggError: Rejection.SECURE_PROTOCOL,
}


class WorkerAgent:
    """One data owner's worker: its data share, its privacy ledger, and the task loop on the bus (module docstring)."""

    def __init__(self, config: WorkerConfig, bus: Bus, *, security: ClientSecurity | None = None,
                 log_forwarder: LogForwarder | None = None, secure_steps: SecureSteps | None = None,
                 aggregator_target: str = "") -> None:
        """`security`: this worker's token (and TLS) for the aggregation service, read from its secrets;
        `aggregator_target`: the service it beats its presence at from the start (worker.presence; "" = none);
        `log_forwarder`: the process's forwarder of its warnings to the coordinator (launch.start_worker), taken
        off the root logger at `stop`; `secure_steps`: who watches its secure tasks' steps (a test's; None)."""
        self.config = config
        self.bus = bus
        self.security = security
        self.log_forwarder = log_forwarder
        self.secure_steps = secure_steps
        self.started_unix = time.time()  # a registration with a new one tells the coordinator we restarted
        self.dp: DPPolicy | None = config.dp if config.dp.enabled else None
        data = load_worker_data(config)  # first: a data owner's bad file is named before anything else happens
        self.ledger = PrivacyLedger(config.ledger_path, worker_id=config.id)
        self.device = pick_device() if config.device == "auto" else config.device
        if isinstance(config.physical_batch_size, bool) or config.physical_batch_size < 0:
            raise ConfigError("worker.physical_batch_size",
                              f"must be a whole number >= 0 (0: the whole batch), got {config.physical_batch_size!r}")
        train, test = train_test_split(data, test_fraction=config.test_fraction, seed=config.split_seed)
        p = config.partition
        shards = partition(strata(train), scheme=p.scheme, num_clients=p.num_clients, seed=p.seed, alpha=p.alpha,
                           classes_per_client=p.classes_per_client)
        if not 0 <= p.client_index < len(shards):
            raise ValueError(f"partition.client_index {p.client_index} is outside [0, {len(shards)})")
        index = shards[p.client_index]
        self.x, self.y = train.x[index], train.y[index]
        self.num_classes = data.num_classes
        self.labels = data.labels   # what a label is (worker.data.labels): the tasks this site can train
        self.budget = SiteBudget(worker_id=config.id, ledger=self.ledger, dp=self.dp, num_samples=len(self.y))
        # What a job may ask of this site before round 1 (its label histogram, feature statistics), released
        # only then, noised, and charged once; DWFed's ISH is computed from the released histogram.
        self.sharing = Sharing(worker_id=config.id, categories=config.categories, ledger=self.ledger, dp=self.dp,
                               histogram_epsilon=config.histogram_epsilon,
                               statistics_epsilon=config.statistics_epsilon, standardize=str(config.data.standardize),
                               # labels that are not classes have no class histogram: one class, as strata
                               x=self.x, y=self.y if self.labels == "class" else np.zeros(len(self.y), np.int64),
                               num_classes=self.num_classes if self.labels == "class" else 1)
        self._state = "idle"
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._trained: dict[tuple[str, int, int], TrainResult] = {}  # an update whose upload failed, kept for the retry
        self._secure: dict[tuple[str, int, int], SecureRun] = {}  # a secure task's protocol state, kept for the retry
        # One channel to the aggregation service, kept from task to task: a channel per task paid a TCP (and,
        # with TLS, a handshake) per round, ~0.7 ms of a stub worker's ~4 ms control-plane cost on loopback.
        self._channel: AggregatorClient | None = None
        self.aggregator_target = aggregator_target if config.presence else ""
        self.presence = PresenceLoop(config.id, channel=lambda: self._channel, state=lambda: self._state)
        self.job_settings = JobSettingsCache(kept=JOB_COSTS_KEPT)  # each job's settings, parsed once
        self.evaluation = SiteEvaluation(config, bus=bus, ledger=self.ledger, test=test, device=self.device,
                                         aggregator=self._aggregator, stopping=self._stop.is_set,
                                         plan_of=self.job_settings.plan, pipeline_of=self._pipeline_of)
        self.retry_initial_s = 1.0   # backoff before a failed task goes back to the queue
        self.retry_max_s = 30.0
        if not config.coordinator_broker_user:  # a warning where the bus has users to tell apart (RabbitMQ)
            log.log(logging.WARNING if getattr(bus, "user", None) else logging.INFO,
                    "worker %s trains tasks from any broker user (worker.coordinator_broker_user is empty): whoever "
                    "may publish to the tasks exchange may ask it for any training", config.id)

    # ----- lifecycle -----

    def start(self) -> None:
        """Announce this worker (registration, a first heartbeat), then take tasks and beat in the background."""
        BUSES.watch(self.bus, client=self.config.id)
        metrics.worker_started(self.config.id)
        self.budget.export()
        log.info("%s", self.sharing.summary())
        self.bus.declare_worker(self.config.id)
        self.register()
        if self.log_forwarder is not None:  # the coordinator files a site's records once it knows the site
            self.log_forwarder.start_sending()
        self.send_heartbeat()  # at once: the coordinator opens rounds only with workers that reported a budget
        if self.aggregator_target:  # on the channel its tasks use (opened now, before any task can race for it)
            self._aggregator(self.aggregator_target)
            self.presence.start()
        self.bus.consume_tasks(self.config.id, self.on_task)
        self._heartbeat = threading.Thread(target=self._beat, name=f"heartbeat-{self.config.id}", daemon=True)
        self._heartbeat.start()

    def stop(self) -> None:
        """Stop beating and close the channel to the aggregation service; a running task goes back to the queue."""
        self._stop.set()
        BUSES.unwatch(self.config.id)
        forwarder, self.log_forwarder = self.log_forwarder, None
        if forwarder is not None:
            remove(forwarder)
        channel, self._channel = self._channel, None
        if channel is not None:  # a task still running fails, and its delivery goes back to the queue
            channel.close()
        self.presence.stop()  # its call in flight ended with the channel

    def _aggregator(self, target: str) -> AggregatorClient:
        """The channel to the service a task names; a task naming another one replaces it. Tasks run one at
        a time (the bus's one handler thread per worker), so this needs no lock."""
        if self._channel is None or self._channel.target != target:
            if self._channel is not None:
                self._channel.close()
            self._channel = AggregatorClient(target, security=self.security)
        return self._channel

    def register(self) -> None:
        """Tell the coordinator what this worker holds and allows: categories, data shape and count, DP policy, ε
        spent. No label histogram: it goes only to a job that asks (worker/sharing.py)."""
        dp = self.dp
        registration = pb.Registration(
            worker_id=self.config.id, categories=list(self.config.categories), dp_enabled=dp is not None,
            dp_policy=pb.DPPolicy(**{k: v for k, v in dataclasses.asdict(dp).items() if k != "enabled"}) if dp else None,
            epsilon_spent=self.ledger.total_epsilon(), device=self.device, num_samples=len(self.y),
            evaluation_samples=self.evaluation.num_samples,  # the most an evaluation report of it may claim
            input_shape=[int(d) for d in self.x.shape[1:]], num_classes=self.num_classes,
            software_version=installed_version(), started_unix=self.started_unix,
        )
        self.bus.publish_control(envelope.encode(registration=registration))

    def _beat(self) -> None:
        beats = 0
        while not self._stop.wait(self.config.heartbeat_s):
            beats += 1
            try:
                if beats % REGISTER_EVERY_BEATS == 0:  # a coordinator that lost its state learns of us again
                    self.register()
                    continue
                self.bus.publish_control(envelope.encode(heartbeat=self.heartbeat()))
            except Exception as exc:  # the bus reconnects on its own; a missed beat is only logged
                log.warning("heartbeat of %s not sent: %s", self.config.id, exc)

    def send_heartbeat(self) -> None:
        """A heartbeat now, outside the beat (at start, and when the ledger changed); never raises."""
        try:
            self.bus.publish_control(envelope.encode(heartbeat=self.heartbeat()))
        except Exception as exc:
            log.warning("heartbeat of %s not sent: %s", self.config.id, exc)

    def heartbeat(self) -> pb.Heartbeat:
        """This worker's state and what it can still afford (worker/budget.py): the coordinator opens a round
        only with workers that can afford it."""
        return self.budget.heartbeat(state=self._state)

    # ----- tasks -----

    def on_task(self, delivery: Delivery) -> None:
        """Settle every task exactly once, by what went wrong (see the module docstring):

        * done, or already done (our update was accepted before): ack;
        * refused (category, deadline, budget) or failed for good (the service refused the update for a
          reason a retry cannot change, or the round's deadline passed during training): report, ack;
        * a task this worker cannot even read (malformed, an invalid training config or model): report,
          dead-letter at once — a poison message is never retried;
        * the service unreachable, restarting or out of spool space: each call already retried until the
          round's deadline (`AggregatorClient.until`), so the round cannot use the update any more: report, ack;
        * anything else (a service that lost the job, a broker hiccup, an unexpected error in training):
          requeue after a backoff, so the bus counts the attempt and dead-letters the task after
          `max_attempts`; the last attempt reports the failure first, so the round does not wait.
        """
        me = self.config.id
        metrics.TASKS_RECEIVED.labels(me).inc()
        if delivery.redelivered:
            metrics.TASKS_REDELIVERED.labels(me).inc()
        coordinator = self.config.coordinator_broker_user
        if coordinator and delivery.sender != coordinator:
            log.error("worker %s dead-letters a task published by broker user %r, not the coordinator's %r",
                      me, delivery.sender, coordinator)
            metrics.TASKS.labels(me, "foreign_sender").inc()
            delivery.nack(requeue=False)
            return
        try:
            message = envelope.decode(delivery.body, expect=("round_task", "share_request", "evaluation_task"))
        except envelope.MalformedMessage as exc:
            log.error("worker %s dead-letters a malformed task: %s", me, exc)
            metrics.TASKS.labels(me, "malformed").inc()
            delivery.nack(requeue=False)
            return
        if message.HasField("share_request"):
            self._answer_share(delivery, message.share_request)
            return
        if message.HasField("evaluation_task"):  # scoring a global model: worker/evaluation.py
            self.evaluation.handle(delivery, message.evaluation_task)
            return
        task = message.round_task
        try:
            outcome = "uploaded" if self.run_task(task) is not None else "already_uploaded"
        except TaskRefused as exc:
            outcome = "refused"
            metrics.TASKS_REFUSED.labels(me, exc.reason).inc()
            self._report(task, pb.TaskOutcome.REFUSED, str(exc))
        except _PoisonTask as exc:
            log.error("worker %s dead-letters task %s/%d: %s", me, task.job_id, task.round, exc)
            self._report(task, pb.TaskOutcome.FAILED, str(exc))
            metrics.TASKS.labels(me, "malformed").inc()
            delivery.nack(requeue=False)
            return
        except (_DeadlinePassed, _DataMismatch, RemoteError, SecureStepFailed, SecAggError) as exc:
            if isinstance(exc, RemoteError) and not Rejection.is_final(exc.reason):  # retried: it may get better
                self._retry_later(delivery, task, exc)
                return
            outcome = "failed"
            metrics.TASKS_FAILED.labels(me, _FAILURE_REASONS.get(type(exc), "update_refused")).inc()
            self._report(task, pb.TaskOutcome.FAILED, str(exc), spent=self._forget(task))
        except Exception as exc:  # unexpected: maybe transient (memory, disk, a bug hit by one input); retried
            if self._stop.is_set():  # `stop` closed the channel under the task: it goes back to the queue
                log.info("worker %s stopping: task %s/%d goes back to the queue (%s)", me, task.job_id, task.round, exc)
                delivery.nack(requeue=True)
                return
            log.exception("task %s/%d failed on %s", task.job_id, task.round, me)
            self._retry_later(delivery, task, exc)
            return
        finally:
            self._state = "idle"
        delivery.ack()
        metrics.TASKS.labels(me, outcome).inc()
        metrics.TASKS_ACKED.labels(me).inc()

    def _answer_share(self, delivery: Delivery, request: pb.ShareRequest) -> None:
        """Reply to a job's share request on the control bus, then ack; one past its deadline is acked unanswered.
        A reply the bus could not take goes back to the queue: its releases are kept, so the retry costs no ε."""
        if request.deadline_unix and time.time() > request.deadline_unix:
            log.info("worker %s drops job %s's share request: its deadline passed", self.config.id, request.job_id)
            metrics.SHARE_REQUESTS.labels(self.config.id, "expired").inc()
            delivery.ack()
            return
        spent = self.ledger.total_epsilon()
        reply = self.sharing.reply(request)  # an unexpected error (a ledger it cannot write) is retried by the bus
        try:
            self.bus.publish_control(envelope.encode(share_reply=reply))
        except BusError as exc:
            log.warning("worker %s: reply to job %s's share request not sent (%s); retried", self.config.id,
                        request.job_id, exc)
            delivery.nack(requeue=True)
            return
        self.sharing.note_sent(reply)
        if self.ledger.total_epsilon() != spent:  # a new draw: the coordinator's picture of our budget, fresh
            self.budget.export()
            self.send_heartbeat()
        metrics.SHARE_REQUESTS.labels(self.config.id, "refused" if reply.refused else "shared").inc()
        delivery.ack()
        metrics.TASKS_ACKED.labels(self.config.id).inc()

    def _retry_later(self, delivery: Delivery, task: pb.RoundTask, exc: Exception) -> None:
        me = self.config.id
        max_attempts = getattr(self.bus, "max_attempts", None)
        if task.deadline_unix and time.time() >= task.deadline_unix:  # no round left to retry for
            self._report(task, pb.TaskOutcome.FAILED, f"{type(exc).__name__}: {exc} (the round's deadline passed)",
                         spent=self._forget(task))
            delivery.ack()
            metrics.TASKS.labels(me, "failed").inc()
            metrics.TASKS_ACKED.labels(me).inc()
            return
        if max_attempts is not None and delivery.attempts >= max_attempts:
            self._report(task, pb.TaskOutcome.FAILED, f"{type(exc).__name__}: {exc} (gave up after "
                                                      f"{delivery.attempts} attempts; the task is dead-lettered)",
                         spent=self._forget(task))
        else:
            # Backoff before the retry: it holds the delivery (prefetch 1), so it stays far below the broker's
            # consumer_timeout, and it never runs past the round's deadline.
            backoff = Backoff(initial_s=self.retry_initial_s, max_s=self.retry_max_s)
            delay = backoff.delay(delivery.attempts - 1,
                                  at_most=task.deadline_unix - time.time() if task.deadline_unix else None)
            log.warning("task %s/%d on %s failed (attempt %d%s): %s; retrying in %.1fs", task.job_id, task.round, me,
                        delivery.attempts, f" of {max_attempts}" if max_attempts else "", exc, delay)
            self._stop.wait(delay)
        metrics.TASKS.labels(me, "requeued").inc()
        delivery.nack(requeue=True)

    def _report(self, task: pb.RoundTask, status: pb.TaskOutcome.Status, reason: str, *,
                spent: TrainResult | None = None) -> None:
        """`spent`: the update trained for this task and never accepted: its ε is spent all the same, and the
        job's record must say so (a cancelled job's round refuses the upload of a worker still training)."""
        epsilon = spent.epsilon if spent is not None and spent.epsilon is not None else 0.0
        if epsilon:
            reason = f"{reason} (trained first: ε {epsilon:.4g} spent)"
        log.info("worker %s %s round %d of %s: %s", self.config.id, pb.TaskOutcome.Status.Name(status).lower(),
                 task.round, task.job_id, reason)
        try:
            self.bus.publish_control(envelope.encode(task_outcome=pb.TaskOutcome(
                job_id=task.job_id, round=task.round, worker_id=self.config.id, status=status,
                reason=reason, epsilon=epsilon, train_loss=spent.train_loss if spent is not None else 0.0,
                epsilon_local_floor=spent.epsilon_local_floor or 0.0 if spent is not None else 0.0)))
        except BusError as exc:  # the round's deadline still ends the wait for us
            log.warning("outcome of task %s/%d not reported: %s", task.job_id, task.round, exc)

    def run_task(self, task: pb.RoundTask) -> pb.UploadReceipt | None:
        """Train and upload one task; None when the round already holds our update (a redelivered task)."""
        if task.category not in self.config.categories:
            raise TaskRefused(f"category {task.category!r} is not one this worker serves ({list(self.config.categories)})")
        if task.deadline_unix and time.time() > task.deadline_unix:
            raise TaskRefused(f"the round's deadline passed {time.time() - task.deadline_unix:.0f}s before the task ran")
        def fetch(digest: str) -> pb.JobSettings:  # we lack them (restarted since the job's first task)
            client = self._aggregator(task.aggregator_target).until(task.deadline_unix)
            return client.job_settings(task.job_id, self.config.id, digest)

        try:
            installed = self.job_settings.for_task(task, fetch)
        except ValueError as exc:  # ConfigError(s): settings no retry can make valid
            raise _PoisonTask(f"invalid job settings in the task: {exc}") from None
        config, layerwise = installed.training, installed.algorithms.alignment.params.layerwise
        distributed = installed.privacy.distributed.enabled  # distributed DP: priced per round (distributed_step.py)
        self.budget.note_job(task.job_id, config, distributed=distributed)  # for the heartbeats' costs
        self.budget.check_ledger(task.recorded_epsilon_spent)
        if task.population_distribution:  # DWFed's ISH needs the released histogram: drawn (and charged) first
            self.sharing.histogram()
        refuse_without_dp(self.dp, task.job_id) if distributed else self.budget.check_budget(task.job_id, config)
        key = (task.job_id, task.round, task.model_version)
        # Every call retries through an outage (or a full spool) for as long as the round can use it.
        client = self._aggregator(task.aggregator_target).until(task.deadline_unix)
        result = self._trained.get(key)  # an upload that failed before: send the same update, spend no ε again
        secure = self._secure_run(task, key)
        start = client.start_task(task.job_id, task.round, self.config.id, task.model_version,
                                  model=result is None or (secure is not None and secure.global_model is None))
        if start.accepted:
            if secure is not None and secure.masked is not None:  # our masked input is in: help unmask the sum
                secure.unmask(client)
            log.info("round %d of %s already has our update: acking the redelivered task", task.round, task.job_id)
            self._forget(task)
            return None
        if not start.open:
            raise TaskRefused(f"round {task.round} of job {task.job_id} is no longer open")
        if secure is not None:  # the keys and shares before training: a worker that fails here spent no ε
            secure.global_model = secure.global_model or start.model
            secure.exchange_keys(client)
        if result is None:
            assert start.model is not None  # asked for, and the round wants our update
            result = self._train(task, config, start.model, layerwise=layerwise, secure=secure)
            self._trained = {key: result}
        self._state = "uploading"
        receipt = self._upload(client, task, result) if secure is None else self._upload_masked(client, secure, result)
        self._forget(task)
        metrics.SENT_BYTES.labels(self.config.id).inc(sum(a.nbytes for a in result.state.values()))
        log.info("worker %s uploaded round %d of %s (loss %.4f, ε %s, %.1fs)", self.config.id, task.round,
                 task.job_id, result.train_loss, f"{result.epsilon:.3f}" if result.epsilon is not None else "off",
                 result.seconds)
        return receipt

    def _train(self, task: pb.RoundTask, config: TrainingConfig, global_model: Model, *,
               layerwise: bool = False, secure: SecureRun | None = None) -> TrainResult:
        self._state = "training"
        metrics.RECEIVED_BYTES.labels(self.config.id).inc(sum(a.nbytes for a in global_model[2].values()))
        installed = self.job_settings.get(task.job_id)  # held for every task `run_task` trains
        plan = installed.plan if installed is not None else ModelPlan()
        job_task = installed.task if installed is not None else TaskConfig()
        try:
            spec, model = build_global(global_model, plan, limits=self.config.limits,  # over them: refused
                                       start_digest=installed.start_digest if installed is not None else "")
            # the layer-wise mode: the layers matched in earlier rounds do not train (the same plan the service reads)
            frozen = alignment_plan(spec).frozen_in_round(task.round) if layerwise else frozenset()
        except ValueError as exc:
            raise _PoisonTask(str(exc)) from None
        self.check_data_fits(spec, job_task, pipeline=job_pipeline(installed))
        self.sharing.check_model(spec)  # its preprocessing against data.standardize

        def give_up_at_deadline(step: int, total: int) -> None:
            # Past the deadline the service refuses the update: stop holding the task (and the broker's
            # delivery) for nothing. A model that is never released spends no privacy.
            if task.deadline_unix and time.time() > task.deadline_unix:
                raise _DeadlinePassed(f"the round's deadline passed during training (step {step} of {total}); "
                                      f"update abandoned")

        pipeline = job_pipeline(installed)
        try:  # the owner's memory budget against the job's batch, before any step
            check_batch_memory(self.x, self.y, config=config, pipeline=pipeline, memory_mib=self.config.data.memory_mib,
                               dp=self.dp is not None, physical_batch_size=self.config.physical_batch_size or None)
        except ConfigError as exc:
            raise _DataMismatch(str(exc)) from None
        if secure is not None and secure.ddp is not None:  # distributed DP: one noised gradient sum, no training
            result = secure.ddp.run(secure, model, spec, x=self.x, y=self.y, task=job_task, pipeline=pipeline,
                                    device=self.device, frozen=frozen, cache=self.config.data.cache)
            self.send_heartbeat()  # both figures are on the ledger: the coordinator's picture, fresh
            return result
        result = train_local(model, self.x, self.y, config=config, dp=self.dp,
                             history=self.ledger.history(task.job_id), device=self.device,
                             seed=self._training_seed(task), progress=give_up_at_deadline,
                             physical_batch_size=self.config.physical_batch_size or None, frozen=frozen,
                             task=job_task, pipeline=pipeline, cache=self.config.data.cache)
        if result.epsilon is not None:  # spent once trained, whether or not the upload succeeds
            self.ledger.record(task.job_id, history=result.history, epsilon=result.epsilon)
            self.send_heartbeat()  # the coordinator's picture of our budget, fresh before this round closes
        metrics.export_training(self.config.id, result, memory_mib=self.config.data.memory_mib)
        self.budget.export()
        if plan.restricts_training:  # only what trains travels: adapters and named heads, nothing frozen
            trained = trainable_names(spec, plan)
            result = dataclasses.replace(result, state={name: result.state[name] for name in trained})
        return result

    def _secure_run(self, task: pb.RoundTask, key: tuple[str, int, int]) -> SecureRun | None:
        """The secure protocol's state of this task (aggregation.secure), kept across its retries; else None."""
        job = self.job_settings.held(task.job_id)
        if not job.aggregation.secure:
            return None
        run = self._secure.get(key)
        if run is None:
            run = SecureRun(worker_id=self.config.id, task=task, num_samples=len(self.y), ish=self._ish(task),
                            steps=self.secure_steps, group_size=job.aggregation.secure_group_size,
                            ddp=step_for(task.job_id, job, policy=self.dp, budget=self.budget))
            self._secure = {key: run}
        return run

    def _upload_masked(self, client: AggregatorClient, secure: SecureRun, result: TrainResult) -> pb.UploadReceipt:
        """Mask the weighted update, upload it, then send the unmask shares once the round names its survivors."""
        assert secure.global_model is not None
        secure.mask(result.state, secure.global_model[2], parse_model(json.loads(secure.global_model[1])))
        assert secure.masked is not None
        task = secure.task
        receipt = client.upload_masked(job_id=task.job_id, round=task.round, worker_id=self.config.id,
                                       num_samples=secure.num_samples, masked=secure.masked, ish=secure.ish,
                                       epsilon=result.epsilon or 0.0, train_loss=result.train_loss)
        log.info("worker %s uploaded its masked update for round %d of %s", self.config.id, task.round, task.job_id)
        secure.unmask(client)
        return receipt

    def _upload(self, client: AggregatorClient, task: pb.RoundTask, result: TrainResult) -> pb.UploadReceipt:
        return client.upload(
            job_id=task.job_id, round=task.round, worker_id=self.config.id,
            num_samples=result.num_samples, tensors=result.state, ish=self._ish(task),
            epsilon=result.epsilon or 0.0, train_loss=result.train_loss,
        )

    def _forget(self, task: pb.RoundTask) -> TrainResult | None:
        """Drop the update (and secure state) kept for this task's retry; the dropped update, if any."""
        self._secure.pop((task.job_id, task.round, task.model_version), None)
        return self._trained.pop((task.job_id, task.round, task.model_version), None)

    def _training_seed(self, task: pb.RoundTask) -> int:
        """Without DP the job's seed makes runs repeatable. With DP the seed also drives the Gaussian noise,
        and anyone who knows it (the coordinator, the data scientist) could regenerate and subtract that
        noise: so a DP worker draws its seed from the operating system, never from the job."""
        if self.dp is not None:
            return int.from_bytes(os.urandom(8), "little") >> 1
        return int(task.seed) * 1000 + task.round

    def check_data_fits(self, spec: ModelSpec, task: TaskConfig | None = None, *,
                        pipeline: DataPipeline | None = None) -> None:
        """Refuse a model whose input or output does not fit this worker's data as the job's pipeline prepares it
        (and the job's task) before any training step."""
        problem = fit_problem(spec, self.x, self.num_classes, holder="this worker's data", task=task,
                              labels=self.labels, pipeline=pipeline)
        if problem:
            raise _DataMismatch(problem)

    def _pipeline_of(self, job_id: str) -> DataPipeline | None:
        """The data pipeline of a job whose settings this site holds (None: none, or no data section)."""
        return job_pipeline(self.job_settings.get(job_id))

    def _ish(self, task: pb.RoundTask) -> float | None:
        if not task.population_distribution:
            return None
        return reported_ish(self.sharing.histogram()[0], task.population_distribution, participants=task.participants,
                            settings=self.job_settings.held(task.job_id).algorithms)
