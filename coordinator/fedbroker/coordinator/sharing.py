"""The share phase before a job's round 1: what a job asks its sites for, and nothing a job does not need.

Only a job whose algorithms declare that they read label histograms (`needs_histograms`: DWFed's population
P, PFNM/NAFI's class shares) or that standardises federatedly (`data.standardize: federated`) has one. It
sends a ShareRequest on the tasks queue of each active worker of its category that it could select, waits
until each answered or `schedule.wait_for_workers_s` passed, and goes on with the sites that shared (at least
`schedule.min_workers`, else it fails naming who did not and why). A site that did not share is never
selected for the job. Each reply is checked against what was asked (`receive_reply`) before it is stored.

A site's statistics must be ones its rows could give: sums and sums of squares within [0, count] widened by
the noise's plausible range at the ε and δ it states, never less than the kernel's least ε and δ
(fedbroker.statistics_release), over at most the rows it registered. A reply that is not is recorded
`excluded`, named in the job's events and the coordinator's log, and its site is not selected: one site's
±1e15 sums once set every feature's agreed mean to its bound. The job goes on with the others if enough
shared.

Federated standardisation: the sites send, per flattened input feature, the sum and the sum of squares of
their training values clipped to the job's bounds and rescaled to [0, 1], and their row count. The pooled
mean and variance are rescaled to the features' units and become a `standardize` layer in front of the
job's model, before its initial global model is built: every round, the download and every evaluation
apply it. Noise can make a pooled variance <= 0 (or above 1/4, the most a [0, 1] value can have): it is
held within [MIN_STD_FRACTION², 1/4] of the squared range, and the event of the agreement says which.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence

import numpy as np

from fedbroker.algorithms.catalogue import needs_histograms
from fedbroker.bus import envelope
from fedbroker.coordinator.control import MAX_REASON_CHARS, InvalidControlMessage
from fedbroker.coordinator.job_context import JobContext
from fedbroker.coordinator.job_run import JobFailed
from fedbroker.coordinator.participants import data_fit_problems
from fedbroker.coordinator.records import WorkerRecord
from fedbroker.coordinator.store import StateStore
from fedbroker.coordinator.store_shares import ShareAnswer, SharePhaseRecord, ShareRecord, ShareStatus
from fedbroker.job.spec import JobSpec, ModelSpec, parse_model
from fedbroker.job.spec_data import STANDARDIZE_LAYER
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.statistics_release import release_problems

log = logging.getLogger(__name__)

MIN_SHARE_WAIT_S = 5.0     # the least a share phase waits for replies (wait_for_workers_s may be 0)
# An agreed std is at least this fraction of its feature's range. At a few hundred rows the sites' noise can
# drive a feature's pooled variance to 0 or below; a floor of 1e-3 then scaled that feature up 1000-fold and the
# tabular example's training (no DP clipping to tame it) diverged to NaN. 1/20 of the range bounds the scale-up
# at 20 range-units, and a feature whose real spread is smaller is only left less stretched than unit variance.
MIN_STD_FRACTION = 0.05


def asks(job: JobSpec) -> tuple[bool, bool]:
    """What the job asks its sites for before round 1: (label histograms, feature statistics)."""
    return needs_histograms(job.aggregation), job.data.standardize == "federated"


def agreed_model(ctx: JobContext, job_id: str, job: JobSpec, *, first_round: bool) -> ModelSpec:
    """The model the job starts from: its own, or (standardize federated) the agreed standardize layer in front
    of it. Runs the job's share phase if it has one and it has not ended (a resumed phase goes on, its
    requests sent again); a job that closed rounds before it could share is left as it is."""
    histogram, statistics = asks(job)
    if not (histogram or statistics):
        return job.model
    phase = ctx.store.share_phase(job_id)
    if phase is None:
        if not first_round:
            return job.model
        phase = _open(ctx, job_id, job, histogram=histogram, statistics=statistics)
    elif phase.open:
        phase = _resume(ctx, job_id, job, phase)
    if phase.open:
        _await_replies(ctx, job_id, phase)
        _close(ctx, job_id, job, phase)
        phase = ctx.store.share_phase(job_id) or phase
    return parse_model(json.loads(phase.model_spec_json)) if phase.model_spec_json else job.model


def _open(ctx: JobContext, job_id: str, job: JobSpec, *, histogram: bool, statistics: bool) -> SharePhaseRecord:
    """Record, then send, the job's requests to each active worker of its category it could select."""
    why = ctx.why_unaffordable(job_id, job)
    active = {w.worker_id: w for w in ctx.active_workers(job.category)}
    for worker_id, worker in active.items():
        misfit = data_fit_problems(job.model, [worker], category=job.category, pipeline=job.data.pipeline)
        if misfit and not why.get(worker_id):
            why[worker_id] = "its data does not fit the model: " + "; ".join(f"{e.field} {e.problem}" for e in misfit)
    features = math.prod(job.model.input_shape)
    lower, upper = job.data.feature_bounds(features) if statistics else ([], [])
    deadline = time.time() + max(job.schedule.wait_for_workers_s, MIN_SHARE_WAIT_S)
    asked = sorted(w for w, reason in why.items() if not reason)
    ctx.store.open_share_phase(job_id, histogram=histogram, statistics=statistics, lower=lower, upper=upper,
                               features=features, classes=job.model.num_outputs, deadline=deadline, asked=asked,
                               not_asked={w: reason for w, reason in sorted(why.items()) if reason})
    phase = ctx.store.share_phase(job_id)
    assert phase is not None  # written just above
    _send(ctx, job, phase, asked)
    return phase


