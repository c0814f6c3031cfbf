"""Terminal tables for `fedbroker status`."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from fedbroker.app.replies import participant_status, round_status
from fedbroker.job.status import REFUSED_OR_FAILED, RoundStatus
from fedbroker.printable import printable

DASH = "-"  # a value that does not exist yet (an open round) or at all (a job without an evaluation set)


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns padded to their widest cell, under a header and a rule: readable in any terminal (a cell is
    `printable`: a site's text cannot move the cursor or break the row)."""
    cells = [[printable(str(c)) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)  # an empty last cell leaves no trailing blanks


def one_line(text: str) -> str:
    """An error in full on one table row (never cut: the end of an error is often its reason)."""
    return " ".join(text.split())


def round_progress(job: Any, rounds: Iterable[Any]) -> str:
    """A job's rounds as `completed/configured`, and the rounds given up on the way. A lost secure round is
    abandoned and opened again under the next number (coordinator/secure_reopen.py), so the job row's
    `rounds_done`, the number of its last closed round, runs past `rounds_total` ("2/1"): each abandoned round
    below it is not a completed one. An abandoned round with a later one was re-opened; the last one abandoned
    was not (a cancelled job's open round). An asynchronous job counts versions the same way."""
    numbers = {r.round: round_status(r) for r in rounds if r.job_id == job.job_id}
    abandoned = sorted(n for n, s in numbers.items() if s is RoundStatus.ABANDONED)
    completed = job.rounds_done - sum(n < job.rounds_done for n in abandoned)
    reopened = sum(n < max(numbers, default=0) for n in abandoned)
    notes = [f"{reopened} abandoned and re-opened"] if reopened else []
    notes += [f"{len(abandoned) - reopened} abandoned"] if len(abandoned) > reopened else []
    return f"{completed}/{job.rounds_total}" + (f" ({', '.join(notes)})" if notes else "")


def evaluated_jobs(status: Any) -> set[str]:
    """Jobs whose spec names an evaluation set: only their closed rounds have an accuracy and a test loss."""
    out = set()
    for j in status.jobs:
        try:
            spec = json.loads(j.spec_json) if j.spec_json else {}
        except ValueError:
            spec = {}
        if (spec.get("evaluation") or {}).get("dataset"):
            out.add(j.job_id)
    return out


def scores(r: Any, evaluated: set[str]) -> list[str]:
    """A round's accuracy, test loss and mean train loss; a dash where there is none (never a false 0.0000)."""
    closed = round_status(r) is RoundStatus.CLOSED
    tested = closed and r.job_id in evaluated
    return [f"{r.accuracy:.4f}" if tested else DASH, f"{r.loss:.4f}" if tested else DASH,
            f"{r.mean_train_loss:.4f}" if closed else DASH]


def site_scores(r: Any) -> list[str]:
    """A round's federated accuracy (the sites' scores on their held-out splits, weighted by count) and how many
    sites it holds; dashes while no site has scored it."""
    if not r.federated_samples:
        return [DASH, DASH]
    metric = "" if r.federated_metric in ("", "accuracy") else f"{r.federated_metric} "
    return [f"{metric}{r.federated_accuracy:.4f}", str(r.evaluated_sites)]


def render(status: Any, *, workers: bool = True, waiting: bool = True) -> str:
    """`fedbroker status`'s tables; `workers=False` leaves out the registry's workers (`jobs show` has its own),
    `waiting=False` why jobs wait (likewise)."""
    asynchronous = {j.job_id for j in status.jobs if j.mode == "async"}
    evaluated = evaluated_jobs(status)
    parts = ["JOBS", table(["job", "status", "mode", "rounds/versions", "error"],
                           [[j.job_id, j.status, j.mode or "sync", round_progress(j, status.rounds), one_line(j.error)]
                            for j in status.jobs])]
    if waiting and any(j.waiting for j in status.jobs):
        parts += ["", "WAITING", table(["job", "why"], [[j.job_id, j.waiting] for j in status.jobs if j.waiting])]
    parts += ["", "ROUNDS", table(
        ["job", "round", "status", "uploaded", "aggregated", "accuracy", "loss", "train loss", "site acc", "sites",
         "seconds"],
        [[r.job_id, r.round, r.status, f"{r.uploaded}/{r.participants}", r.aggregated, *scores(r, evaluated),
          *site_scores(r), f"{r.seconds:.1f}"]
         for r in status.rounds if r.job_id not in asynchronous])]
    if asynchronous:  # asynchronous jobs have no rounds: a row per global version its buffer published
        parts += ["", "VERSIONS (asynchronous jobs)", table(
            ["job", "version", "workers", "mean staleness", "accuracy", "loss", "train loss", "site acc", "sites",
             "seconds"],
            [[r.job_id, r.model_version, r.aggregated, f"{r.mean_staleness:.2f}", *scores(r, evaluated),
              *site_scores(r), f"{r.seconds:.1f}"]
             for r in status.rounds if r.job_id in asynchronous])]
    parts += [] if not workers else ["", "WORKERS", table(
        ["worker", "device", "active", "ε spent", "ε budget", "last seen"],
        [[w.worker_id, w.device, "yes" if w.active else "no", f"{w.epsilon_spent:.3f}",
          f"{w.epsilon_budget:g}" if w.epsilon_budget else "no DP", f"{w.last_seen_seconds_ago:.0f}s ago"]
         for w in status.workers])]
    refused = [p for p in status.participants if participant_status(p) in REFUSED_OR_FAILED]
    if refused:
        parts += ["", "REFUSALS AND FAILURES", table(["job", "round", "worker", "status", "reason"],
                                                     [[p.job_id, p.round, p.worker_id, p.status, p.reason] for p in refused])]
    return "\n".join(parts)
