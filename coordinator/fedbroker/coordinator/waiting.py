"""Why a job has not started its next round: too few workers registered, too few that can afford the round.

A job's loop says so each time it looks (`WaitingReasons.note`); `fedbroker status`, `jobs show` and `jobs list`
show the newest reason (JobRow.waiting), and a reason that changed is written once as a `waiting` event (never
one per poll), so `jobs logs` tells the story of a job that waits. The reason is cleared when the round opens.
Kept in memory: a restarted coordinator's loops find the reason again at their first look.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Protocol

log = logging.getLogger(__name__)

MAX_LISTED = 10  # workers named in one reason; the rest are counted


class EventLog(Protocol):
    """Where a changed reason is written (`StateStore.note_event`)."""

    def note_event(self, job_id: str, kind: str, message: str, *, round_number: int = 0) -> None:
        """One line of the job's history."""


class WaitingReasons:
    """Each waiting job's newest reason; set and cleared by the job's own thread, read by Status."""

    def __init__(self, events: EventLog) -> None:
        self._events = events
        self._lock = threading.Lock()
        self._by_job: dict[str, str] = {}

    def note(self, job_id: str, reason: str, *, round_number: int = 0) -> None:
        """The job waits for `reason`; a reason other than the last one is logged and written as an event."""
        with self._lock:
            if self._by_job.get(job_id) == reason:
                return
            self._by_job[job_id] = reason
        log.info("job %s waiting: %s", job_id, reason)
        self._events.note_event(job_id, "waiting", reason, round_number=round_number)

    def clear(self, job_id: str) -> None:
        """The job waits no more (its round opened, or it ended)."""
        with self._lock:
            self._by_job.pop(job_id, None)

    def get(self, job_id: str) -> str:
        """The job's reason ("" when it is not waiting)."""
        with self._lock:
            return self._by_job.get(job_id, "")


def unaffordable(why: Mapping[str, str], *, what: str, category: str, rule: str) -> str:
    """Why `what` (e.g. "round 3") cannot start: how many of the category's active workers can afford it, the
    job's `rule` (e.g. "schedule.min_clients is 2"), and each other worker's reason (`participants.why_unaffordable`)."""
    if not why:
        return f"no active worker of category {category!r} for {what}, {rule}"
    able = sum(not reason for reason in why.values())
    reasons = [f"{w}: {reason}" for w, reason in sorted(why.items()) if reason]
    more = f"; and {len(reasons) - MAX_LISTED} more" if len(reasons) > MAX_LISTED else ""
    listed = f" ({'; '.join(reasons[:MAX_LISTED])}{more})" if reasons else ""
    return f"{able} of {len(why)} active worker(s) of category {category!r} can afford {what}, {rule}{listed}"