def _resume(ctx: JobContext, job_id: str, job: JobSpec, phase: SharePhaseRecord) -> SharePhaseRecord:
    """A phase the coordinator stopped in: its requests go out again to the sites that have not answered (they
    may never have been sent), with a new deadline if the old one passed meanwhile."""
    if time.time() >= phase.deadline:
        ctx.store.move_share_deadline(job_id, time.time() + max(job.schedule.wait_for_workers_s, MIN_SHARE_WAIT_S))
        phase = ctx.store.share_phase(job_id) or phase
    waiting = [s.worker_id for s in ctx.store.shares(job_id) if s.status == ShareStatus.ASKED]
    log.info("resuming the share phase of %s: asking %d site(s) again", job_id, len(waiting))
    _send(ctx, job, phase, waiting)
    return phase


def _send(ctx: JobContext, job: JobSpec, phase: SharePhaseRecord, workers: Sequence[str]) -> None:
    """One ShareRequest per worker, on its tasks queue (as its round tasks are). The bounds go out as the job
    gave them: one value each for a single [lo, hi]."""
    lower, upper = list(phase.lower), list(phase.upper)
    if lower and len(set(zip(lower, upper))) == 1:
        lower, upper = lower[:1], upper[:1]
    body = envelope.encode(share_request=pb.ShareRequest(
        job_id=phase.job_id, category=job.category, histogram=phase.histogram, feature_statistics=phase.statistics,
        lower=lower, upper=upper, deadline_unix=phase.deadline))
    sent = ctx.publish_tasks([(w, body) for w in workers], phase.deadline)
    log.info("job %s asked %d site(s) to share (%s)", phase.job_id, len(sent),
             ", ".join(w for w, on in (("histogram", phase.histogram), ("statistics", phase.statistics)) if on))


def _await_replies(ctx: JobContext, job_id: str, phase: SharePhaseRecord) -> None:
    def answered() -> tuple[bool, None]:
        return not any(s.status == ShareStatus.ASKED for s in ctx.store.shares(job_id)), None

    ctx.poll(answered, within_s=max(0.0, phase.deadline - time.time()))


