"""Metrics plumbing shared by every process: the /metrics exporter, the gRPC server interceptor and the
broker-connection collector. Each service defines its own metrics in its own module (`aggregators/metrics.py`,
`coordinator/metrics.py`, `worker/metrics.py`).

Registry: every metric lives in prometheus_client's default registry, created once at module import.
A process exports one registry on one port, and the in-process demo (coordinator and several workers in
one process) must not register a metric twice: module-level objects are created exactly once per
process however many `WorkerAgent`s start, and per-worker series are told apart by a `worker_id` label.
A registry passed around would have to reach every call site (servicer, round loop, agent) and still be
shared by agents of one process; the default one gives the same with no plumbing, and the exporter also
serves the process/platform collectors (CPU, memory, open fds) for free.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, TypeVar
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Metric,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fedbroker.errors import ConfigError

# `x_created` series double the series count for nothing the dashboards use.
disable_created_metrics()  # type: ignore[no-untyped-call]

_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)


def zeroed(metric: _Metric, *series: str | tuple[str, ...]) -> _Metric:
    """`metric`, with the series of each label value (or tuple of values) created at 0 now: a series that first
    appears at 1 hides its first increase from `increase()` and `rate()`, so an alert on it could never fire."""
    for labels in series:
        metric.labels(*(labels if isinstance(labels, tuple) else (labels,)))
    return metric

# RPCs are short control calls (ms) or model transfers (seconds to minutes): cover both.
RPC_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

GRPC_SERVER_HANDLING_SECONDS = Histogram(
    "fedbroker_grpc_server_handling_seconds",
    "Time a gRPC server spent on a call, from its start to its status, by method and status code.",
    ["grpc_service", "grpc_method", "grpc_code"],
    buckets=RPC_BUCKETS,
)

GRPC_SERVER_AUTH_FAILURES = Counter(
    "fedbroker_grpc_server_auth_failures_total",
    "Calls a gRPC server refused before running them: no or an unknown bearer token (unauthenticated), or a "
    "role that may not call the method, or a client certificate naming another identity than the token "
    "(permission_denied).",
    ["grpc_service", "grpc_method", "reason"],
)

AUTH_FILE_RELOADS = Counter(
    "fedbroker_auth_file_reloads_total",
    "Changes a service saw in a file its authentication rests on (kind: tokens, crl, tls; senders: the "
    "coordinator's worker_broker_users in its config file): loaded, or "
    "refused (invalid, unsigned, a key that does not match, or gone: the last good one stays in force).",
    ["kind", "outcome"],
)

GRPC_SERVER_CALLS_REFUSED = Counter(
    "fedbroker_grpc_server_calls_refused_total",
    "Calls a gRPC server's thread budget refused or ended (fedbroker.rpc.callguard): server_busy, too_many_streams "
    "(one caller's streams), idle_stream (a stream that waited on its client past stream_idle_timeout_s).",
    ["grpc_service", "grpc_method", "reason"],
)

GRPC_SERVER_STREAMS = Gauge(
    "fedbroker_grpc_server_streams",
    "Streaming calls (model uploads and downloads) holding a thread of a gRPC server now.",
    ["grpc_service"],
)

_exporters: dict[tuple[str, int], WSGIServer] = {}
_exporters_lock = threading.Lock()


def start_exporter(port: int, *, addr: str = "0.0.0.0") -> int:
    """Serve the default registry on http://addr:port/metrics; 0 disables it and returns 0.

    Idempotent per (addr, port) within a process, so the in-process demo can hand the same port to the
    coordinator and to every worker. Returns the bound port. `addr` is each process's `metrics_addr`
    setting: 0.0.0.0 (the default, for a container scraped over its pod IP) or 127.0.0.1 on a shared host,
    where anyone on the network could otherwise read job ids, worker ids and ε. An address that cannot be
    bound is a ConfigError naming it.
    """
    if port == 0:
        return 0
    with _exporters_lock:
        if (addr, port) not in _exporters:
            try:
                server, _thread = start_http_server(port, addr=addr)
            except OSError as exc:  # an unknown host name, an address not on this machine, a port taken
                raise ConfigError("metrics_addr", f"cannot serve /metrics on {addr}:{port}: {exc}") from None
            _exporters[(addr, port)] = server
        return port


def start_ephemeral_exporter(*, addr: str = "127.0.0.1") -> tuple[int, Callable[[], None]]:
    """Serve the default registry on a free port chosen by the kernel (tests); returns (port, stop)."""
    server, thread = start_http_server(0, addr=addr)
    port = int(server.server_port)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

    return port, stop


# ----- gRPC -----------------------------------------------------------------------------------------


class GrpcMetricsInterceptor(grpc.ServerInterceptor):
    """Times every call of a server into `fedbroker_grpc_server_handling_seconds{service, method, code}`.

    The code is the one the servicer set (`context.abort` in `fedbroker.rpc.plumbing.handle`), OK when it set
    none and returned, CANCELLED when the client went away, UNKNOWN when it raised something else. Streaming responses are timed until the
    last message was produced.
    """

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        """The same handler, its behaviour timed (see the class)."""
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        service, _, method = handler_call_details.method.lstrip("/").rpartition("/")
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _timed(handler.unary_unary, service, method),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _timed(handler.stream_unary, service, method),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _timed_stream(handler.unary_stream, service, method),
                request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.stream_stream is None:
            return handler
        return grpc.stream_stream_rpc_method_handler(
            _timed_stream(handler.stream_stream, service, method),
            request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def _code(context: grpc.ServicerContext, failed: bool) -> str:
    try:
        code = context.code()  # type: ignore[attr-defined]
    except Exception:  # an older or foreign context without code()
        code = None
    if code is not None:
        return str(code.name)
    if not failed:
        return "OK"
    try:
        return "UNKNOWN" if context.is_active() else "CANCELLED"  # a client that went away mid-stream
    except Exception:
        return "UNKNOWN"


def _timed(behaviour: Callable[[Any, grpc.ServicerContext], Any], service: str, method: str) -> Callable[..., Any]:
    def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
        started = time.perf_counter()
        failed = True
        try:
            response = behaviour(request, context)
            failed = False
            return response
        finally:
            GRPC_SERVER_HANDLING_SECONDS.labels(service, method, _code(context, failed)).observe(
                time.perf_counter() - started)

    return wrapper


def _timed_stream(behaviour: Callable[[Any, grpc.ServicerContext], Iterable[Any]], service: str,
                  method: str) -> Callable[..., Iterator[Any]]:
    def wrapper(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        started = time.perf_counter()
        failed = True
        try:
            yield from behaviour(request, context)
            failed = False
        finally:
            GRPC_SERVER_HANDLING_SECONDS.labels(service, method, _code(context, failed)).observe(
                time.perf_counter() - started)

    return wrapper


# ----- the broker -----------------------------------------------------------------------------------


class WatchedBus(Protocol):
    """What the collector reads of a bus (both bus implementations have it)."""

    @property
    def reconnects(self) -> int:
        """Connections re-established after a loss, exported as a counter."""

    def wait_ready(self, timeout: float) -> bool:
        """Called with 0: whether the bus is consuming now, exported as a gauge."""


class BusCollector(Collector):
    """Reads each watched bus at scrape time: its `reconnects` count and whether it is consuming.

    `client` is "coordinator" or the worker id: a handful of long-lived series. A bus is held weakly and
    forgotten by `unwatch`, so a stopped component stops reporting instead of reporting "disconnected".
    """

    def __init__(self) -> None:
        self._buses: dict[str, weakref.ref[WatchedBus]] = {}
        self._lock = threading.Lock()

    def watch(self, bus: WatchedBus, *, client: str) -> None:
        """Report `bus` under `client` from the next scrape on (a new bus of the same client replaces it)."""
        with self._lock:
            self._buses[client] = weakref.ref(bus)

    def unwatch(self, client: str) -> None:
        """Stop reporting `client`, whose bus was closed on purpose."""
        with self._lock:
            self._buses.pop(client, None)

    def describe(self) -> Iterable[Metric]:
        """The families without samples, so registering reads no bus."""
        return self._families()

    def collect(self) -> Iterable[Metric]:
        """The families with one sample per watched bus, read now."""
        return self._families(sample=True)

    def _families(self, sample: bool = False) -> list[Metric]:
        reconnects = CounterMetricFamily(
            "fedbroker_broker_reconnects", "Broker connections re-established after a loss.", labels=["client"])
        connected = GaugeMetricFamily(
            "fedbroker_broker_connected", "1 while this client's broker consumers are consuming, else 0.",
            labels=["client"])
        if sample:
            with self._lock:
                buses = [(client, ref()) for client, ref in self._buses.items()]
            for client, bus in buses:
                if bus is None:
                    continue
                reconnects.add_metric([client], float(bus.reconnects))
                try:
                    ready = bool(bus.wait_ready(0))
                except Exception:  # a closed bus raises: it is not connected
                    ready = False
                connected.add_metric([client], 1.0 if ready else 0.0)
        return [reconnects, connected]


BUSES = BusCollector()
REGISTRY.register(BUSES)


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("", "_count", "_sum"), "gauge": ("",), "info": ("_info",),
             "stateset": ("",), "enum": ("",), "unknown": ("",), "gaugehistogram": ("_bucket", "_gcount", "_gsum")}


def exported_names(registry: CollectorRegistry = REGISTRY) -> set[str]:
    """Every sample name the registry exports, suffixes included (`x_total`, `x_bucket`, `x_count`, ...),
    whether or not a labelled metric has a series yet: what a dashboard or alert rule may refer to."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
    return names
