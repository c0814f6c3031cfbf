"""A data owner's worker: registers, consumes its round tasks, trains under its own DP policy, uploads.

The AMQP message is acked only after the aggregation service's receipt, so a worker that dies mid-task
gets the task redelivered; a redelivered task whose update was already accepted is acked without
training again (no second privacy cost, no double count).

The worker holds a task's delivery no longer than the round lasts: it refuses a task whose deadline has
passed and abandons training when the deadline passes, so a deployment whose RabbitMQ consumer_timeout
exceeds every job's round_timeout_s (the coordinator refuses other jobs) never has a channel closed
under a training worker. Failures are classified in `on_task`: permanent ones are reported and acked
(or dead-lettered when the task itself is unreadable), transient ones are retried with a backoff until
the bus dead-letters the task after `max_attempts`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time

import numpy as np

from fedbroker import envelope
from fedbroker.aggregators.client import AggregatorClient
from fedbroker.aggregators.weighting import noisy_histogram, reported_ish
from fedbroker.auth import ClientSecurity
from fedbroker.bus import Bus, BusError, Delivery
from fedbroker.config import DPPolicy, WorkerConfig
from fedbroker.errors import BudgetExceeded, FedbrokerError, Rejection, TaskRefused
from fedbroker.metrics import BUSES
from fedbroker.model import build_model, load_numpy_state
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.retry import Backoff
from fedbroker.rpc import RemoteError
from fedbroker.spec import TrainingConfig, parse_model, training_from_json
from fedbroker.worker import metrics
from fedbroker.worker.accounting import dp_sample_rate, planned_steps, project_epsilon
from fedbroker.worker.data import load_dataset, train_test_split
from fedbroker.worker.ledger import PrivacyLedger
from fedbroker.worker.partition import partition
from fedbroker.worker.training import TrainResult, pick_device, train_local

log = logging.getLogger(__name__)


REGISTER_EVERY_BEATS = 6


class _PoisonTask(FedbrokerError):
    """Internal: a task no retry can run (its training config or model is invalid): dead-letter it."""


class _DeadlinePassed(FedbrokerError):
    """Internal: training outlived the round's deadline; the update is abandoned."""