def _close(ctx: JobContext, job_id: str, job: JobSpec, phase: SharePhaseRecord) -> None:
    """End the phase with the sites that shared: the agreed model (standardize federated) and the events; too
    few sites fail the job, naming each one's part."""
    rows = ctx.store.shares(job_id)
    shared = [s for s in rows if s.status == ShareStatus.SHARED]
    waited = phase.deadline - phase.started
    parts = {s.worker_id: _part(s, waited) for s in rows if s.status != ShareStatus.SHARED}
    events = [("not_shared", w, f"{part}: not selected for this job") for w, part in parts.items()
              if not part.startswith(("not asked", "excluded"))]  # those were told when asked, or excluded
    if len(shared) < job.schedule.min_workers:
        ctx.store.close_share_phase(job_id, model_spec_json="", events=events)
        raise JobFailed(f"only {len(shared)} site(s) shared what the job needs before round 1, schedule.min_workers "
                        f"is {job.schedule.min_workers}" + (" [" + "; ".join(f"{w}: {p}" for w, p in parts.items())
                                                            + "]" if parts else "") + "; no worker trained")
    model_json = ""
    if phase.statistics:
        model, summary = standardized(job.model, phase, shared)
        model_json = model.to_json()
        events.append(("statistics_agreed", "", summary))
    if phase.histogram:
        events.append(("histograms_shared", "", f"{len(shared)} site(s): " + ", ".join(
            f"{s.worker_id} " + (f"noised, ε {s.histogram_epsilon:g}" if s.histogram_noised else "exact")
            for s in shared)))
    ctx.store.close_share_phase(job_id, model_spec_json=model_json, events=events)
    log.info("job %s: %d site(s) shared before round 1", job_id, len(shared))


def _part(share: ShareRecord, waited: float) -> str:
    if share.status == ShareStatus.REFUSED:
        return f"refused ({share.reason or 'no reason given'})"
    if share.status == ShareStatus.EXCLUDED:
        return f"excluded ({share.reason})"
    if share.status in (ShareStatus.ASKED, ShareStatus.SILENT):  # asked: the phase is closing without its reply
        return f"no reply within {waited:.0f}s"
    if share.status == ShareStatus.NOT_ASKED:
        return f"not asked ({share.reason})"
    return str(share.status)


def standardized(model: ModelSpec, phase: SharePhaseRecord, shared: Sequence[ShareRecord]) -> tuple[ModelSpec, str]:
    """`model` with the pooled standardisation in front of it, and a line saying how it was agreed."""
    n = phase.features
    lo = np.resize(np.asarray(phase.lower, dtype=np.float64), n)
    width = np.resize(np.asarray(phase.upper, dtype=np.float64), n) - lo
    rows = sum(s.count for s in shared)
    mean01 = np.sum([s.feature_sum for s in shared], axis=0) / rows
    squares01 = np.sum([s.feature_sq_sum for s in shared], axis=0) / rows
    clipped_mean = np.flatnonzero((mean01 < 0) | (mean01 > 1))
    mean01 = np.clip(mean01, 0.0, 1.0)
    var01 = squares01 - mean01**2
    floored = np.flatnonzero(var01 < MIN_STD_FRACTION**2)
    capped = np.flatnonzero(var01 > 0.25)
    var01 = np.clip(var01, MIN_STD_FRACTION**2, 0.25)
    mean, std = lo + width * mean01, width * np.sqrt(var01)
    layer = {"type": STANDARDIZE_LAYER, "mean": [_short(v) for v in mean], "std": [_short(v) for v in std]}
    spec = parse_model({"input_shape": list(model.input_shape), "layers": [layer, *(x.to_dict() for x in model.layers)]})
    sites = ", ".join(f"{s.worker_id} " + (f"ε {s.statistics_epsilon:g}, δ {s.statistics_delta:g}"
                                           if s.statistics_noised else "exact") for s in shared)
    notes = [f"{len(idx)} feature(s) {what}: {_some(idx)}" for idx, what in (
        (floored, f"with a variance below (std {MIN_STD_FRACTION:g} of the range)² after noise, floored there"),
        (capped, "with a variance above 1/4 of the squared range after noise, capped there"),
        (clipped_mean, "with a mean outside the bounds after noise, clipped to them")) if len(idx)]
    summary = (f"mean and std of {n} feature(s) from {len(shared)} site(s), {rows} row(s): {sites}"
               + ("; " + "; ".join(notes) if notes else ""))
    return spec, summary


def _short(value: float) -> float:
    """A float with float32's precision and float64's range (the spec's JSON stays small)."""
    return float(f"{float(value):.9g}")


