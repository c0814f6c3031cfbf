"""A gRPC server's thread budget: no caller, and no number of silent streams, can take every thread.

A synchronous gRPC server runs each call on one thread of its pool for as long as the call lasts, and a
streaming call lasts as long as its client likes: 20 upload streams that sent nothing held all 16 threads
of the aggregation service, and every other call, health checks included, waited. `CallGuard`, a server
interceptor, budgets the pool (`CallLimits`):

- health checks (`grpc.health.v1.Health`) are never refused, and `health_threads` threads are theirs: every
  other call together holds at most `threads - health_threads`, beyond which a call is refused at once
  with UNAVAILABLE (reason `server_busy`, retried by every client);
- the streams of untrusted callers (workers, or anyone when authentication is off) hold at most
  `max_streams` threads together (beyond: `server_busy`, with a retry-after that queues the refused
  callers up: a herd of workers comes back spread out), so unary control calls and the trusted
  coordinator's transfers always have `threads - health_threads - max_streams`;
- one identity holds at most `max_streams_per_worker` streams; its next one is refused at once with
  RESOURCE_EXHAUSTED (reason `too_many_streams`), reading none of it;
- a stream that waits on its client for `stream_idle_timeout_s` (a request message that does not come, a
  response the client does not take) is ended with DEADLINE_EXCEEDED and its thread freed.

Why a budget in the one server and not a second server on its own port for health: the reserved threads
keep Kubernetes' probes, TLS and network policies on the port they already use, and the same budget also
keeps threads for the coordinator's control calls, which a separate health port would not protect.

Limits are counted when a call starts running on a pool thread, so a call that another interceptor refuses
(authentication) never holds a slot. A limit refusal costs its thread a moment, never a wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from fedbroker.errors import ConfigError, ConfigErrors, Rejection, UploadRejected
from fedbroker.metrics import GRPC_SERVER_CALLS_REFUSED, GRPC_SERVER_STREAMS
from fedbroker.rpc.auth import Identity
from fedbroker.rpc.plumbing import REASON_KEY, RETRY_AFTER_KEY

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
_MIN_TRANSFER_S = 0.002   # before any transfer has ended (and the least a transfer is assumed to take)
_MAX_RETRY_AFTER_S = 5.0  # RPC_BACKOFF's cap: a hint never asks for a longer wait than an outage would

Refused = Callable[[str, str], None]   # (method, reason) → count it


@dataclass(frozen=True)
class CallLimits:
    """How a server's `threads` are shared out (see the module docstring); checked on creation."""

    threads: int = 48
    health_threads: int = 2
    max_streams: int = 32
    max_streams_per_worker: int = 2
    stream_idle_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        problems = self.problems()
        if len(problems) == 1:
            raise problems[0]
        if problems:
            raise ConfigErrors(problems)

    def problems(self, where: str = "aggregator") -> list[ConfigError]:
        """Every invalid limit at once, named under `where` (the config section), for a config that reports all."""
        out: list[ConfigError] = []
        for name in ("threads", "health_threads", "max_streams", "max_streams_per_worker"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                out.append(ConfigError(f"{where}.{name}", f"must be a whole number >= 1, got {value!r}"))
        if out:
            return out
        if self.health_threads + self.max_streams >= self.threads:
            out.append(ConfigError(f"{where}.max_streams", f"health_threads ({self.health_threads}) + max_streams "
                                   f"({self.max_streams}) must be below threads ({self.threads}), so control "
                                   "calls always have a thread"))
        if self.max_streams_per_worker > self.max_streams:
            out.append(ConfigError(f"{where}.max_streams_per_worker",
                                   f"is {self.max_streams_per_worker}, more than max_streams ({self.max_streams})"))
        timeout = self.stream_idle_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            out.append(ConfigError(f"{where}.stream_idle_timeout_s", f"must be a number of seconds > 0, got {timeout!r}"))
        return out


class _Ticket:
    """One running call's hold on the budget; for a stream, when it started waiting on its client."""

    __slots__ = ("context", "cut", "identity", "method", "released", "started", "stream", "waiting_since")

    def __init__(self, method: str, context: grpc.ServicerContext, stream: bool, identity: str | None,
                 started: float) -> None:
        self.method = method
        self.started = started
        self.context = context
        self.stream = stream
        self.identity = identity          # counted against max_streams_per_worker; None = not capped
        self.waiting_since: float | None = None
        self.cut = False                  # ended by the idle watchdog
        self.released = False


class CallGuard(grpc.ServerInterceptor):
    """Enforces `limits` on one server (one guard per server: it counts that server's calls).

    `identify(context)` names the caller (`ServerAuth.identity`; None when authentication is off, which caps
    every stream globally and none per identity). Callers whose role is in `trusted_roles` (the coordinator)
    are exempt from the stream caps, not from the idle timeout. `on_refuse(method, reason)` counts a
    refusal in the service's own metrics too. `clock` is injectable for tests.
    """

    def __init__(self, limits: CallLimits, *, service: str,
                 identify: Callable[[grpc.ServicerContext], Identity | None] | None = None,
                 trusted_roles: frozenset[str] = frozenset(), on_refuse: Refused | None = None,
                 clock: Callable[[], float] = time.monotonic, uncapped: frozenset[str] = frozenset()) -> None:
        """`uncapped`: methods whose streams do not count against the stream caps (the coordinator's one
        long-lived event stream: it would otherwise take a transfer slot from the workers for good)."""
        self.limits = limits
        self.service = service
        self.identify = identify
        self.trusted_roles = trusted_roles
        self.on_refuse = on_refuse
        self.clock = clock
        self.uncapped = uncapped
        self._lock = threading.Condition()
        self._running: set[_Ticket] = set()
        self._watchdog: threading.Thread | None = None
        self._transfer_s = 0.0     # how long a capped stream lasts (moving average): a refusal's retry-after
        self._queue_end = 0.0      # when the last refused caller was told a slot would be free

    # ----- counting -----

    def counts(self) -> tuple[int, int, dict[str, int]]:
        """(calls holding a thread, capped streams among them, capped streams per identity)."""
        with self._lock:
            return self._counts()

    def _counts(self) -> tuple[int, int, dict[str, int]]:
        streams = 0
        per: dict[str, int] = {}
        for t in self._running:
            if t.stream and t.identity != "":
                streams += 1
                if t.identity is not None:
                    per[t.identity] = per.get(t.identity, 0) + 1
        return len(self._running), streams, per

    def _admit(self, method: str, context: grpc.ServicerContext, stream: bool) -> _Ticket:
        """A ticket for this call, or the call ended at once (context.abort raises)."""
        identity = self.identify(context) if stream and self.identify is not None else None
        if not stream or method in self.uncapped or (identity is not None and identity.role in self.trusted_roles):
            key: str | None = ""          # "": not counted against the stream caps
        else:
            key = identity.name if identity is not None else None
        ticket = _Ticket(method, context, stream, key, self.clock())
        lim = self.limits
        with self._lock:
            running, streams, per = self._counts()
            refusal: tuple[grpc.StatusCode, str, str] | None = None
            retry_after = 0.0
            if running >= lim.threads - lim.health_threads:
                refusal = (grpc.StatusCode.UNAVAILABLE, Rejection.SERVER_BUSY,
                           f"the service is busy ({running} calls running); retry later")
            elif key and per.get(key, 0) >= lim.max_streams_per_worker:
                refusal = (grpc.StatusCode.RESOURCE_EXHAUSTED, Rejection.TOO_MANY_STREAMS,
                           f"{key!r} already has {per[key]} streams open, the most one caller may hold "
                           f"(max_streams_per_worker)")
            elif key != "" and stream and streams >= lim.max_streams:
                refusal = (grpc.StatusCode.UNAVAILABLE, Rejection.SERVER_BUSY,
                           f"the service is busy ({streams} transfers running, max_streams); retry later")
            if refusal is None:
                self._running.add(ticket)
                if stream:
                    GRPC_SERVER_STREAMS.labels(self.service).inc()
                    self._start_watchdog()
            if refusal is not None and refusal[1] == Rejection.SERVER_BUSY:
                retry_after = self._retry_after()
        if refusal is not None:
            code, reason, message = refusal
            self._refused(method, reason, message)
            if reason == Rejection.SERVER_BUSY:
                context.set_trailing_metadata(((REASON_KEY, reason), (RETRY_AFTER_KEY, f"{retry_after * 1000:.1f}")))
            else:
                context.set_trailing_metadata(((REASON_KEY, reason),))
            context.abort(code, message)
        context.add_callback(lambda: self._release(ticket))   # also when the call ends while not running
        return ticket

    def _retry_after(self) -> float:
        """Seconds until a refused caller may expect a free slot: refused callers queue up virtually, each
        one slot-turnover (a transfer's length / max_streams) behind the last. Told so, a herd of workers
        that started their transfers together comes back spread out, in about the order it was refused,
        instead of retrying together and being refused again."""
        now = self.clock()
        turnover = max(self._transfer_s, _MIN_TRANSFER_S) / self.limits.max_streams
        self._queue_end = max(now, self._queue_end) + turnover
        return min(self._queue_end - now, _MAX_RETRY_AFTER_S)

    def _release(self, ticket: _Ticket) -> None:
        with self._lock:
            if ticket.released:
                return
            ticket.released = True
            self._running.discard(ticket)
            if ticket.stream:
                GRPC_SERVER_STREAMS.labels(self.service).dec()
                if ticket.identity != "":  # a capped transfer: how long the next refused caller should wait
                    seconds = self.clock() - ticket.started
                    self._transfer_s = seconds if not self._transfer_s else 0.8 * self._transfer_s + 0.2 * seconds
            self._lock.notify_all()

    def _refused(self, method: str, reason: str, message: str, *, tell_service: bool = True) -> None:
        # load shedding is routine under a herd of small transfers (counted in the metric); the rest is not
        level = logging.DEBUG if reason == Rejection.SERVER_BUSY else logging.WARNING
        log.log(level, "%s/%s %s: %s", self.service, method, "refused" if tell_service else "ended", message)
        GRPC_SERVER_CALLS_REFUSED.labels(self.service, method, reason).inc()
        if tell_service and self.on_refuse is not None:
            self.on_refuse(method, reason)

    # ----- the idle watchdog: one thread while any stream runs -----

    def _start_watchdog(self) -> None:
        if self._watchdog is None or not self._watchdog.is_alive():
            self._watchdog = threading.Thread(target=self._watch, name=f"idle-streams-{self.service}", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        timeout = self.limits.stream_idle_timeout_s
        period = min(1.0, timeout / 4)
        while True:
            with self._lock:
                if not any(t.stream for t in self._running):
                    self._watchdog = None
                    return
                now = self.clock()
                stale = [t for t in self._running if t.stream and not t.cut and t.waiting_since is not None
                         and now - t.waiting_since >= timeout]
                for t in stale:
                    t.cut = True
            for t in stale:
                message = (f"{t.method}: the stream waited {timeout:g}s on its client "
                           f"(stream_idle_timeout_s); ended to free its thread")
                # the service counts it itself when its handler reads the UploadRejected of `_requests`
                self._refused(t.method, Rejection.IDLE_STREAM, message, tell_service=False)
                _end_with_status(t.context, grpc.StatusCode.DEADLINE_EXCEEDED, f"{Rejection.IDLE_STREAM}: {message}")
            with self._lock:
                self._lock.wait(period)

    # ----- wrapping the handlers -----

    def _requests(self, ticket: _Ticket, requests: Iterable[Any]) -> Iterator[Any]:
        """The request stream, timed while the server waits on the client for the next message."""
        iterator = iter(requests)
        while True:
            ticket.waiting_since = self.clock()
            try:
                item = next(iterator)
            except (StopIteration, grpc.RpcError) as exc:
                # a cut stream reads as cancelled, or as ended when its pending read completes first
                if ticket.cut:
                    raise UploadRejected(Rejection.IDLE_STREAM, f"no message for "
                                         f"{self.limits.stream_idle_timeout_s:g}s (stream_idle_timeout_s)") from None
                if isinstance(exc, StopIteration):
                    return
                raise
            finally:
                ticket.waiting_since = None
            yield item

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        """Wrap every call but health checks in the budget: counted while it holds its thread."""
        handler = continuation(handler_call_details)
        full = handler_call_details.method
        if handler is None or full.startswith(HEALTH_PREFIX):
            return handler
        method = full.rpartition("/")[2]
        kwargs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary, method), **kwargs)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._stream_in(handler.stream_unary, method), **kwargs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream_out(handler.unary_stream, method, False), **kwargs)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(self._stream_out(handler.stream_stream, method, True),
                                                         **kwargs)
        return handler

    def _unary(self, behaviour: Callable[[Any, grpc.ServicerContext], Any], method: str) -> Callable[..., Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            ticket = self._admit(method, context, stream=False)
            try:
                return behaviour(request, context)
            finally:
                self._release(ticket)

        return run

    def _stream_in(self, behaviour: Callable[[Any, grpc.ServicerContext], Any], method: str) -> Callable[..., Any]:
        def run(requests: Iterable[Any], context: grpc.ServicerContext) -> Any:
            ticket = self._admit(method, context, stream=True)
            try:
                return behaviour(self._requests(ticket, requests), context)
            finally:
                self._release(ticket)

        return run

    def _stream_out(self, behaviour: Callable[[Any, grpc.ServicerContext], Iterable[Any]], method: str,
                    streamed_requests: bool) -> Callable[..., Iterator[Any]]:
        def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            ticket = self._admit(method, context, stream=True)
            try:
                responses = behaviour(self._requests(ticket, request) if streamed_requests else request, context)
                for item in responses:
                    ticket.waiting_since = self.clock()   # gRPC sends it now: the client must take it
                    yield item
                    ticket.waiting_since = None
            finally:
                self._release(ticket)

        return run


def _end_with_status(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> None:
    """End a call from another thread than its handler's, with `code` for the client.

    The public `context.cancel()` ends it as CANCELLED; the call object under it takes a status, so a
    client reads DEADLINE_EXCEEDED (which it may retry) with the reason in the details. Trailing metadata
    cannot ride on a cancellation, so the reason is the details' first word. Either way the handler's
    blocked read or write returns at once and its thread is free.
    """
    end = getattr(context, "end", None)
    if end is not None:   # a call on the asyncio server (fedbroker.rpc.aio_bridge.SyncContext)
        end(code, details)
        return
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        if call is not None:
            call.cancel(code.value[0], details)
            return
    except Exception:  # another grpc release: fall back to the public cancel
        log.debug("cancel with status failed; cancelling", exc_info=True)
    context.cancel()
