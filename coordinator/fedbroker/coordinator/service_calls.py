"""The coordinator's calls to the aggregation service, ridden through its outages.

This is the only layer that retries them (the coordinator's client calls once, `without_retries`), so
retries never nest. Every call the coordinator makes is idempotent at the service (a repeated open,
status, close, abandon, download, issue or buffer call gets the same result or a superseding one), so
each is tried again through an outage for up to `outage_s`, and a stopping coordinator ends the wait at
once (`Stopped`: the job stays where it is in the store for the next start).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from fedbroker.coordinator.job_run import Stopped
from fedbroker.errors import Rejection
from fedbroker.retry import Backoff, retry_call
from fedbroker.rpc.plumbing import RemoteError

log = logging.getLogger(__name__)
T = TypeVar("T")

# What an outage of the service looks like from here. CANCELLED too: a call in flight when the service
# stops (a restart) comes back CANCELLED, not UNAVAILABLE, and the coordinator never cancels a call of its
# own (its stop is checked first: `Stopped`), so a CANCELLED one is the channel's failure, safe to repeat.
TRANSIENT = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
# Between tries through an aggregation-service or broker outage.
OUTAGE_BACKOFF = Backoff(initial_s=0.5, max_s=10.0)


def is_transient(exc: Exception) -> bool:
    """A failure that another try may not meet: the service restarting, a lost reply, a broken channel."""
    return isinstance(exc, RemoteError) and exc.code in TRANSIENT


class AggregatorCalls:
    """Calls to the aggregation service, each retried through its outages for up to `outage_s` seconds;
    `stop` set: the coordinator is stopping (waits end at once, a failing call raises `Stopped`)."""

    def __init__(self, *, outage_s: float, stop: threading.Event) -> None:
        self.outage_s = outage_s
        self._stop = stop

    def call(self, job_id: str, what: str, fn: Callable[[], T], *,
             on_lost_job: Callable[[str], None] | None = None) -> T:
        """`fn()`, retried with backoff while the service is unreachable (`TRANSIENT`).

        `on_lost_job(why)`: the service answered that it does not know the job (it restarted without its
        spool); the callback installs the job there again, then the call is repeated once, within the same
        `outage_s`. Without one, that answer is raised like any other `RemoteError`.
        """
        give_up = time.monotonic() + self.outage_s

        def attempt() -> T:
            try:
                return fn()
            except RemoteError as exc:
                if self._stop.is_set():
                    raise Stopped from exc
                raise

        def log_retry(exc: Exception, retry: int, delay: float) -> None:
            log.warning("%s of %s: the aggregation service is unavailable (%s); retrying in %.1fs", what, job_id,
                        exc, delay)

        def retrying() -> T:
            return retry_call(attempt, backoff=OUTAGE_BACKOFF, deadline=give_up, on_retry=log_retry,
                              retryable=is_transient, sleep=self._stop.wait)

        try:
            return retrying()
        except RemoteError as exc:
            if on_lost_job is None or exc.reason != Rejection.UNKNOWN_JOB:
                raise
            on_lost_job(str(exc))
        return retrying()