def _some(indices: np.ndarray, shown: int = 10) -> str:
    listed = ", ".join(str(int(i)) for i in indices[:shown])
    return f"[{listed}{', …' if len(indices) > shown else ''}]"


# ----- replies, from the control queue's thread -----

def receive_reply(store: StateStore, reply: pb.ShareReply) -> list[str]:
    """Record a site's share reply (already checked on its own: control.check_control, and bound to its sender:
    control.SenderBinding), or raise InvalidControlMessage naming why it is refused: it is then never stored,
    and nothing else changes. Returns why its statistics were excluded ([]: they were not)."""
    worker = next((w for w in store.workers() if w.worker_id == reply.worker_id), None)
    answer = ShareAnswer(
        refused=reply.refused, reason=reply.reason[:MAX_REASON_CHARS], histogram=list(reply.label_histogram),
        histogram_noised=reply.histogram_noised, histogram_epsilon=reply.histogram_epsilon,
        feature_sum=list(reply.feature_sum), feature_sq_sum=list(reply.feature_sq_sum), count=reply.count,
        statistics_noised=reply.statistics_noised, statistics_epsilon=reply.statistics_epsilon,
        statistics_delta=reply.statistics_delta)
    excluded = implausible_statistics(answer)
    problems = store.record_share(reply.job_id, reply.worker_id, answer,
                                  lambda phase: reply_problems(phase, answer, worker), excluded=excluded)
    if problems:
        raise InvalidControlMessage("share_reply", problems)
    if excluded:
        log.warning("worker %s's feature statistics for job %s are excluded (not selected for it): %s",
                    reply.worker_id, reply.job_id, "; ".join(excluded))
    for what, sent in (("histogram", answer.histogram), ("statistics", answer.count)):
        if sent and not answer.refused:  # the site's record lists what it shared with the job (SiteRecord)
            store.note_site_share(reply.job_id, reply.worker_id, what)
    log.info("worker %s %s job %s", reply.worker_id, "refused to share with" if reply.refused else "shared with",
             reply.job_id)
    return excluded


def reply_problems(phase: SharePhaseRecord, answer: ShareAnswer, worker: WorkerRecord | None) -> list[str]:
    """What a reply holds against what its job asked of the site: a histogram only if asked, of at most the
    model's classes, an exact one summing to at most the rows the site registered; statistics only if asked,
    one sum per feature, over at most those rows (whether the sums could be true: `implausible_statistics`)."""
    if worker is None:
        return ["the worker is not registered"]
    if answer.refused:
        return []
    out = []
    if bool(answer.histogram) != phase.histogram:
        out.append("label_histogram: " + ("missing: the job asked for it" if phase.histogram
                                          else "the job did not ask for it"))
    elif len(answer.histogram) > phase.classes:
        out.append(f"label_histogram: {len(answer.histogram)} classes, the job's model outputs {phase.classes}")
    elif not answer.histogram_noised and sum(answer.histogram) > worker.num_samples:
        out.append(f"label_histogram: exact counts summing to {sum(answer.histogram)}, above the "
                   f"{worker.num_samples} samples the site registered")
    if bool(answer.count) != phase.statistics:
        out.append("feature statistics: " + ("missing: the job asked for them" if phase.statistics
                                             else "the job did not ask for them"))
    elif answer.count:
        out += _statistics_problems(phase, answer, worker)
    return out


def _statistics_problems(phase: SharePhaseRecord, answer: ShareAnswer, worker: WorkerRecord) -> list[str]:
    out = []
    if len(answer.feature_sum) != phase.features:
        out.append(f"feature_sum: {len(answer.feature_sum)} values, the job's model takes {phase.features} features")
    if answer.count > worker.num_samples:
        out.append(f"count: {answer.count} rows, above the {worker.num_samples} samples the site registered")
    return out


def implausible_statistics(answer: ShareAnswer) -> list[str]:
    """Why the statistics a reply holds cannot be true (fedbroker.statistics_release); [] when they can, or it
    holds none."""
    if answer.refused or not answer.count:
        return []
    return release_problems(answer.feature_sum, answer.feature_sq_sum, count=answer.count,
                            epsilon=answer.statistics_epsilon, delta=answer.statistics_delta)
