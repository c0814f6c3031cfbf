"""gRPC plumbing shared by both services: one error→status table, message limits, deadlines, retries."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

import grpc

from fedbroker.errors import (
    BudgetExceeded,
    ConfigError,
    Conflict,
    FedbrokerError,
    NotFound,
    Unauthenticated,
    UploadRejected,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# A chunk is 2 MiB; leave room for the envelope. The size limit of a whole model is the service's own.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
REASON_KEY = "fedbroker-reason"  # trailing metadata: the short reason code of a refusal
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
]

_UPLOAD_STATUS = {
    "too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "late": grpc.StatusCode.FAILED_PRECONDITION,
    "round_closed": grpc.StatusCode.FAILED_PRECONDITION,
    "unknown_round": grpc.StatusCode.FAILED_PRECONDITION,
    "unknown_job": grpc.StatusCode.NOT_FOUND,
    "unknown_worker": grpc.StatusCode.PERMISSION_DENIED,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,   # a worker's token, another worker's id
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
}
# Status details travel in HTTP/2 trailers, which peers cap at a few KiB: a longer message (every problem of
# a job with 128 bad layers) would turn a clear INVALID_ARGUMENT into an opaque transport error.
MAX_DETAILS_CHARS = 2000
_STATUS: list[tuple[type[Exception], grpc.StatusCode]] = [
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Conflict, grpc.StatusCode.FAILED_PRECONDITION),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (BudgetExceeded, grpc.StatusCode.FAILED_PRECONDITION),
]


def status_for(exc: FedbrokerError) -> grpc.StatusCode:
    if isinstance(exc, UploadRejected):
        return _UPLOAD_STATUS.get(exc.reason, grpc.StatusCode.INVALID_ARGUMENT)
    for cls, code in _STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def abort(context: grpc.ServicerContext, exc: FedbrokerError) -> NoReturn:
    """End the call with the mapped status; the reason code rides in trailing metadata for clients and metrics."""
    context.set_trailing_metadata(((REASON_KEY, exc.reason),))
    context.abort(status_for(exc), short_details(str(exc)))
    raise AssertionError("unreachable")  # context.abort raises


def short_details(message: str) -> str:
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    return f"{message[:MAX_DETAILS_CHARS]}… ({len(message) - MAX_DETAILS_CHARS} more characters)"


def reason_of(error: grpc.RpcError) -> str:
    for key, value in error.trailing_metadata() or ():
        if key == REASON_KEY:
            return str(value)
    return error.code().name.lower()


class RemoteError(FedbrokerError):
    """A call to another service failed for good; `reason` is the server's reason code."""

    def __init__(self, reason: str, message: str, code: grpc.StatusCode | None = None) -> None:
        self.reason = reason
        self.code = code
        super().__init__(message)


def call_with_retry(fn: Callable[[], T], *, what: str, idempotent: bool, attempts: int = 5,
                    initial_s: float = 0.2, max_s: float = 5.0) -> T:
    """Retry on UNAVAILABLE (and DEADLINE_EXCEEDED when safe to repeat) with jittered exponential backoff."""
    delay = initial_s
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except grpc.RpcError as error:
            code = error.code()
            retryable = code == grpc.StatusCode.UNAVAILABLE or (idempotent and code == grpc.StatusCode.DEADLINE_EXCEEDED)
            if not retryable or attempt == attempts:
                raise RemoteError(reason_of(error), f"{what}: {code.name}: {error.details()}", code) from None
            log.info("%s: %s, retry %d/%d in %.2fs", what, code.name, attempt, attempts - 1, delay)
            time.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(max_s, delay * 2)
    raise AssertionError("unreachable")


def handle(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except FedbrokerError as exc:
        abort(context, exc)


