"""Federated evaluation on the coordinator: after every `evaluation.every`-th round (async: version) and the
last, the sites the job names (`evaluation.sites`: the round's participants, or every active site of the
category) are asked to score that round's global version on their own held-out splits.

The next round does not wait for the scores: they are recorded as they arrive, until the job's
round_timeout_s after the tasks went out, and the round's federated score (the count-weighted mean, in
`fedbroker status`, `jobs show`, the metrics) grows with them. Only the end of the job waits, for the last
evaluated round's sites that uploaded in it (`await_last`), so a finished job's final score is in.

A report is input from anyone who can publish to the control queue: it has passed `control.check_control`
(finite, in range) and the sender binding of its worker id; here its count must be at most the held-out
split the worker registered (`Registration.evaluation_samples`), and the store records it only against a task this coordinator sent that worker, for
that round and version, before the deadline (store_evaluation.py). Everything else is refused with a log line
and counted (`fedbroker_coordinator_evaluation_reports_refused_total{reason}`), changing nothing.

Early stopping (`evaluation.patience`) reads the settled rounds' scores: the federated accuracy once the
sites have scored a round, the central one (the coordinator's evaluation set) before or without
(`fedbroker.federated_evaluation.early_stop`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Sequence

from fedbroker.bus import envelope
from fedbroker.coordinator import metrics
from fedbroker.coordinator.control import MAX_REASON_CHARS
from fedbroker.coordinator.job_context import JobContext
from fedbroker.coordinator.job_run import Run
from fedbroker.coordinator.store import StateStore
from fedbroker.coordinator.store_evaluation import EvaluationVerdict
from fedbroker.errors import ConfigError
from fedbroker.federated_evaluation import Scored, due, early_stop
from fedbroker.job.pipeline import DataPipeline
from fedbroker.job.settings import task_message
from fedbroker.job.status import EvaluationStatus, ParticipantStatus, RoundStatus
from fedbroker.job.task import stored_task
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.tasks.scores import sums_problems

log = logging.getLogger(__name__)

SETTLE_MARGIN_S = 1.0   # the end of a job waits this long past the last evaluation's deadline at most

_shown: dict[str, int] = {}   # job → the round its federated gauges show (the latest with a score)
_shown_lock = threading.Lock()


def after_round(ctx: JobContext, run: Run, number: int, version: int, participants: Sequence[str]) -> None:
    """Ask the job's sites to score `version`, the global model round (async: version row) `number` made,
    when `evaluation.every` says so; returns once the tasks are published (never waits for a score)."""
    job, job_id = run.job, run.job_id
    if not due(job.evaluation, number, run.last_round):
        return
    if job.evaluation.sites == "category":
        sites = [w.worker_id for w in ctx.active_workers(job.category)]
    else:
        sites = list(participants)
    sites = sorted(set(sites))
    if not sites:
        return
    deadline = time.time() + job.schedule.round_timeout_s
    ctx.store.ask_evaluation(job_id, number, model_version=version, workers=sites, deadline=deadline, task=job.task,
                             score=job.evaluation.score, threshold=job.evaluation.threshold)
    body = envelope.encode(evaluation_task=pb.EvaluationTask(
        job_id=job_id, round=number, model_version=version, aggregator_target=ctx.aggregator_target,
        category=job.category, deadline_unix=deadline, task=task_message(job.task),
        pipeline_json=job.data.pipeline.to_json() if job.data.pipeline != DataPipeline() else ""))
    sent = ctx.publish_tasks([(w, body) for w in sites], deadline, evaluation=True)
    ctx.store.evaluation_undelivered(job_id, number, [w for w in sites if w not in sent])
    log.info("round %d of %s: version %d sent to %d site(s) to evaluate", number, job_id, version, len(sent))


def accept_report(store: StateStore, r: pb.EvaluationReport) -> EvaluationVerdict | str:
    """Record a checked report (module docstring); what became of it (a refusal is logged and counted)."""
    reason = r.reason[:MAX_REASON_CHARS]
    if not r.refused:
        registered = next((w.evaluation_samples for w in store.workers() if w.worker_id == r.worker_id), None)
        if registered is not None and r.num_samples > registered:  # unknown: not asked (refused below)
            log.warning("evaluation report of worker %s for round %d of %s refused: %d held-out samples, more than "
                        "the %d of the held-out split it registered", r.worker_id, r.round, r.job_id[:140],
                        r.num_samples, registered)
            metrics.EVALUATION_REPORTS_REFUSED.labels("implausible_count").inc()
            return "implausible_count"
        problems = _sums_problems(store, r)
        if problems:
            log.warning("evaluation report of worker %s for round %d of %s refused: its sums are impossible: %s",
                        r.worker_id, r.round, r.job_id[:140], "; ".join(problems))
            metrics.EVALUATION_REPORTS_REFUSED.labels("implausible_sums").inc()
            return "implausible_sums"
    verdict = store.record_evaluation(r.job_id, r.round, r.worker_id, model_version=r.model_version,
                                      refused=r.refused, reason=reason, accuracy=r.accuracy, loss=r.loss,
                                      num_samples=r.num_samples, sums=dict(r.sums))
    if verdict == EvaluationVerdict.RECORDED:
        metrics.EVALUATION_REPORTS.labels(r.worker_id, "refused" if r.refused else "evaluated").inc()
        if not r.refused:
            store.note_site_share(r.job_id, r.worker_id, "evaluation")  # the site's record lists it (SiteRecord)
            _show(store, r.job_id, r.round)
        log.info("worker %s %s round %d of %s%s", r.worker_id, "refused to evaluate" if r.refused else "evaluated",
                 r.round, r.job_id, f": {reason}" if r.refused else f": accuracy {r.accuracy:.4f} on {r.num_samples}")
    elif verdict == EvaluationVerdict.DUPLICATE:
        log.info("a copy of worker %s's evaluation of round %d of %s: already recorded", r.worker_id, r.round, r.job_id)
    else:
        if verdict == EvaluationVerdict.LATE:  # a round past its deadline that nobody settled yet (its job ended)
            store.settle_evaluations(r.job_id)
        metrics.EVALUATION_REPORTS_REFUSED.labels(verdict).inc()
        log.warning("evaluation report for worker %s, round %d (version %d) of job %s refused: %s", r.worker_id,
                    r.round, r.model_version, r.job_id[:140], {
                        EvaluationVerdict.NOT_ASKED: "no such evaluation task was sent to that worker",
                        EvaluationVerdict.WRONG_VERSION: "the round was asked about another global version",
                        EvaluationVerdict.LATE: "it came after the round's evaluation deadline",
                        EvaluationVerdict.CONFLICT: "it differs from the report recorded for that task"}[verdict])
    return verdict


def _sums_problems(store: StateStore, r: pb.EvaluationReport) -> list[str]:
    """What makes a report's sums impossible for its job's task (`fedbroker.tasks.scores.sums_problems`): a site
    that forges consistent sums is not caught here (deploy/SECURITY.md). A job from before tasks, or a report
    without sums (an older worker), is taken as it is."""
    record = store.job(r.job_id)
    if record is None:
        return []  # no such job: refused as not asked by the store
    try:
        task = stored_task(record.spec_json)
    except ConfigError:
        return []
    if not r.sums:
        return [] if task.type == "classification" else [f"a {task.type} job's report must carry its sums"]
    return sums_problems(task, r.sums, r.num_samples)


def _show(store: StateStore, job_id: str, round_number: int) -> None:
    """The job's federated gauges follow its latest scored round."""
    with _shown_lock:
        if _shown.get(job_id, 0) > round_number:
            return
        _shown[job_id] = round_number
    score = next((e.score for e in store.evaluation_rounds(job_id, round_number)), None)
    if score is not None:
        metrics.FEDERATED_ACCURACY.labels(job_id).set(score.accuracy)
        metrics.FEDERATED_LOSS.labels(job_id).set(score.loss)
        metrics.FEDERATED_SITES.labels(job_id).set(score.sites)


