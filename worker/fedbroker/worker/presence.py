"""A worker's presence at the aggregation service: `WorkerPresence.KeepAlive`, paced by the service.

The coordinator hears a worker's heartbeats over RabbitMQ; the aggregation service hears nothing of an idle
worker until its next task, so its operator cannot tell how many workers are there
(`fedbroker_aggregator_workers_present`). This loop beats on a thread of its own, as this worker (its id; its
token rides on the channel), on the channel the worker keeps for its tasks, and waits until the due time the
service answers, never earlier: the service paces every worker under `heartbeat_max_per_s`, and a beat that
comes early is refused (`heartbeat_early`) without counting.

Whatever the service says is clamped into [MIN_WAIT_S, MAX_WAIT_S]: a due time of 0 or below cannot make the
worker hammer it, one of years (or no number at all) cannot silence the worker for good. Failures back off:
the service down or unreachable (UNAVAILABLE, a deadline, a channel closed under the call) with jittered
exponential waits up to BACKOFF.max_s; `heartbeat_early` waits its retry-after (clamped too); a refusal no
retry changes soon (another worker's token, a service without KeepAlive) waits MAX_WAIT_S. A `not_owner`
redirect between replicas is the client's (`Replicas.routed`). The loop shares nothing with training but the
channel (gRPC channels are thread-safe), so a service that is down costs a log line, never a training step,
and `stop` ends it at once: the wait is an Event's, and a call in flight ends when the channel closes.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable
from typing import Protocol

import grpc

from fedbroker.retry import Backoff
from fedbroker.rpc.plumbing import reason_of, retry_after_of
from fedbroker.worker import metrics

log = logging.getLogger(__name__)

MIN_WAIT_S = 1.0     # the least wait between beats, whatever the service answers: never a busy loop
MAX_WAIT_S = 600.0   # the most: a due time of years still leaves a beat every ten minutes
CALL_TIMEOUT_S = 10.0  # a beat is answered from memory; a longer wait is a service in trouble
BACKOFF = Backoff(initial_s=1.0, max_s=60.0)  # the service down or unreachable: 1, 2, 4 … 60 s, jittered
EARLY = "heartbeat_early"  # the service's reason for a beat before its due time (aggregators/presence.py)
# refusals no retry changes soon: beaten as another worker, no valid token, a service without KeepAlive
FINAL = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED,
         grpc.StatusCode.INVALID_ARGUMENT)


class Beating(Protocol):
    """What the loop needs of a client (`AggregatorClient.keep_alive`)."""

    def keep_alive(self, worker_id: str, state: str = "idle", *, timeout_s: float | None = None) -> float:
        """One beat; the seconds until the next is due."""


def clamp_wait(seconds: float | None) -> float:
    """The service's answer as a wait the worker keeps: NaN or none at all waits the longest."""
    if seconds is None or math.isnan(seconds):
        return MAX_WAIT_S
    return min(MAX_WAIT_S, max(MIN_WAIT_S, seconds))


class PresenceLoop:
    """Beats `KeepAlive` as `worker_id` on `channel()` (None: none yet), reporting `state()` (module docstring).
    `wait(seconds)` returns True when the loop must stop (a test's fake clock; by default the stop event's)."""

    def __init__(self, worker_id: str, *, channel: Callable[[], Beating | None], state: Callable[[], str],
                 wait: Callable[[float], bool] | None = None, rng: random.Random | None = None) -> None:
        self.worker_id = worker_id
        self.channel = channel
        self.state = state
        self._stopping = threading.Event()
        self._wait = wait or self._stopping.wait
        self._rng = rng or random.Random()
        self._failures = 0           # failed beats in a row: the backoff's exponent
        self._trouble = ""           # what went wrong last, logged once until it changes or clears
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Beat at once, then when the service says, until `stop`."""
        metrics.presence_started(self.worker_id)
        self._thread = threading.Thread(target=self.run, name=f"presence-{self.worker_id}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the loop; the caller closes the channel, which ends a call in flight, so the join is short."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def run(self) -> None:
        """The thread's loop: beat, wait what the beat says, until stopped."""
        while not self._stopping.is_set():
            if self._wait(self.beat()):
                return

    def beat(self) -> float:
        """One heartbeat; the seconds to wait before the next (never less than the service asked)."""
        client = self.channel()
        if client is None:  # no channel (yet, or the worker is stopping): look again after a backoff
            return self._failed("no_channel", "no channel to the aggregation service")
        try:
            due = client.keep_alive(self.worker_id, self.state(), timeout_s=CALL_TIMEOUT_S)
        except grpc.RpcError as error:
            return self._refused(error)
        except Exception as exc:  # a channel closed or replaced under the call (a task named another service, stop)
            return self._failed(type(exc).__name__, f"{type(exc).__name__}: {exc}")
        metrics.PRESENCE_BEATS.labels(self.worker_id, "accepted").inc()
        if self._trouble:
            log.info("worker %s: heartbeats at the aggregation service accepted again", self.worker_id)
        self._failures, self._trouble = 0, ""
        return clamp_wait(due)

    def _refused(self, error: grpc.RpcError) -> float:
        code, reason = error.code(), reason_of(error)
        retry_after = retry_after_of(error)
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED and reason == EARLY:  # a restart beat before its due time
            metrics.PRESENCE_BEATS.labels(self.worker_id, "early").inc()
            return clamp_wait(retry_after) if retry_after is not None else self._backoff()
        if code in FINAL:
            metrics.PRESENCE_BEATS.labels(self.worker_id, "refused").inc()
            self._note(logging.ERROR, reason, f"refused ({reason}: {error.details()}); next try in {MAX_WAIT_S:g}s")
            return MAX_WAIT_S
        wait = self._failed(reason, f"{reason}: {error.details()}")
        return max(wait, clamp_wait(retry_after)) if retry_after is not None else wait  # presence_full, server_busy

    def _failed(self, kind: str, what: str) -> float:
        metrics.PRESENCE_BEATS.labels(self.worker_id, "failed").inc()
        wait = self._backoff()
        self._note(logging.WARNING, kind, f"not heard ({what}); backing off, next try in {wait:.1f}s")
        return wait

    def _backoff(self) -> float:
        self._failures += 1
        return max(MIN_WAIT_S, BACKOFF.delay(self._failures - 1, rng=self._rng))

    def _note(self, level: int, kind: str, message: str) -> None:
        """Log a trouble once (at `level`), then at DEBUG while it lasts: an outage is one line, not one a beat."""
        log.log(level if kind != self._trouble else logging.DEBUG, "worker %s: heartbeat at the aggregation service %s",
                self.worker_id, message)
        self._trouble = kind
