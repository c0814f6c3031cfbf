"""Workers' paced heartbeats at the aggregation service (`WorkerPresence.KeepAlive`).

Ten thousand workers that each heartbeat every 30 s are 333 calls a second on average, but workers that
start together (a site's fleet after a power cut, everyone after the service restarts) heartbeat together,
and so do they every interval after. The service therefore tells each worker when to come back: its
interval, jittered by ±`jitter`, pushed into the next second that still has room under `max_per_s`. A
herd arriving at once leaves spread over the interval (and, past `interval_s × max_per_s` workers, over
longer), and the service's heartbeat load stays under `max_per_s` however the workers started.

A heartbeat is one unary call on the worker's kept channel, answered on the event loop from memory: no
stream is held open per worker, so holding a worker costs its connection and one table row.

What a dishonest caller can do is bounded: a worker beats only as itself (its token's name, when
authentication is on); one that comes back before its due time is refused (RESOURCE_EXHAUSTED, reason
`heartbeat_early`, with when to come back) without a new slot being taken; the table holds at most
`max_workers` rows, each dropped once its worker has missed `lapse_intervals` heartbeats.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from prometheus_client import Counter, Gauge

from fedbroker.errors import ConfigError
from fedbroker.printable import printable
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc.auth import ROLE_WORKER, Identity
from fedbroker.rpc.plumbing import REASON_KEY, RETRY_AFTER_KEY

HEARTBEATS = Counter("fedbroker_aggregator_heartbeats", "Workers' KeepAlive calls, by outcome",
                     ["outcome"])
WORKERS_PRESENT = Gauge("fedbroker_aggregator_workers_present",
                        "Workers whose last heartbeat has not lapsed")
for _outcome in ("accepted", "early", "forged", "full"):
    HEARTBEATS.labels(_outcome)
EARLY = "heartbeat_early"
MAX_WORKER_ID_CHARS = 256
FULL = "presence_full"


@dataclass(frozen=True)
class HeartbeatPacing:
    """How the service paces heartbeats (config keys `aggregator.heartbeat_interval_s`, `heartbeat_max_per_s`)."""

    interval_s: float = 30.0       # Flower's default heartbeat
    jitter: float = 0.2            # each due time is interval × [1 - jitter, 1 + jitter]
    max_per_s: int = 500           # beats the service schedules in any one second
    early_slack_s: float = 1.0     # a beat this much before its due time still counts (clock skew, latency)
    lapse_intervals: float = 3.0   # a worker missing this many intervals is no longer present
    max_workers: int = 100_000     # rows the presence table holds at most

    def __post_init__(self) -> None:
        for name in ("interval_s", "max_per_s", "lapse_intervals", "max_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"aggregator.heartbeat_{name}", f"must be a number > 0, got {value!r}")
        if not 0 <= self.jitter < 1:
            raise ConfigError("aggregator.heartbeat_jitter", f"must be in [0, 1), got {self.jitter!r}")
        if not 0 <= self.early_slack_s < self.interval_s:
            raise ConfigError("aggregator.heartbeat_early_slack_s",
                              f"must be in [0, interval_s), got {self.early_slack_s!r}")


class Early(Exception):
    """A heartbeat before its worker's due time; `wait_s` until it is due."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(f"too early: come back in {wait_s:.1f}s")
        self.wait_s = wait_s


class Full(Exception):
    """The presence table holds `max_workers` rows already."""


class Pacer:
    """Due times per worker, handed out at most `max_per_s` per second (see the module docstring)."""

    def __init__(self, pacing: HeartbeatPacing | None = None, *, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.pacing = pacing or HeartbeatPacing()
        self.clock = clock
        self.rng = rng or random.Random()
        self._due: dict[str, float] = {}       # worker → when its next beat is due
        self._slots: dict[int, int] = {}       # whole second → beats due in it
        self._lock = threading.Lock()
        self._swept = clock()

    def beat(self, worker_id: str) -> float:
        """Seconds until `worker_id`'s next beat; Early when this one came too soon, Full when no room."""
        p = self.pacing
        with self._lock:
            now = self.clock()
            due = self._due.get(worker_id)
            if due is not None and now < due - p.early_slack_s:
                raise Early(due - now)
            if now - self._swept >= 1.0:
                self._sweep(now)
            if due is None and len(self._due) >= p.max_workers:
                raise Full(f"the service holds {len(self._due)} workers (max_workers)")
            target = now + p.interval_s * (1 + self.rng.uniform(-p.jitter, p.jitter))
            second = int(target)
            while self._slots.get(second, 0) >= p.max_per_s:
                second += 1
            self._slots[second] = self._slots.get(second, 0) + 1
            self._due[worker_id] = max(target, float(second))
            return self._due[worker_id] - now

    def _sweep(self, now: float) -> None:
        """Drop the workers that lapsed and the seconds that passed (under the lock)."""
        lapse = self.pacing.lapse_intervals * self.pacing.interval_s
        for worker in [w for w, due in self._due.items() if now - due > lapse]:
            del self._due[worker]
        for second in [s for s in self._slots if s < now - 1]:
            del self._slots[second]
        self._swept = now
        WORKERS_PRESENT.set(len(self._due))

    def present(self) -> int:
        """Workers whose last heartbeat has not lapsed (as of the last sweep, at most a second old)."""
        with self._lock:
            return len(self._due)


class PresenceServicer(pb_grpc.WorkerPresenceServicer):
    """`KeepAlive`: a worker's heartbeat, answered with when to come back."""

    def __init__(self, pacer: Pacer, identify: Callable[[grpc.ServicerContext], Identity | None] | None) -> None:
        self.pacer = pacer
        self.identify = identify

    def KeepAlive(self, request: pb.KeepAliveRequest, context: grpc.ServicerContext) -> pb.KeepAliveReply:
        """Record the beat; the reply says when the next is due (see the module docstring)."""
        caller = self.identify(context) if self.identify is not None else None
        if not 0 < len(request.worker_id) <= MAX_WORKER_ID_CHARS:  # a row per id: never a megabyte key
            HEARTBEATS.labels("forged").inc()
            _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "bad_request",
                    f"KeepAlive needs a worker_id of 1 to {MAX_WORKER_ID_CHARS} characters, got "
                    f"{len(request.worker_id)}")
        if caller is not None and caller.role == ROLE_WORKER and caller.name != request.worker_id:
            HEARTBEATS.labels("forged").inc()
            _refuse(context, grpc.StatusCode.PERMISSION_DENIED, "permission_denied",
                    f"worker {caller.name!r} may heartbeat only as itself, not as "
                    f"{printable(request.worker_id, limit=100)!r}")
        try:
            wait = self.pacer.beat(request.worker_id)
        except Early as early:
            HEARTBEATS.labels("early").inc()
            _refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, EARLY, str(early), retry_after_s=early.wait_s)
        except Full as full:
            HEARTBEATS.labels("full").inc()
            _refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, FULL, str(full), retry_after_s=5.0)
        HEARTBEATS.labels("accepted").inc()
        return pb.KeepAliveReply(next_in_ms=int(wait * 1000), workers_present=self.pacer.present())


def _refuse(context: grpc.ServicerContext, code: grpc.StatusCode, reason: str, message: str, *,
            retry_after_s: float | None = None) -> None:
    metadata: list[tuple[str, str]] = [(REASON_KEY, reason)]
    if retry_after_s is not None:
        metadata.append((RETRY_AFTER_KEY, f"{retry_after_s * 1000:.1f}"))
    context.set_trailing_metadata(tuple(metadata))
    context.abort(code, message)