def scored_rounds(store: StateStore, job_id: str, *, settled_only: bool) -> list[Scored]:
    """The job's closed rounds with their central accuracy and federated accuracy (None where the sites gave
    none, or, with `settled_only`, where their reports may still change it)."""
    federated = {e.round: e.score.accuracy for e in store.evaluation_rounds(job_id)
                 if e.score is not None and (e.settled or not settled_only)}
    return [Scored(round=r.round, federated=federated.get(r.round), central=r.accuracy)
            for r in store.rounds(job_id) if r.status == RoundStatus.CLOSED]


def stopped_early(ctx: JobContext, run: Run) -> bool:
    """Whether the job ends here by `evaluation.patience` (then recorded as an event); settles the rounds whose
    evaluation deadline passed first."""
    ctx.store.settle_evaluations(run.job_id)
    if run.job.evaluation.patience <= 0:
        return False
    stop = early_stop(scored_rounds(ctx.store, run.job_id, settled_only=True), run.job.evaluation.patience,
                      task=run.job.task, score=run.job.evaluation.score)
    if stop is None:
        return False
    log.info("job %s %s", run.job_id, stop.reason())
    ctx.store.note_event(run.job_id, "stopped_early", stop.reason())
    return True


def await_last(ctx: JobContext, run: Run) -> None:
    """Before the job is recorded complete: wait (until its deadline at most) for the last evaluated round's
    sites whose update that round took, which are alive by that evidence, so the final federated score is in.
    A site asked that did not upload (a straggler, a category site) is not waited for: its report is still
    recorded if it comes before the deadline, and the round settles then."""
    rounds = ctx.store.evaluation_rounds(run.job_id)
    if not rounds or rounds[-1].settled:
        return
    last = rounds[-1]
    alive = {p.worker_id for p in ctx.store.participants(run.job_id, last.round)
             if p.status in (ParticipantStatus.AGGREGATED, ParticipantStatus.UPLOADED)}

    def answered() -> tuple[bool, None]:
        ctx.store.settle_evaluations(run.job_id)
        return not any(e.status == EvaluationStatus.ASKED and e.worker_id in alive
                       for e in ctx.store.evaluations(run.job_id, last.round)), None

    ctx.poll(answered, within_s=max(0.0, last.deadline - time.time()) + SETTLE_MARGIN_S)


def fill_status(store: StateStore, job_id: str, reply: pb.StatusReply) -> None:
    """The job's rounds in `reply` get their federated scores so far (the per-class ones, `auroc/3`, for the latest
    scored round only: a 1000-label job's reply stays small), and `reply` each site's evaluation."""
    scores = {e.round: e.score for e in store.evaluation_rounds(job_id)}
    latest = max((r for r, s in scores.items() if s is not None), default=0)
    for row in reply.rounds:
        score = scores.get(row.round) if row.job_id == job_id else None
        if score is not None:
            row.federated_accuracy, row.federated_loss = score.accuracy, score.loss
            row.federated_metric = score.metric
            row.federated_scores.update({k: v for k, v in score.scores.items()
                                         if math.isfinite(v) and (row.round == latest or "/" not in k)})
            row.federated_samples, row.evaluated_sites = score.num_samples, score.sites
    for e in store.evaluations(job_id):
        reply.evaluations.add(job_id=e.job_id, round=e.round, worker_id=e.worker_id, status=e.status, reason=e.reason,
                              loss=e.loss or 0.0, accuracy=e.accuracy or 0.0, num_samples=e.num_samples or 0,
                              model_version=e.model_version)
