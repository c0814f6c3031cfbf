"""The aggregation service's metrics, defined once per process (see `fedbroker.metrics` for why the default
registry). No label names a job or a round: reasons and algorithm names are short fixed sets. The robust rules'
verdicts carry `worker_id`, the workers' own label (`fedbroker.worker.metrics`): workers are few and long-lived
(one per provisioned data owner), and only the participants of a round the coordinator opened are judged."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from prometheus_client import Counter, Gauge, Histogram

import fedbroker.metrics  # noqa: F401  (the shared gRPC and broker metrics belong to every process)
from fedbroker.algorithms.catalogue import AggregationSettings
from fedbroker.close_report import Verdict
from fedbroker.errors import Rejection
from fedbroker.metrics import zeroed

UPLOADS_ACCEPTED = Counter(
    "fedbroker_aggregator_uploads_accepted_total", "Worker updates accepted into an open round.")
UPLOADS_DUPLICATE = Counter(
    "fedbroker_aggregator_uploads_duplicate_total",
    "Uploads of an update that was already accepted (a retry), answered with the first receipt.")
SPOOL_QUARANTINED = zeroed(Counter(
    "fedbroker_aggregator_spool_quarantined_total",
    "Spool records that did not load at start (a truncated job.json, a damaged update file), moved to the "
    "spool's quarantine/ folder; kind: job (the whole job folder) or update (one update file).", ["kind"]),
    "job", "update")
UPLOADS_REJECTED = zeroed(Counter(
    "fedbroker_aggregator_uploads_rejected_total",
    "Uploads refused, by reason code (fedbroker.errors.Rejection: late, wrong_shape, ...).", ["reason"]),
    *Rejection)
LATE_UPLOADS = Counter(
    "fedbroker_aggregator_late_uploads_total",
    "Uploads that arrived after their round's deadline or close (stragglers' updates), never mixed in.")
RECEIVED_BYTES = Counter(
    "fedbroker_aggregator_received_bytes_total", "Tensor bytes received, by RPC (accepted updates, global models).",
    ["rpc"])
SENT_BYTES = Counter(
    "fedbroker_aggregator_sent_bytes_total", "Tensor bytes sent to workers and the coordinator, by RPC.", ["rpc"])
ROUNDS_CLOSED = Counter(
    "fedbroker_aggregator_rounds_closed_total", "Rounds aggregated into a new global version, by algorithms.",
    ["alignment", "weighting", "selection"])
AGGREGATION_SECONDS = Histogram(
    "fedbroker_aggregator_aggregation_seconds",
    "Time to close a round (selection, weighting, alignment), by the algorithms used.",
    ["alignment", "weighting", "selection"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
ALIGNMENT_MATCHED_DISTANCE = Gauge(
    "fedbroker_aggregator_alignment_matched_distance",
    "Total matched distance of the last aligned round (the alignment's cost; lower is a tighter match).",
    ["alignment"])
SELECTION_FITNESS = Gauge(
    "fedbroker_aggregator_selection_fitness", "Fitness of the subset the last selection chose (GA).", ["selection"])
SELECTION_FALLBACKS = Counter(
    "fedbroker_aggregator_selection_fallbacks_total",
    "Selections that fell back to a random choice (e.g. the GA ran out of time).", ["selection"])
SELECTION_SECONDS = Histogram(
    "fedbroker_aggregator_selection_seconds",
    "Seconds per genetic-algorithm call (its fitness evaluations included), by selection; bounded by the "
    "service's selection_time_limit_s.", ["selection"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0),
)
SELECTION_GA_RUNS = Counter(
    "fedbroker_aggregator_selection_ga_runs_total", "Rounds whose subset the genetic algorithm chose.", ["selection"]
)
UPDATES_AGGREGATED = Counter(
    "fedbroker_aggregator_updates_aggregated_total", "Updates that went into a new global version.")
# Asynchronous mode (FedBuff); refused stale updates are uploads_rejected_total{reason="stale"}.
STALENESS = Histogram(
    "fedbroker_aggregator_update_staleness_versions",
    "Staleness τ of accepted asynchronous updates: global versions published since the update's base version.",
    buckets=(0, 1, 2, 3, 4, 5, 6, 8, 10, 15, 20, 50, 100))
BUFFERED = Gauge(
    "fedbroker_aggregator_buffered_updates", "Updates waiting in the asynchronous jobs' buffers (all jobs).")
BUFFER_CAPACITY = Gauge(
    "fedbroker_aggregator_buffer_capacity_updates",
    "The asynchronous jobs' buffer sizes, summed: buffered_updates / this is the buffers' fill.")
VERSIONS = Counter(
    "fedbroker_aggregator_versions_published_total", "Global versions published by asynchronous buffers.")
JOBS_OWNED = Gauge(
    "fedbroker_aggregation_jobs_owned",
    "Jobs this aggregation replica owns (holds the lease job:<id> of): 0 on a replica that serves none (aggregation replicas, ownership.py)")

# Robust aggregation (aggregation.robust): each update a rule judged, and its verdict (fedbroker.algorithms.robust_params).
ROBUST_JUDGED = Counter(
    "fedbroker_aggregator_robust_updates_judged_total",
    "Updates a robust rule judged at a round's close, by rule and worker.", ["robust", "worker_id"])
ROBUST_DISCARDED = Counter(
    "fedbroker_aggregator_robust_updates_discarded_total",
    "Updates a robust rule discarded (kept less than a tenth of the weight the plain mean would give them), by rule "
    "and worker.", ["robust", "worker_id"])
ROBUST_DOWNWEIGHTED = Counter(
    "fedbroker_aggregator_robust_updates_downweighted_total",
    "Updates a robust rule down-weighted (kept a tenth to a half of the weight the plain mean would give them), by "
    "rule and worker.", ["robust", "worker_id"])
_ROBUST_COUNTERS = (ROBUST_JUDGED, ROBUST_DISCARDED, ROBUST_DOWNWEIGHTED)

# Secure rounds (aggregation.secure): counts and times of the protocol only. No series depends on what one worker
# sent: the service never holds a clear update, and the quantisation bound it computes is not exported either.
SECURE_OUTCOMES = ("closed", "too_few_survivors", "failed", "lost", "abandoned")
SECURE_ROUNDS = zeroed(Counter(
    "fedbroker_aggregator_secure_rounds_total",
    "Secure rounds that ended, by outcome: closed (a new global version), too_few_survivors (fewer than the threshold "
    "of workers advertised, shared, uploaded or sent unmask shares in time), failed (another protocol failure, e.g. "
    "every weight 0), lost (the service restarted mid-round) or abandoned (its job failed or was cancelled).", ["outcome"]),
    *SECURE_OUTCOMES)
SECURE_STAGES = ("keys", "shares", "verify", "upload", "unmask")
SECURE_DROPPED = zeroed(Counter(
    "fedbroker_aggregator_secure_workers_dropped_total",
    "Participants of secure rounds that missed a step, by the first step missed: keys (advertised none before the "
    "roster was fixed), shares (on the roster, shared none before the inboxes were fixed), verify (got its inbox, "
    "reported no check of it before the exclusions were fixed), upload (got its inbox, "
    "its masked input is not in the sum: its masks were rebuilt at the close) or unmask (a survivor whose unmask "
    "shares had not come when the sum was unmasked; the sum needs only t per secret, so a slow survivor counts too).",
    ["stage"]), *SECURE_STAGES)
SECURE_UNMASK_SECONDS = zeroed(Histogram(
    "fedbroker_aggregator_secure_unmask_seconds",
    "Seconds a secure round's close spent unmasking, by part: wait (for the survivors' unmask shares) or "
    "reconstruct (rebuilding the secrets and stripping the masks from the sum).", ["part"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)),
    "wait", "reconstruct")
SECURE_CALLS = ("SecAdvertise", "SecRoster", "SecShare", "SecInbox", "SecVerify", "SecSurvivors", "SecUnmask")
SECURE_REFUSALS = zeroed(Counter(
    "fedbroker_aggregator_secure_refusals_total",
    "Secure-protocol calls refused, by call and reason code (fedbroker.errors.Rejection); refused masked uploads "
    "are uploads_rejected_total (reason secure_protocol among others).", ["grpc_method", "reason"]),
    *((call, Rejection.SECURE_PROTOCOL) for call in SECURE_CALLS))

# Which CloseRound stats carry the alignment cost and the GA's fitness (with or without a prefix).
_DISTANCE_KEYS = ("alignment_total_matched_distance", "total_matched_distance")


def algorithm_labels(settings: AggregationSettings) -> dict[str, str]:
    """The algorithm names of a job's installed settings (catalogue names: a short fixed set), its robust rule's
    too."""
    return {"alignment": settings.alignment.name, "weighting": settings.weighting.name,
            "selection": settings.selection.name, "robust": settings.robust.name}


def robust_round_opened(rule: str, participants: Iterable[str]) -> None:
    """Give every participant's verdict series a 0 when its round opens, so the first discard is an increase
    (a series that first appears at 1 hides it from `increase()`, and the alert could not fire)."""
    if rule == "none":
        return
    for worker in participants:
        for counter in _ROBUST_COUNTERS:
            counter.labels(rule, worker)


def record_robust(verdicts: Sequence[Verdict]) -> None:
    """A close's robust verdicts: each judged update counted, and the discarded and down-weighted ones apart."""
    for verdict in verdicts:
        ROBUST_JUDGED.labels(verdict.rule, verdict.worker_id).inc()
        if verdict.judgement in ("discarded", "flagged"):
            ROBUST_DISCARDED.labels(verdict.rule, verdict.worker_id).inc()
        elif verdict.judgement == "down-weighted":
            ROBUST_DOWNWEIGHTED.labels(verdict.rule, verdict.worker_id).inc()


