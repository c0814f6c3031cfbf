"""gRPC plumbing shared by both services: one error→status table, message limits, deadlines, retries."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import NoReturn, TypeVar, cast

import grpc

from fedbroker.errors import (
    BudgetExceeded,
    ConfigError,
    Conflict,
    FedbrokerError,
    NotFound,
    Rejection,
    Unavailable,
    UploadRejected,
)
from fedbroker.printable import printable
from fedbroker.retry import Backoff, retry_call

log = logging.getLogger(__name__)
T = TypeVar("T")

# A chunk is 2 MiB; leave room for the envelope. The size limit of a whole model is the service's own.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
REASON_KEY = "fedbroker-reason"  # trailing metadata: the short reason code of a refusal
RETRY_AFTER_KEY = "fedbroker-retry-after-ms"  # and, with `server_busy`, when the service expects a free slot
# Keepalive, one list for clients and servers (each side ignores the other's keys), so the two agree: a
# client pings every KEEPALIVE_MS, also while a long unary call (a CloseRound aggregating for minutes) sends
# no data. gRPC servers by default accept a ping without data only every 5 minutes and answer the third
# early one with GOAWAY "too_many_pings", which cut such a close after ~3.5 minutes; ours accept one every
# MIN_PING_INTERVAL_MS (< KEEPALIVE_MS), with or without calls in flight.
KEEPALIVE_MS = 30_000
MIN_PING_INTERVAL_MS = 10_000
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # client side
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # a channel lives as long as its client (a worker keeps one across tasks, the coordinator one for its life):
    # after a peer's outage, gRPC's own reconnect backoff (1 s, growing to 120 s) would leave it down for up to
    # two minutes after the peer is back; capped like our retries (RPC_BACKOFF)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
    # server side
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),  # faster still strikes (flood)
    # A service's port is its own: gRPC's default SO_REUSEPORT lets a second listener (another process of the same
    # user: a service not yet gone after a restore, anything else that drew the port) bind it too, and the kernel
    # then splits new connections between the two, so a worker could be answered by the wrong process for as long
    # as its connection lives. Bound exclusively, a taken port stops the service at start ("could not bind").
    ("grpc.so_reuseport", 0),
]

# Status details travel in HTTP/2 trailers, which peers cap at a few KiB: a longer message (every problem of
# a job with 128 bad layers) would turn a clear INVALID_ARGUMENT into an opaque transport error.
MAX_DETAILS_CHARS = 2000
_STATUS: list[tuple[type[Exception], grpc.StatusCode]] = [
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
    (BudgetExceeded, grpc.StatusCode.FAILED_PRECONDITION),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
]


def status_for(exc: FedbrokerError) -> grpc.StatusCode:
    """The one error→status table of both services; an upload's refusal carries its own status."""
    if isinstance(exc, UploadRejected):
        return grpc.StatusCode[exc.reason.status]
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def abort(context: grpc.ServicerContext, exc: FedbrokerError) -> NoReturn:
    """End the call with the mapped status; the reason code rides in trailing metadata for clients and metrics."""
    # an error may add trailers of its own (a `not_owner` refusal: the owning replica's address)
    context.set_trailing_metadata(((REASON_KEY, exc.reason), *getattr(exc, "trailers", ())))
    context.abort(status_for(exc), short_details(printable(str(exc))))  # it may quote what a caller sent
    raise AssertionError("unreachable")  # context.abort raises


def short_details(message: str) -> str:
    """`message` cut to fit the status trailers (see MAX_DETAILS_CHARS), saying how much was cut."""
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    return f"{message[:MAX_DETAILS_CHARS]}… ({len(message) - MAX_DETAILS_CHARS} more characters)"


def _trailer(error: grpc.RpcError, key: str) -> str | None:
    # The stubs type these as objects with .key/.value; grpc gives (key, value) pairs (namedtuples at most).
    metadata = cast("Iterable[tuple[str, str | bytes]]", error.trailing_metadata() or ())
    return next((str(value) for k, value in metadata if k == key), None)


def reason_of(error: grpc.RpcError) -> str:
    """The server's reason code of a failed call, or its status code's name when the server gave none."""
    return _trailer(error, REASON_KEY) or error.code().name.lower()