class WorkerAgent:
    def __init__(self, config: WorkerConfig, bus: Bus, *, security: ClientSecurity | None = None) -> None:
        """`security`: this worker's token (and TLS) for the aggregation service, read from its secrets."""
        self.config = config
        self.bus = bus
        self.security = security
        self.dp: DPPolicy | None = config.dp if config.dp.enabled else None
        self.ledger = PrivacyLedger(config.ledger_path)
        self.device = pick_device() if config.device == "auto" else config.device
        data = load_dataset(config.dataset, idx_dir=config.idx_dir or None)
        train, _ = train_test_split(data, test_fraction=config.test_fraction, seed=config.split_seed)
        p = config.partition
        shards = partition(train.y, scheme=p.scheme, num_clients=p.num_clients, seed=p.seed, alpha=p.alpha,
                           classes_per_client=p.classes_per_client)
        if not 0 <= p.client_index < len(shards):
            raise ValueError(f"partition.client_index {p.client_index} is outside [0, {len(shards)})")
        index = shards[p.client_index]
        self.x, self.y = train.x[index], train.y[index]
        self.num_classes = data.num_classes
        self.histogram = np.bincount(self.y, minlength=self.num_classes)
        # What the coordinator sees. Noise is drawn once per worker lifetime: a fresh draw at every
        # registration would let the coordinator average the noise away.
        self.shared_histogram = self.histogram
        if config.histogram_epsilon:
            self.shared_histogram = noisy_histogram(self.histogram, epsilon=config.histogram_epsilon,
                                                    rng=np.random.default_rng())
        self._state = "idle"
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._trained: dict[tuple[str, int, int], TrainResult] = {}  # an update whose upload failed, kept for the retry
        self.retry_initial_s = 1.0   # backoff before a failed task goes back to the queue
        self.retry_max_s = 30.0

    # ----- lifecycle -----

    def start(self) -> None:
        BUSES.watch(self.bus, client=self.config.id)
        self._export_privacy()
        self.bus.declare_worker(self.config.id)
        self.register()
        self.bus.consume_tasks(self.config.id, self.on_task)
        self._heartbeat = threading.Thread(target=self._beat, name=f"heartbeat-{self.config.id}", daemon=True)
        self._heartbeat.start()

    def stop(self) -> None:
        self._stop.set()
        BUSES.unwatch(self.config.id)

    def _export_privacy(self) -> None:
        dp = self.dp
        metrics.set_privacy(self.config.id, spent=self.ledger.total_epsilon(),
                            budget=dp.epsilon_budget if dp is not None else None)

    def register(self) -> None:
        dp = self.dp
        registration = pb.Registration(
            worker_id=self.config.id, categories=list(self.config.categories),
            label_histogram=[int(c) for c in self.shared_histogram], dp_enabled=dp is not None,
            dp_policy=pb.DPPolicy(noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.max_grad_norm,
                                  delta=dp.delta, epsilon_budget=dp.epsilon_budget) if dp else None,
            epsilon_spent=self.ledger.total_epsilon(), device=self.device, num_samples=len(self.y),
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
                self.bus.publish_control(envelope.encode(heartbeat=pb.Heartbeat(
                    worker_id=self.config.id, epsilon_spent=self.ledger.total_epsilon(), state=self._state)))
            except Exception as exc:  # the bus reconnects on its own; a missed beat is only logged
                log.warning("heartbeat of %s not sent: %s", self.config.id, exc)

    # ----- tasks -----

    def on_task(self, delivery: Delivery) -> None:
        """Settle every task exactly once, by what went wrong (see the module docstring):

        * done, or already done (our update was accepted before): ack;
        * refused (category, deadline, budget) or failed for good (the service refused the update for a
          reason a retry cannot change, or the round's deadline passed during training): report, ack;
        * a task this worker cannot even read (malformed, an invalid training config or model): report,
          dead-letter at once — a poison message is never retried;
        * anything else (the service unreachable or restarting, a broker hiccup, an unexpected error in
          training): requeue after a backoff, so the bus counts the attempt and dead-letters the task
          after `max_attempts`; the last attempt reports the failure first, so the round does not wait.
        """
        me = self.config.id
        metrics.TASKS_RECEIVED.labels(me).inc()
        if delivery.redelivered:
            metrics.TASKS_REDELIVERED.labels(me).inc()
        try:
            task = envelope.decode(delivery.body, expect=("round_task",)).round_task
        except envelope.MalformedMessage as exc:
            log.error("worker %s dead-letters a malformed task: %s", me, exc)
            metrics.TASKS.labels(me, "malformed").inc()
            delivery.nack(requeue=False)
            return
        try:
            outcome = "uploaded" if self.run_task(task) is not None else "already_uploaded"
        except TaskRefused as exc:
            outcome = "refused"
            self._report(task, pb.TaskOutcome.REFUSED, str(exc))
        except _PoisonTask as exc:
            log.error("worker %s dead-letters task %s/%d: %s", me, task.job_id, task.round, exc)
            self._report(task, pb.TaskOutcome.FAILED, str(exc))
            metrics.TASKS.labels(me, "malformed").inc()
            delivery.nack(requeue=False)
            return
        except (_DeadlinePassed, RemoteError) as exc:
            if isinstance(exc, RemoteError) and not Rejection.is_final(exc.reason):  # retried: it may get better
                self._retry_later(delivery, task, exc)
                return
            outcome = "failed"
            self._forget(task)
            self._report(task, pb.TaskOutcome.FAILED, str(exc))
        except Exception as exc:  # unexpected: maybe transient (memory, disk, a bug hit by one input); retried
            log.exception("task %s/%d failed on %s", task.job_id, task.round, me)
            self._retry_later(delivery, task, exc)
            return
        finally:
            self._state = "idle"
        delivery.ack()
        metrics.TASKS.labels(me, outcome).inc()
        metrics.TASKS_ACKED.labels(me).inc()

    def _retry_later(self, delivery: Delivery, task: pb.RoundTask, exc: Exception) -> None:
        me = self.config.id
        max_attempts = getattr(self.bus, "max_attempts", None)
        if task.deadline_unix and time.time() >= task.deadline_unix:  # no round left to retry for
            self._forget(task)
            self._report(task, pb.TaskOutcome.FAILED, f"{type(exc).__name__}: {exc} (the round's deadline passed)")
            delivery.ack()
            metrics.TASKS.labels(me, "failed").inc()
            metrics.TASKS_ACKED.labels(me).inc()
            return
        if max_attempts is not None and delivery.attempts >= max_attempts:
            self._forget(task)
            self._report(task, pb.TaskOutcome.FAILED, f"{type(exc).__name__}: {exc} (gave up after "
                                                      f"{delivery.attempts} attempts; the task is dead-lettered)")
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

    def _report(self, task: pb.RoundTask, status: pb.TaskOutcome.Status, reason: str) -> None:
        log.info("worker %s %s round %d of %s: %s", self.config.id, pb.TaskOutcome.Status.Name(status).lower(),
                 task.round, task.job_id, reason)
        try:
            self.bus.publish_control(envelope.encode(task_outcome=pb.TaskOutcome(
                job_id=task.job_id, round=task.round, worker_id=self.config.id, status=status,
                reason=reason)))
        except BusError as exc:  # the round's deadline still ends the wait for us
            log.warning("outcome of task %s/%d not reported: %s", task.job_id, task.round, exc)

    def run_task(self, task: pb.RoundTask) -> pb.UploadReceipt | None:
        """Train and upload one task; None when the round already holds our update (a redelivered task)."""
        if task.category not in self.config.categories:
            raise TaskRefused(f"category {task.category!r} is not one this worker serves ({list(self.config.categories)})")
        if task.deadline_unix and time.time() > task.deadline_unix:
            raise TaskRefused(f"the round's deadline passed {time.time() - task.deadline_unix:.0f}s before the task ran")
        try:
            config = training_from_json(task.training_json)
        except (ValueError, TypeError) as exc:  # ConfigError and a JSON error are ValueErrors
            raise _PoisonTask(f"invalid training config in the task: {exc}") from None
        self.check_budget(task.job_id, config)
        key = (task.job_id, task.round, task.model_version)
        with AggregatorClient(task.aggregator_target, security=self.security) as client:
            accepted, is_open = client.status(task.job_id, task.round)
            if self.config.id in accepted:
                log.info("round %d of %s already has our update: acking the redelivered task", task.round, task.job_id)
                self._forget(task)
                return None
            if not is_open:
                raise TaskRefused(f"round {task.round} of job {task.job_id} is no longer open")
            result = self._trained.get(key)
            if result is None:  # else: an upload that failed before; send the same update, spend no ε again
                result = self._train(client, task, config)
                self._trained = {key: result}
            self._state = "uploading"
            receipt = self._upload(client, task, result)
            self._trained.pop(key, None)
            metrics.SENT_BYTES.labels(self.config.id).inc(sum(a.nbytes for a in result.state.values()))
        log.info("worker %s uploaded round %d of %s (loss %.4f, ε %s, %.1fs)", self.config.id, task.round,
                 task.job_id, result.train_loss, f"{result.epsilon:.3f}" if result.epsilon is not None else "off",
                 result.seconds)
        return receipt

    def _train(self, client: AggregatorClient, task: pb.RoundTask, config: TrainingConfig) -> TrainResult:
        self._state = "training"
        version, spec_json, weights = client.download(task.job_id, task.model_version)
        metrics.RECEIVED_BYTES.labels(self.config.id).inc(sum(a.nbytes for a in weights.values()))
        try:
            model = build_model(parse_model(json.loads(spec_json)))
            load_numpy_state(model, weights)
        except (ValueError, TypeError, KeyError, RuntimeError) as exc:
            raise _PoisonTask(f"the global model {version} cannot be built: {exc}") from None

        def give_up_at_deadline(step: int, total: int) -> None:
            # Past the deadline the service refuses the update: stop holding the task (and the broker's
            # delivery) for nothing. A model that is never released spends no privacy.
            if task.deadline_unix and time.time() > task.deadline_unix:
                raise _DeadlinePassed(f"the round's deadline passed during training (step {step} of {total}); "
                                      f"update abandoned")

        result = train_local(model, self.x, self.y, config=config, dp=self.dp,
                             history=self.ledger.history(task.job_id), device=self.device,
                             seed=self._training_seed(task), progress=give_up_at_deadline)
        if result.epsilon is not None:  # spent once trained, whether or not the upload succeeds
            self.ledger.record(task.job_id, history=result.history, epsilon=result.epsilon)
        self._export_training(result)
        return result

    def _upload(self, client: AggregatorClient, task: pb.RoundTask, result: TrainResult) -> pb.UploadReceipt:
        return client.upload(
            job_id=task.job_id, round=task.round, worker_id=self.config.id,
            num_samples=result.num_samples, tensors=result.state, ish=self._ish(task),
            epsilon=result.epsilon or 0.0, train_loss=result.train_loss,
        )

    def _forget(self, task: pb.RoundTask) -> None:
        self._trained.pop((task.job_id, task.round, task.model_version), None)

    def _export_training(self, result: TrainResult) -> None:
        me = self.config.id
        metrics.TRAINING_SECONDS.labels(me).observe(result.seconds)
        if math.isfinite(result.samples_per_second):
            metrics.TRAINED_SAMPLES.labels(me).inc(round(result.samples_per_second * result.seconds))
            metrics.SAMPLES_PER_SECOND.labels(me).set(result.samples_per_second)
        metrics.TRAIN_LOSS.labels(me).set(result.train_loss)
        self._export_privacy()

    def _training_seed(self, task: pb.RoundTask) -> int:
        """Without DP the job's seed makes runs repeatable. With DP the seed also drives the Gaussian noise,
        and anyone who knows it (the coordinator, the data scientist) could regenerate and subtract that
        noise: so a DP worker draws its seed from the operating system, never from the job."""
        if self.dp is not None:
            return int.from_bytes(os.urandom(8), "little") >> 1
        return int(task.seed) * 1000 + task.round

    def check_budget(self, job_id: str, config: TrainingConfig) -> None:
        """Refuse before training if this round's steps would take the owner past its own ε budget."""
        dp = self.dp
        if dp is None:
            return
        n = len(self.y)
        projected = project_epsilon(self.ledger.history(job_id), noise_multiplier=dp.noise_multiplier,
                                    sample_rate=dp_sample_rate(n, config), steps=planned_steps(n, config),
                                    delta=dp.delta)
        others = self.ledger.total_epsilon() - self.ledger.epsilon(job_id)
        if projected + others > dp.epsilon_budget:
            raise BudgetExceeded(
                f"privacy budget exceeded: this round would bring ε to {projected + others:.3f} "
                f"(job {projected:.3f} + other jobs {others:.3f}), above the owner's budget {dp.epsilon_budget:g}"
            )

    def _ish(self, task: pb.RoundTask) -> float | None:
        if not task.population_distribution:
            return None
        return reported_ish(self.histogram, task.population_distribution, participants=task.participants,
                            aggregation=json.loads(task.aggregation_json or "{}"))