def record_close(algorithms: Mapping[str, str], seconds: float, aggregated: int, stats: Mapping[str, float]) -> None:
    """One closed round: its time by algorithm, and the alignment cost and GA fitness found in its stats."""
    alignment = algorithms.get("alignment", "unknown")
    selection = algorithms.get("selection", "unknown")
    labels = (alignment, algorithms.get("weighting", "unknown"), selection)
    AGGREGATION_SECONDS.labels(*labels).observe(seconds)
    ROUNDS_CLOSED.labels(*labels).inc()
    UPDATES_AGGREGATED.inc(aggregated)
    for key in _DISTANCE_KEYS:
        if key in stats:
            ALIGNMENT_MATCHED_DISTANCE.labels(alignment).set(float(stats[key]))
            break
    if "selection_fitness" in stats:
        SELECTION_FITNESS.labels(selection).set(float(stats["selection_fitness"]))
    if "selection_seconds" in stats:
        SELECTION_SECONDS.labels(selection).observe(float(stats["selection_seconds"]))
    if stats.get("selection_fallback", 0.0) > 0:
        SELECTION_FALLBACKS.labels(selection).inc()
    if stats.get("selection_ga_ran", 0.0) > 0:
        SELECTION_GA_RUNS.labels(selection).inc()


# Refusals of updates that came too late: after their round's deadline, or after it closed early.
_LATE = frozenset({Rejection.LATE, Rejection.ROUND_CLOSED})


def record_rejection(reason: Rejection) -> None:
    """Count one refused upload (and a late one as late)."""
    UPLOADS_REJECTED.labels(reason).inc()
    if reason in _LATE:
        LATE_UPLOADS.inc()


def record_secure_refusal(call: str, reason: Rejection) -> None:
    """Count one refused secure-protocol call (`call`: one of SECURE_CALLS)."""
    SECURE_REFUSALS.labels(call if call in SECURE_CALLS else "other", reason).inc()
