"""A site's part in federated evaluation: it scores a job's global model on its own held-out split and reports
(headline score, mean loss, count) and the task's sums (counts, intersections, error sums, probability
histograms: fedbroker.tasks.scores) on the control bus; the coordinator adds the sites' sums and scores them.

The held-out split is the `worker.test_fraction` part of the site's data that it never trains on (the same
stratified split as always). A simulated site (`partition.num_clients` > 1, one bundled set shared out) holds
its own slice of that split, cut with its training share's scheme and seed, so simulated sites never score on
each other's samples.

The task arrives in the worker's task queue like a round task and is settled once (`agent.on_task` has
checked its sender against `worker.coordinator_broker_user` and dispatches it here):

* unreadable (no job, a round or version < 1, no aggregation service): dead-lettered;
* past its deadline: acked, nothing reported (the coordinator no longer counts it);
* the owner's policy says `worker.evaluation: deny`, the site does not serve the category, it holds no
  held-out sample, or the model cannot be fetched or built or does not fit its data: a refused report
  with the reason, acked;
* else scored and reported, then acked; the report is noted in the ledger's log of what left the site.

The model is the version the task names, downloaded from the aggregation service (`DownloadGlobalModel`,
open to every worker identity: deploy/SECURITY.md) and nothing else: a reply of another version is refused.
Scoring is inference only: no gradient, no ε (docs/privacy.md says what a score reveals).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from fedbroker.bus import Bus, BusError, Delivery, envelope
from fedbroker.config import PartitionSection, WorkerConfig
from fedbroker.datasets import Dataset, strata
from fedbroker.errors import ConfigError, ModelOverLimits
from fedbroker.federated_evaluation import check_policy
from fedbroker.job.settings import task_config
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.plumbing import RemoteError
from fedbroker.tasks.losses import evaluation_sums
from fedbroker.tasks.scores import scores
from fedbroker.weights.plan import ModelPlan
from fedbroker.worker import metrics
from fedbroker.worker.global_model import build_global, fit_problem
from fedbroker.worker.ledger import PrivacyLedger
from fedbroker.worker.partition import partition

if TYPE_CHECKING:
    from fedbroker.job.pipeline import DataPipeline

log = logging.getLogger(__name__)


class _Refusal(Exception):
    """Internal: the site will not or cannot score this task; the reason goes into a refused report."""


def held_out_slice(test: Dataset, p: PartitionSection) -> tuple[Any, Any, str]:
    """(x, y, why empty) of this site's held-out samples: the whole split, or, for a simulated site, its slice
    of it by its training share's scheme and seed (with no minimum size: a small split may leave a slice empty).
    Samples on files (`FileSamples`) stay views: nothing is decoded here."""
    if p.num_clients <= 1:
        return test.x, test.y, ""
    try:
        shards = _shards(strata(test), p)
    except ConfigError as exc:
        return test.x[:0], test.y[:0], f"the held-out split of {len(test.y)} samples cannot be shared out ({exc})"
    if not 0 <= p.client_index < len(shards):
        return test.x[:0], test.y[:0], f"partition.client_index {p.client_index} is outside [0, {len(shards)})"
    index = shards[p.client_index]
    return test.x[index], test.y[index], ""


def _shards(labels: np.ndarray, p: PartitionSection) -> list[np.ndarray]:
    """The training call first (same draws as the training share); without a minimum size when that fails."""
    def cut(min_size: int) -> list[np.ndarray]:
        return partition(labels, scheme=p.scheme, num_clients=p.num_clients, seed=p.seed, alpha=p.alpha,
                         classes_per_client=p.classes_per_client, min_size=min_size)

    try:
        return cut(1)
    except ConfigError:
        return cut(0)


class SiteEvaluation:
    """Scores and reports one site's evaluation tasks (module docstring). `aggregator(target)`: the worker's
    channel to the aggregation service; `stopping()`: the worker is stopping (a task then goes back to the queue)."""

    def __init__(self, config: WorkerConfig, *, bus: Bus, ledger: PrivacyLedger, test: Dataset, device: str,
                 aggregator: Callable[[str], AggregatorClient], stopping: Callable[[], bool],
                 plan_of: Callable[[str], ModelPlan | None] = lambda job_id: None,
                 pipeline_of: Callable[[str], DataPipeline | None] = lambda job_id: None) -> None:
        self.config = config
        self._plan_of = plan_of  # a job's model plan, when this site holds its settings (it trained the job)
        self._pipeline_of = pipeline_of  # its data pipeline (prepares every held-out sample; no augmentation)
        self.policy = check_policy(config.evaluation)
        self.bus = bus
        self.ledger = ledger
        self.x, self.y, self.empty_because = held_out_slice(test, config.partition)
        self.num_classes = test.num_classes
        self.labels = test.labels
        self.device = device
        self._aggregator = aggregator
        self._stopping = stopping

    @property
    def num_samples(self) -> int:
        """The held-out samples this site scores on (its score's weight)."""
        return len(self.y)

    def handle(self, delivery: Delivery, task: pb.EvaluationTask) -> None:
        """Settle one evaluation task exactly once (module docstring)."""
        me = self.config.id
        problem = _unreadable(task)
        if problem:
            log.error("worker %s dead-letters an unreadable evaluation task: %s", me, problem)
            metrics.EVALUATIONS.labels(me, "malformed").inc()
            delivery.nack(requeue=False)
            return
        if time.time() > task.deadline_unix:
            log.info("worker %s skips the evaluation of round %d of %s: its deadline passed", me, task.round,
                     task.job_id)
            metrics.EVALUATIONS.labels(me, "late").inc()
            delivery.ack()
            return
        try:
            accuracy, loss, sums = self._score(task)
        except _Refusal as exc:
            self._report(delivery, task, refused=str(exc))
            return
        except Exception as exc:  # anything else: a score this site cannot give now; the round is not held up
            if self._stopping():  # the worker closed its channel under the task: it goes back to the queue
                delivery.nack(requeue=True)
                return
            if time.time() > task.deadline_unix:
                metrics.EVALUATIONS.labels(me, "late").inc()
                delivery.ack()
                return
            log.exception("worker %s could not evaluate round %d of %s", me, task.round, task.job_id)
            self._report(delivery, task, refused=f"could not evaluate: {type(exc).__name__}: {exc}")
            return
        self._report(delivery, task, accuracy=accuracy, loss=loss, sums=sums)

    def _score(self, task: pb.EvaluationTask) -> tuple[float, float, dict[str, float]]:
        """(the task's headline score, mean loss, the task's sums: fedbroker.tasks.scores)."""
        if self.policy == "deny":
            raise _Refusal("the site's policy refuses evaluation (worker.evaluation: deny)")
        if task.category not in self.config.categories:
            raise _Refusal(f"category {task.category!r} is not one this worker serves "
                           f"({list(self.config.categories)})")
        if not self.num_samples:
            raise _Refusal(f"no held-out samples to evaluate on{': ' + self.empty_because if self.empty_because else ''}")
        client = self._aggregator(task.aggregator_target).until(task.deadline_unix)
        try:
            downloaded = client.download(task.job_id, task.model_version)
        except RemoteError as exc:
            raise _Refusal(f"global model version {task.model_version} could not be fetched: {exc}") from None
        version = downloaded[0]
        if version != task.model_version:  # only what the task names is ever scored
            raise _Refusal(f"asked for global model version {task.model_version}, the service sent {version}")
        metrics.RECEIVED_BYTES.labels(self.config.id).inc(sum(a.nbytes for a in downloaded[2].values()))
        plan = self._plan_of(task.job_id)
        if plan is None and any(".lora_" in name for name in downloaded[2]):
            raise _Refusal("the model carries LoRA adapters and this site holds no settings of the job (it has not "
                           "trained it) to apply them")
        try:
            spec, model = build_global(downloaded, plan, limits=self.config.limits)
        except (ValueError, ModelOverLimits) as exc:
            raise _Refusal(str(exc)) from None
        try:
            job_task = task_config(task.task)
        except ConfigError as exc:
            raise _Refusal(f"the task's settings are not valid: {exc}") from None
        problem = fit_problem(spec, self.x, self.num_classes, holder="this site's data", task=job_task,
                              labels=self.labels, pipeline=self._pipeline_of(task.job_id))
        if problem:
            raise _Refusal(problem)
        # Samples on files are decoded a batch at a time and prepared as in training (through the site's cache).
        sums = evaluation_sums(job_task, model, self.x, self.y, device=self.device,
                               pipeline=self._pipeline_of(task.job_id), cache=self.config.data.cache)
        scored = scores(job_task, sums, size=self.num_classes if job_task.type != "regression" else 0)
        headline = scored[job_task.metric]
        return (headline if headline == headline else 0.0), scored["loss"], sums

    def _report(self, delivery: Delivery, task: pb.EvaluationTask, *, refused: str = "", accuracy: float = 0.0,
                loss: float = 0.0, sums: dict[str, float] | None = None) -> None:
        """Publish the report, then ack the task (a report that cannot be sent is logged: the coordinator's
        deadline ends its wait for us)."""
        me = self.config.id
        report = pb.EvaluationReport(job_id=task.job_id, round=task.round, model_version=task.model_version,
                                     worker_id=me, refused=bool(refused), reason=refused)
        if not refused:
            report.accuracy, report.loss, report.num_samples = accuracy, loss, self.num_samples
            report.sums.update(sums or {})
        try:
            self.bus.publish_control(envelope.encode(evaluation_report=report))
        except BusError as exc:
            log.warning("worker %s: the evaluation of round %d of %s was not reported: %s", me, task.round,
                        task.job_id, exc)
        else:
            if not refused:  # a score says something about the data: the site's log of what it shared says so
                try:
                    self.ledger.note_shared(task.job_id, "evaluation")
                except Exception as exc:  # the score is sent; a ledger that cannot be written is the owner's alarm
                    log.error("worker %s: the evaluation of %s could not be noted in its ledger: %s", me,
                              task.job_id, exc)
        if refused:
            log.info("worker %s refuses to evaluate round %d of %s: %s", me, task.round, task.job_id, refused)
        else:
            metric = task_config(task.task).metric
            log.info("worker %s evaluated version %d of %s (round %d): %s %.4f, loss %.4f on %d held-out "
                     "samples", me, task.model_version, task.job_id, task.round, metric, accuracy, loss,
                     self.num_samples)
        metrics.EVALUATIONS.labels(me, "refused" if refused else "evaluated").inc()
        delivery.ack()


def _unreadable(task: pb.EvaluationTask) -> str:
    """What makes a task one no retry can run ("" when none)."""
    problems = [name for name, bad in (("job_id", not task.job_id), ("round", task.round < 1),
                                       ("model_version", task.model_version < 1),
                                       ("aggregator_target", not task.aggregator_target),
                                       ("deadline_unix", not task.deadline_unix)) if bad]
    return f"missing or invalid {', '.join(problems)}" if problems else ""
