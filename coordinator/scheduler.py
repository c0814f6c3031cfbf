"""The round loop: select → open at the aggregator → publish tasks → wait for quorum or deadline → close.

One thread per running job. The coordinator never touches weights beyond checkpointing and evaluating
the global model the aggregation service returns.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from dataclasses import asdict
from typing import Any, Callable

import numpy as np

from aggregators.client import AggregatorClient
from coordinator import metrics
from coordinator.checkpoints import load_checkpoint, save_checkpoint
from coordinator.state import StateStore
from fedbroker import envelope
from fedbroker.bus import Bus, Delivery
from fedbroker.errors import FedbrokerError
from fedbroker.metrics import BUSES
from fedbroker.spec import JobSpec, job_from_json, parse_model
from proto import fedbroker_pb2 as pb

log = logging.getLogger(__name__)

Evaluator = Callable[[JobSpec, str, dict[str, np.ndarray]], "tuple[float, float] | None"]


class JobFailed(FedbrokerError):
    reason = "job_failed"


class Coordinator:
    def __init__(self, *, bus: Bus, store: StateStore, aggregator: AggregatorClient, aggregator_target: str,
                 checkpoint_dir: str, heartbeat_timeout_s: float = 60.0, poll_interval_s: float = 0.2,
                 evaluator: Evaluator | None = None) -> None:
        self.bus = bus
        self.store = store
        self.aggregator = aggregator
        self.aggregator_target = aggregator_target
        self.checkpoint_dir = checkpoint_dir
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.poll_interval_s = poll_interval_s
        self.evaluator = evaluator
        self._stop = threading.Event()
        self._threads: dict[str, threading.Thread] = {}

    # ----- lifecycle -----

    def start(self) -> None:
        """Consume control messages and resume every job that was running when we last stopped."""
        metrics.REGISTRY_COLLECTOR.bind(self)
        BUSES.watch(self.bus, client="coordinator")
        self.bus.consume_control(self.on_control)
        for row in self.store.jobs(status="running") + self.store.jobs(status="pending"):
            log.info("resuming job %s after round %d", row["job_id"], row["rounds_done"])
            self._launch(row["job_id"])

    def stop(self) -> None:
        self._stop.set()
        for thread in list(self._threads.values()):
            thread.join(timeout=10)
        metrics.REGISTRY_COLLECTOR.unbind(self)
        BUSES.unwatch("coordinator")

    def wait(self, job_id: str, timeout: float | None = None) -> str:
        thread = self._threads.get(job_id)
        if thread is not None:
            thread.join(timeout)
        row = self.store.job(job_id)
        return row["status"] if row else "unknown"

    # ----- intake -----

    def submit(self, job: JobSpec) -> str:
        job_id = f"{job.name[:40]}-{secrets.token_hex(4)}"
        self.store.add_job(job_id, job.name, job.to_json(), job.training.rounds, job.model.to_json())
        self._launch(job_id)
        return job_id

    def on_control(self, delivery: Delivery) -> None:
        try:
            env = envelope.decode(delivery.body, expect=("registration", "heartbeat", "task_outcome"))
        except envelope.MalformedMessage as exc:
            log.warning("dead-lettering a control message: %s", exc)
            delivery.nack(requeue=False)
            return
        kind = env.WhichOneof("message")
        if kind == "registration":
            r = env.registration
            self.store.upsert_worker(
                worker_id=r.worker_id, categories=r.categories, histogram=r.label_histogram,
                dp_enabled=r.dp_enabled, dp={
                    "noise_multiplier": r.dp_policy.noise_multiplier, "max_grad_norm": r.dp_policy.max_grad_norm,
                    "delta": r.dp_policy.delta, "epsilon_budget": r.dp_policy.epsilon_budget,
                },
                epsilon_spent=r.epsilon_spent, device=r.device, num_samples=r.num_samples,
            )
            log.info("worker %s registered (%s, %d samples, categories %s)", r.worker_id, r.device, r.num_samples,
                     list(r.categories))
        elif kind == "heartbeat":
            h = env.heartbeat
            if not self.store.touch_worker(h.worker_id, epsilon_spent=h.epsilon_spent, state=h.state):
                log.warning("heartbeat from unknown worker %r ignored", h.worker_id)
        else:
            o = env.task_outcome
            status = pb.TaskOutcome.Status.Name(o.status).lower()
            metrics.TASK_OUTCOMES.labels(status).inc()
            if not self.store.record_outcome(o.job_id, o.round, o.worker_id, status, o.reason):
                log.warning("outcome from %r for unknown task (%s, round %d) ignored", o.worker_id, o.job_id, o.round)
            else:
                log.info("worker %s %s round %d of %s: %s", o.worker_id, status, o.round, o.job_id, o.reason)
        delivery.ack()

    # ----- the round loop -----

    def _launch(self, job_id: str) -> None:
        thread = threading.Thread(target=self._run_job, args=(job_id,), name=f"job-{job_id}", daemon=True)
        self._threads[job_id] = thread
        thread.start()

    def _run_job(self, job_id: str) -> None:
        try:
            self._drive(job_id)
        except Exception as exc:  # a job's failure must be recorded, never lost in a thread
            log.exception("job %s failed", job_id)
            self.store.set_job_status(job_id, "failed", str(exc))

    def _drive(self, job_id: str) -> None:
        row = self.store.job(job_id)
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
        self.aggregator.put_global(job_id, version, spec_json, tensors)
        for round_number in range(done + 1, job.training.rounds + 1):
            if self._stop.is_set():
                return
            try:
                spec_json, version = self._round(job_id, job, round_number, spec_json)
            except Exception:
                metrics.ROUNDS_FAILED.labels(job_id).inc()
                metrics.ROUND_OPEN.labels(job_id).set(0)
                raise
        self.store.set_job_status(job_id, "completed")

    def _await_workers(self, job: JobSpec) -> None:
        deadline = time.time() + job.schedule.wait_for_workers_s
        while True:
            active = self.store.workers(job.category, seen_within_s=self.heartbeat_timeout_s)
            if len(active) >= job.schedule.min_workers:
                return
            if time.time() >= deadline or self._stop.is_set():
                raise JobFailed(
                    f"only {len(active)} active worker(s) of category {job.category!r} registered within "
                    f"{job.schedule.wait_for_workers_s:g}s; schedule.min_workers is {job.schedule.min_workers}"
                )
            time.sleep(self.poll_interval_s)

    def _select(self, job: JobSpec, round_number: int) -> list[str]:
        active = [w.worker_id for w in self.store.workers(job.category, seen_within_s=self.heartbeat_timeout_s)]
        k = job.schedule.clients_per_round
        if k and k < len(active):
            rng = np.random.default_rng([job.seed, round_number, 1])
            active = sorted(rng.choice(active, size=k, replace=False).tolist())
        return active

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

    def _round(self, job_id: str, job: JobSpec, round_number: int, spec_json: str) -> tuple[str, int]:
        started = time.time()
        participants = self._select(job, round_number)
        if len(participants) < job.schedule.min_clients:
            raise JobFailed(f"round {round_number}: {len(participants)} active worker(s), "
                            f"schedule.min_clients is {job.schedule.min_clients}")
        deadline = started + job.schedule.round_timeout_s
        aggregation = asdict(job.aggregation)
        histograms = {w.worker_id: w.histogram for w in self.store.workers(job.category) if w.worker_id in participants}
        version = self.aggregator.open_round(job_id, round_number, participants, deadline, aggregation, seed=job.seed,
                                             histograms=histograms)
        self.store.open_round(job_id, round_number, participants)
        metrics.ROUNDS_STARTED.labels(job_id).inc()
        metrics.ROUND.labels(job_id).set(round_number)
        metrics.ROUND_OPEN.labels(job_id).set(1)
        metrics.ROUND_DEADLINE.labels(job_id).set(deadline)
        metrics.ROUND_PARTICIPANTS.labels(job_id).set(len(participants))
        task = pb.RoundTask(
            job_id=job_id, round=round_number, model_spec_json=spec_json,
            training_json=json.dumps(asdict(job.training)), category=job.category, model_version=version,
            aggregator_target=self.aggregator_target, deadline_unix=deadline,
            population_distribution=self._population(job), participants=len(participants),
            seed=job.seed, aggregation_json=json.dumps(aggregation),
        )
        for worker_id in participants:
            self.bus.publish_task(worker_id, envelope.encode(round_task=task))
            metrics.TASKS_PUBLISHED.inc()
        log.info("round %d of %s published to %d worker(s)", round_number, job_id, len(participants))
        accepted = self._wait_for_quorum(job_id, job, round_number, participants, deadline)
        answered = {p["worker_id"] for p in self.store.participants(job_id, round_number)
                    if p["status"] in ("refused", "failed")}
        stragglers = len(set(participants) - set(accepted) - answered)
        if stragglers:
            metrics.STRAGGLERS.labels(job_id).inc(stragglers)
        if len(accepted) < job.schedule.min_clients:
            self.store.fail_round(job_id, round_number, time.time() - started)
            reasons = "; ".join(
                f"{p['worker_id']}: {p['status']}{' (' + p['reason'] + ')' if p['reason'] else ''}"
                for p in self.store.participants(job_id, round_number)
            )
            raise JobFailed(f"round {round_number}: {len(accepted)} upload(s), schedule.min_clients is "
                            f"{job.schedule.min_clients} [{reasons}]")
        reply = self.aggregator.close_round(job_id, round_number)
        new_version, new_spec_json, tensors = self.aggregator.download(job_id, reply.model_version)
        checkpoint = save_checkpoint(self.checkpoint_dir, job_id, round_number, tensors, new_spec_json)
        scores = self.evaluator(job, new_spec_json, tensors) if self.evaluator else None
        accuracy, loss = scores if scores else (None, None)
        seconds = time.time() - started
        self.store.close_round(
            job_id, round_number, model_version=new_version, aggregated=list(reply.aggregated),
            updates=[(u.worker_id, u.num_samples, u.epsilon, u.train_loss) for u in reply.updates],
            accuracy=accuracy, loss=loss, seconds=seconds, checkpoint=checkpoint, stats=dict(reply.stats),
            model_spec_json=new_spec_json,
        )
        metrics.ROUNDS_COMPLETED.labels(job_id).inc()
        metrics.ROUND_DURATION.observe(seconds)
        metrics.ROUND_OPEN.labels(job_id).set(0)
        metrics.ROUND_AGGREGATED.labels(job_id).set(len(reply.aggregated))
        if accuracy is not None and loss is not None:
            metrics.MODEL_ACCURACY.labels(job_id).set(accuracy)
            metrics.MODEL_LOSS.labels(job_id).set(loss)
        self.bus.publish_event(envelope.encode(round_completed=pb.RoundCompleted(
            job_id=job_id, round=round_number, model_version=new_version, aggregated=len(reply.aggregated),
            accuracy=accuracy or 0.0, loss=loss or 0.0, final=round_number == job.training.rounds, seconds=seconds,
        )))
        log.info("round %d of %s closed: %d aggregated, accuracy %s, %.1fs", round_number, job_id,
                 len(reply.aggregated), f"{accuracy:.4f}" if accuracy is not None else "n/a", seconds)
        parse_model(json.loads(new_spec_json))
        return new_spec_json, new_version

    def _wait_for_quorum(self, job_id: str, job: JobSpec, round_number: int, participants: list[str],
                         deadline: float) -> list[str]:
        quorum = job.schedule.quorum or len(participants)
        accepted: list[str] = []
        while not self._stop.is_set():
            accepted, _ = self.aggregator.status(job_id, round_number)
            self.store.set_uploaded(job_id, round_number, accepted)
            if len(accepted) >= quorum:
                break
            answered = {p["worker_id"] for p in self.store.participants(job_id, round_number)
                        if p["status"] in ("refused", "failed")}
            if len(set(accepted) | answered) >= len(participants) or time.time() >= deadline:
                break
            time.sleep(self.poll_interval_s)
        return accepted