def retry_after_of(error: grpc.RpcError) -> float | None:
    """The seconds a `server_busy` refusal asks the caller to wait (RETRY_AFTER_KEY), if it says."""
    try:
        seconds = float(_trailer(error, RETRY_AFTER_KEY) or "nan") / 1000
    except ValueError:
        return None
    return seconds if 0 <= seconds < float("inf") else None


class RemoteError(FedbrokerError):
    """A call to another service failed for good; `reason` is the server's reason code."""

    def __init__(self, reason: str, message: str, code: grpc.StatusCode | None = None) -> None:
        self.reason = reason
        self.code = code
        super().__init__(message)


# The default for a client call: a few quick tries, enough to ride out a restart of the peer's listener. A
# caller whose result has a deadline (a worker's upload: its round's) retries until then instead.
RPC_ATTEMPTS = 5
RPC_BACKOFF = Backoff(initial_s=0.2, max_s=5.0)
# A `server_busy` refusal is not an outage but load shedding: the service was running its `max_streams`
# transfers, and one of them may end within milliseconds (a small model's download takes ~1 ms). Waiting an
# outage's 0.2 s after it made every round of 10 stub workers wait 0.2 s for the two refused; this wait starts
# at the length of a short transfer and grows to the outage's cap for a service busy with large ones.
BUSY_BACKOFF = Backoff(initial_s=0.01, max_s=5.0)


def call_with_retry(fn: Callable[[], T], *, what: str, idempotent: bool, attempts: int = RPC_ATTEMPTS,
                    deadline_unix: float | None = None, backoff: Backoff | None = None,
                    clock: Callable[[], float] = time.time, sleep: Callable[[float], object] = time.sleep) -> T:
    """Retry on UNAVAILABLE (and DEADLINE_EXCEEDED or CANCELLED when safe to repeat) with jittered exponential backoff;
    a failure for good becomes `RemoteError`. `attempts=1` calls once, for a caller that retries itself.

    `deadline_unix` (a `clock()` time, wall clock by default): retry until then, whatever `attempts` says,
    with a last try at the deadline: for as long as the caller can still use the result. UNAVAILABLE
    includes a service whose spool disk is full (reason `spool_full`), so that too is retried."""
    wait = backoff or RPC_BACKOFF

    def backoff_for(error: Exception) -> Backoff:
        if not (isinstance(error, grpc.RpcError) and reason_of(error) == Rejection.SERVER_BUSY):
            return wait
        hint = retry_after_of(error)
        if hint is None:
            return BUSY_BACKOFF
        # the service's estimate of its queue, jittered around it ([0.625, 1.25] × the hint)
        ceiling = min(max(1.25 * hint, 1e-3), BUSY_BACKOFF.max_s)
        return Backoff(initial_s=ceiling, max_s=ceiling)

    def retryable(error: Exception) -> bool:
        if not isinstance(error, grpc.RpcError):
            return False
        code = error.code()
        # CANCELLED without our cancelling: a server stopping past its grace, or (seen with 10,000 connections on
        # one asyncio service, bench/connected.py) a call gRPC itself gave up; safe to repeat when idempotent
        return code == grpc.StatusCode.UNAVAILABLE or (idempotent and code in (grpc.StatusCode.DEADLINE_EXCEEDED,
                                                                               grpc.StatusCode.CANCELLED))

    def log_retry(error: Exception, retry: int, delay: float) -> None:
        code = error.code().name if isinstance(error, grpc.RpcError) else type(error).__name__
        reason = reason_of(error) if isinstance(error, grpc.RpcError) else code
        limit = f"until the deadline, {deadline_unix - clock():.1f}s away" if deadline_unix else f"of {attempts - 1}"
        log.info("%s: %s (%s), retry %d %s in %.2fs", what, code, reason, retry, limit, delay)

    try:
        if deadline_unix:
            return retry_call(fn, backoff=wait, retryable=retryable, deadline=deadline_unix, on_retry=log_retry,
                              clock=clock, sleep=sleep, backoff_for=backoff_for)
        return retry_call(fn, backoff=wait, retryable=retryable, attempts=attempts, on_retry=log_retry, sleep=sleep,
                          backoff_for=backoff_for)
    except grpc.RpcError as error:
        code = error.code()
        raise RemoteError(reason_of(error), f"{what}: {code.name}: {error.details()}", code) from None


def handle(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
    """Run a servicer's work; a `FedbrokerError` ends the call with its mapped status (see `abort`)."""
    try:
        return fn()
    except FedbrokerError as exc:
        abort(context, exc)


