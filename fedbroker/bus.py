"""Message bus for control messages (tasks, worker reports, round events); weights never ride on it.

Two implementations share one interface (`Bus`) and one behaviour:

* `AmqpBus` talks to RabbitMQ with durable topology, persistent messages, publisher confirms, manual
  acks, prefetch 1, dead-lettering of poison messages and reconnection with jittered backoff;
* `InProcessBus` does the same inside one process (the embedded demo needs no broker).

`open_bus(url)` picks one from the URL. Bodies are opaque bytes (serialized envelopes built elsewhere).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import random
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar, Literal, Protocol
from urllib.parse import parse_qs, urlsplit, urlunsplit

from fedbroker.errors import BusError, ConfigError

log = logging.getLogger(__name__)

# Header carrying how many earlier deliveries of this message failed (classic queues have no counter).
ATTEMPTS_HEADER = "x-fedbroker-attempts"
# Header keeping the routing key the publisher chose, since a retried copy is re-routed by queue name.
ROUTING_KEY_HEADER = "x-fedbroker-routing-key"
CONTROL_ROUTING_KEY = "coordinator"
CONTENT_TYPE = "application/octet-stream"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")

Action = Literal["ack", "requeue", "dead"]


def _check_name(field: str, value: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ConfigError(
            field,
            f"must be 1-128 characters of letters, digits, '_', '.', ':' or '-' "
            f"starting with a letter or digit, got {value!r}",
        )
    return value


@dataclass(frozen=True)
class Topology:
    """Every broker name the bus uses, all prefixed by the namespace so deployments never collide."""

    namespace: str

    @property
    def tasks_exchange(self) -> str:
        return f"{self.namespace}.tasks"

    @property
    def control_exchange(self) -> str:
        return f"{self.namespace}.control"

    @property
    def events_exchange(self) -> str:
        return f"{self.namespace}.events"

    @property
    def dead_letter_exchange(self) -> str:
        return f"{self.namespace}.dlx"

    @property
    def coordinator_queue(self) -> str:
        return f"{self.namespace}.coordinator"

    @property
    def dead_queue(self) -> str:
        return f"{self.namespace}.dead"

    def worker_queue(self, worker_id: str) -> str:
        return f"{self.namespace}.worker.{worker_id}"


class Delivery:
    """One delivered message, handed to a handler; settle it exactly once with `ack` or `nack`.

    `ack`/`nack` may be called from any thread, long after the handler returned (training runs in
    its own thread). The first settlement wins; later ones are ignored with a warning, so a
    `finally: delivery.nack(...)` safety net cannot undo an ack.
    """

    __slots__ = ("_lock", "_settle", "_settled", "attempts", "body", "message_id", "redelivered", "routing_key")

    def __init__(
        self,
        *,
        body: bytes,
        routing_key: str,
        redelivered: bool,
        attempts: int,
        message_id: str | None,
        settle: Callable[[Action], None],
    ) -> None:
        self.body = body
        self.routing_key = routing_key
        self.redelivered = redelivered  # True when this message was delivered before: handle idempotently
        self.attempts = attempts  # 1 on the first delivery
        self.message_id = message_id  # stable across redeliveries: a key for idempotent handling
        self._settle = settle
        self._lock = threading.Lock()
        self._settled: Action | None = None

    @property
    def settled(self) -> bool:
        return self._settled is not None

    def ack(self) -> None:
        """The work is done and its result is durable: the broker may forget the message."""
        self._finish("ack")

    def nack(self, *, requeue: bool) -> None:
        """Give the message back: `requeue=True` retries it (counted), `False` dead-letters it now."""
        self._finish("requeue" if requeue else "dead")

    def _finish(self, action: Action) -> None:
        with self._lock:
            if self._settled is not None:
                log.warning("message %s already settled (%s); ignoring %s", self.message_id, self._settled, action)
                return
            self._settled = action
        self._settle(action)

    def __repr__(self) -> str:
        return (
            f"Delivery(routing_key={self.routing_key!r}, attempts={self.attempts}, "
            f"redelivered={self.redelivered}, message_id={self.message_id!r}, {len(self.body)} bytes)"
        )


Handler = Callable[[Delivery], None]


class Bus(Protocol):
    @property
    def reconnects(self) -> int: ...

    def publish_task(self, worker_id: str, body: bytes) -> None: ...
    def publish_control(self, body: bytes) -> None: ...
    def publish_event(self, body: bytes) -> None: ...
    def consume_tasks(self, worker_id: str, handler: Handler) -> None: ...
    def consume_control(self, handler: Handler) -> None: ...
    def consume_events(self, handler: Handler) -> None: ...
    def declare_worker(self, worker_id: str) -> None: ...
    def start(self) -> None: ...
    def wait_ready(self, timeout: float) -> bool: ...
    def close(self) -> None: ...


_AMQP_ONLY_OPTIONS = {
    "reconnect_initial_s",
    "reconnect_max_s",
    "publish_timeout_s",
    "heartbeat_s",
    "client_name",
    "settle_timeout_s",
    "ca_file",
    "cert_file",
    "key_file",
}


def open_bus(url: str | None, *, namespace: str = "fedbroker", **options: Any) -> Bus:
    """`None`/`""` → `InProcessBus`; `amqp://` or `amqps://` → `AmqpBus` (options: see `AmqpBus`).

    AMQP-only options are accepted and ignored in process, so one config works for both.
    """
    if not url:
        mem_options = {k: v for k, v in options.items() if k not in _AMQP_ONLY_OPTIONS}
        return InProcessBus(namespace=namespace, **mem_options)
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("amqp", "amqps"):
        raise ConfigError("broker_url", f"scheme must be amqp:// or amqps://, got {scheme or 'none'}://")
    return AmqpBus(url, namespace=namespace, **options)


def mask_url(url: str) -> str:
    """The URL with its password replaced, safe for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _check_max_attempts(max_attempts: int) -> int:
    if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
        raise ConfigError("max_attempts", f"must be an integer >= 1, got {max_attempts!r}")
    return max_attempts


def _check_positive(field: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(field, f"must be a number > 0, got {value!r}")
    return float(value)


class _Dispatcher:
    """One thread per consumer that runs the handler, one delivery at a time, off the I/O thread.

    A handler that raises gets its (unsettled) delivery nacked with requeue, which counts an attempt.
    """

    def __init__(self, name: str, handler: Handler) -> None:
        self.name = name
        self._handler = handler
        self._inbox: collections.deque[Delivery] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"bus-handler-{name}", daemon=True)
        self._started = False

    def start(self) -> None:
        if not self._started:
            self._started = True
            self._thread.start()

    def put(self, delivery: Delivery) -> None:
        with self._cond:
            self._inbox.append(delivery)
            self._cond.notify()

    def stop(self, timeout: float = 2.0) -> None:
        """Drop undelivered items (the broker redelivers them) and let a busy handler finish."""
        with self._cond:
            self._stopping = True
            self._inbox.clear()
            self._cond.notify()
        if self._started and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._inbox and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                delivery = self._inbox.popleft()
            try:
                self._handler(delivery)
            except Exception:
                log.exception("handler for %s failed on %r; the message will be retried", self.name, delivery)
                if not delivery.settled:
                    delivery.nack(requeue=True)


# --------------------------------------------------------------------------------------------------
# In process
# --------------------------------------------------------------------------------------------------


@dataclass
class DeadLetter:
    """A message that was dead-lettered (poison, or nacked without requeue)."""

    body: bytes
    routing_key: str
    queue: str
    attempts: int
    message_id: str | None


@dataclass
class _MemMessage:
    body: bytes
    routing_key: str
    message_id: str
    failures: int = 0  # earlier deliveries that did not end in an ack


class _MemConsumer:
    def __init__(self, dispatcher: _Dispatcher, max_attempts: int) -> None:
        self.dispatcher = dispatcher
        self.max_attempts = max_attempts
        self.unacked: _MemMessage | None = None  # prefetch 1: at most one message in flight
        self.active = False


class _MemQueue:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ready: collections.deque[_MemMessage] = collections.deque()
        self.consumers: list[_MemConsumer] = []


class MemoryBroker:
    """The in-process stand-in for RabbitMQ; every `InProcessBus` with the same namespace shares one."""

    _registry: ClassVar[dict[str, MemoryBroker]] = {}
    _registry_lock = threading.Lock()

    def __init__(self, namespace: str) -> None:
        self.topology = Topology(namespace)
        self.lock = threading.RLock()
        self.queues: dict[str, _MemQueue] = {}
        self.event_queues: list[_MemQueue] = []
        self.dead: list[DeadLetter] = []
        self.declare(self.topology.coordinator_queue)

    @classmethod
    def for_namespace(cls, namespace: str) -> MemoryBroker:
        with cls._registry_lock:
            broker = cls._registry.get(namespace)
            if broker is None:
                broker = cls._registry[namespace] = cls(namespace)
            return broker

    @classmethod
    def forget(cls, namespace: str) -> None:
        """Drop a namespace's queues (tests and demos that reuse a process)."""
        with cls._registry_lock:
            cls._registry.pop(namespace, None)

    def declare(self, name: str) -> _MemQueue:
        with self.lock:
            q = self.queues.get(name)
            if q is None:
                q = self.queues[name] = _MemQueue(name)
            return q

    def ready_count(self, queue: str) -> int:
        """Messages waiting in `queue` (not counting the ones delivered and unacked)."""
        with self.lock:
            q = self.queues.get(queue)
            return len(q.ready) if q else 0

    def enqueue(self, q: _MemQueue, message: _MemMessage) -> None:
        with self.lock:
            q.ready.append(message)
            self.pump(q)

    def pump(self, q: _MemQueue) -> None:
        """Hand ready messages to consumers that have no message in flight (prefetch 1)."""
        with self.lock:
            while q.ready:
                consumer = next((c for c in q.consumers if c.active and c.unacked is None), None)
                if consumer is None:
                    return
                q.consumers.remove(consumer)  # round robin: the served consumer goes to the back
                q.consumers.append(consumer)
                message = q.ready.popleft()
                attempts = message.failures + 1
                if attempts > consumer.max_attempts:
                    self._dead_letter(q, message, message.failures)
                    continue
                consumer.unacked = message
                consumer.dispatcher.put(
                    Delivery(
                        body=message.body,
                        routing_key=message.routing_key,
                        redelivered=message.failures > 0,
                        attempts=attempts,
                        message_id=message.message_id,
                        settle=partial(self._settle, q, consumer, message),
                    )
                )

    def _settle(self, q: _MemQueue, consumer: _MemConsumer, message: _MemMessage, action: Action) -> None:
        with self.lock:
            if consumer.unacked is not message:
                log.warning(
                    "late settlement of message %s ignored: it was already returned to %s",
                    message.message_id,
                    q.name,
                )
                return
            consumer.unacked = None
            if action == "dead":
                self._dead_letter(q, message, message.failures + 1)
            elif action == "requeue":
                self.fail(q, message, consumer.max_attempts)
            self.pump(q)

    def fail(self, q: _MemQueue, message: _MemMessage, max_attempts: int) -> None:
        """Count a failed delivery; retry at the back of the queue or dead-letter it when spent."""
        with self.lock:
            message.failures += 1
            if message.failures >= max_attempts:
                self._dead_letter(q, message, message.failures)
            else:
                q.ready.append(message)

    def _dead_letter(self, q: _MemQueue, message: _MemMessage, attempts: int) -> None:
        log.warning("dead-lettering message %s from %s after %d deliveries", message.message_id, q.name, attempts)
        self.dead.append(DeadLetter(message.body, message.routing_key, q.name, attempts, message.message_id))


class InProcessBus:
    """The bus inside one process, with the same semantics as `AmqpBus`.

    Buses opened with the same namespace share one `MemoryBroker`, as processes share RabbitMQ.
    Each consumer has its own handler thread and at most one unacked message; nack with requeue
    puts the message at the back of its queue with attempts + 1; after `max_attempts` deliveries
    it goes to `dead` instead. Closing a bus returns its unacked messages to their queues (an
    attempt is counted, as RabbitMQ redelivery is counted by `AmqpBus`).
    """

    def __init__(
        self, *, namespace: str = "fedbroker", max_attempts: int = 5, broker: MemoryBroker | None = None
    ) -> None:
        self.topology = Topology(_check_name("namespace", namespace))
        self.max_attempts = _check_max_attempts(max_attempts)
        self.broker = broker or MemoryBroker.for_namespace(namespace)
        self.reconnects = 0
        self._lock = threading.Lock()
        self._consumers: list[tuple[_MemQueue, _MemConsumer]] = []
        self._own_event_queues: list[_MemQueue] = []
        self._started = False
        self._closed = False

    @property
    def dead(self) -> list[DeadLetter]:
        return self.broker.dead

    def _check_open(self) -> None:
        if self._closed:
            raise BusError("bus is closed")

    def _message(self, body: bytes, routing_key: str) -> _MemMessage:
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise TypeError(f"body must be bytes, got {type(body).__name__}")
        return _MemMessage(bytes(body), routing_key, uuid.uuid4().hex)

    def publish_task(self, worker_id: str, body: bytes) -> None:
        self._check_open()
        _check_name("worker_id", worker_id)
        with self.broker.lock:
            q = self.broker.queues.get(self.topology.worker_queue(worker_id))
            if q is None:
                raise BusError(
                    f"task for worker {worker_id!r} is unroutable: no queue for that worker (declare_worker first)"
                )
            self.broker.enqueue(q, self._message(body, worker_id))

    def publish_control(self, body: bytes) -> None:
        self._check_open()
        q = self.broker.declare(self.topology.coordinator_queue)
        self.broker.enqueue(q, self._message(body, CONTROL_ROUTING_KEY))

    def publish_event(self, body: bytes) -> None:
        self._check_open()
        message = self._message(body, "")
        with self.broker.lock:
            for q in list(self.broker.event_queues):
                self.broker.enqueue(q, _MemMessage(message.body, "", message.message_id))

    def declare_worker(self, worker_id: str) -> None:
        self._check_open()
        self.broker.declare(self.topology.worker_queue(_check_name("worker_id", worker_id)))

    def consume_tasks(self, worker_id: str, handler: Handler) -> None:
        self.declare_worker(worker_id)
        self._consume(self.broker.declare(self.topology.worker_queue(worker_id)), handler)

    def consume_control(self, handler: Handler) -> None:
        self._check_open()
        self._consume(self.broker.declare(self.topology.coordinator_queue), handler)

    def consume_events(self, handler: Handler) -> None:
        """Events published from now on reach this subscriber; its queue goes away on close."""
        self._check_open()
        q = _MemQueue(f"{self.topology.namespace}.events.{uuid.uuid4().hex[:12]}")
        with self.broker.lock:
            self.broker.event_queues.append(q)
        self._own_event_queues.append(q)
        self._consume(q, handler)

    def _consume(self, q: _MemQueue, handler: Handler) -> None:
        consumer = _MemConsumer(_Dispatcher(q.name, handler), self.max_attempts)
        with self.broker.lock:
            q.consumers.append(consumer)
        with self._lock:
            self._consumers.append((q, consumer))
            started = self._started
        if started:
            self._activate(q, consumer)

    def _activate(self, q: _MemQueue, consumer: _MemConsumer) -> None:
        consumer.dispatcher.start()
        with self.broker.lock:
            consumer.active = True
            self.broker.pump(q)

    def start(self) -> None:
        self._check_open()
        with self._lock:
            if self._started:
                return
            self._started = True
            consumers = list(self._consumers)
        for q, consumer in consumers:
            self._activate(q, consumer)

    def wait_ready(self, timeout: float) -> bool:
        """Consumers are ready as soon as `start` returns (same method as `AmqpBus`)."""
        return True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            consumers, self._consumers = self._consumers, []
        with self.broker.lock:
            for q, consumer in consumers:
                consumer.active = False
                if consumer in q.consumers:
                    q.consumers.remove(consumer)
                message, consumer.unacked = consumer.unacked, None
                if message is not None:
                    self.broker.fail(q, message, consumer.max_attempts)
                    self.broker.pump(q)
            for q in self._own_event_queues:
                if q in self.broker.event_queues:
                    self.broker.event_queues.remove(q)
        for _, consumer in consumers:
            consumer.dispatcher.stop()


# --------------------------------------------------------------------------------------------------
# AMQP
# --------------------------------------------------------------------------------------------------


class _Call:
    """Work handed to a link's I/O thread; the caller waits for its result with a deadline."""

    def __init__(self, fn: Callable[[], Any], *, deadline: float, what: str) -> None:
        self.fn = fn
        self.deadline = deadline
        self.what = what
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._state = "pending"  # → running → done, or pending → abandoned
        self._error: BaseException | None = None

    def claim(self) -> bool:
        with self._lock:
            if self._state == "pending" and time.monotonic() > self.deadline:
                self._state = "abandoned"
                self._error = BusError(f"timed out {self.what}")
                self._done.set()
            if self._state != "pending":
                return False
            self._state = "running"
            return True

    def unclaim(self) -> None:
        with self._lock:
            if self._state == "running":
                self._state = "pending"

    def abandon(self, error: BaseException) -> bool:
        with self._lock:
            if self._state != "pending":
                return False
            self._state = "abandoned"
            self._error = error
            self._done.set()
            return True

    def finish(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._state = "done"
            self._error = error
            self._done.set()

    def wait(self, timeout_error: Callable[[], BaseException]) -> None:
        while not self._done.wait(min(0.25, max(0.01, self.deadline - time.monotonic()))):
            if time.monotonic() >= self.deadline and self.abandon(timeout_error()):
                break
        if self._error is not None:
            raise self._error


def _tls_context(url: str, *, ca_file: str, cert_file: str, key_file: str) -> ssl.SSLContext | None:
    """The client TLS context of an amqps:// URL: the broker's CA (default: the system's), an optional client
    certificate; host names are checked. TLS settings with a plaintext amqp:// URL are a mistake, not a no-op."""
    if not (ca_file or cert_file or key_file):
        return None
    if urlsplit(url).scheme.lower() != "amqps":
        raise ConfigError("broker.ca_file", "TLS settings (ca_file, cert_file, key_file) need an amqps:// URL")
    if bool(cert_file) != bool(key_file):
        raise ConfigError("broker.cert_file", "a client certificate needs both cert_file and key_file")
    try:
        context = ssl.create_default_context(cafile=ca_file or None)
        if cert_file:
            context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("broker.ca_file" if not cert_file else "broker.cert_file",
                          f"cannot load the TLS files: {exc}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _connection_errors() -> tuple[type[BaseException], ...]:
    import pika.exceptions as pex

    return (pex.AMQPConnectionError, pex.AMQPChannelError, pex.ChannelError, OSError)


class _Link:
    """One pika `BlockingConnection`, owned and touched by exactly one thread (pika is not thread-safe).

    The thread connects (capped, jittered exponential backoff), calls `on_connect` (topology,
    channels, consumers), then loops on `process_data_events(time_limit=…)`, which services
    heartbeats even while handlers train for minutes, and runs `_Call`s queued by other threads
    (woken with `add_callback_threadsafe`). On connection loss it tears down and reconnects;
    calls that were not completed stay queued and run on the next connection unless their
    deadline passed.
    """

    def __init__(
        self,
        *,
        role: str,
        url: str,
        client_name: str,
        heartbeat_s: float,
        blocked_timeout_s: float,
        reconnect_initial_s: float,
        reconnect_max_s: float,
        on_connect: Callable[[Any], None],
        on_disconnect: Callable[[], None],
        tls: ssl.SSLContext | None = None,
        on_tick: Callable[[Any], None] | None = None,
    ) -> None:
        import pika

        self.role = role
        self.masked_url = mask_url(url)
        params = pika.URLParameters(url)
        query = parse_qs(urlsplit(url).query)
        if params.ssl_options is not None and "ssl_options" not in query:
            # pika's own amqps:// default checks host names but gives no host name to check (every handshake
            # fails): verify the broker's certificate for the URL's host, against our CA or the system's.
            params.ssl_options = pika.SSLOptions(tls or ssl.create_default_context(), server_hostname=params.host)
        if "heartbeat" not in query:
            params.heartbeat = math.ceil(heartbeat_s)
        if "blocked_connection_timeout" not in query:
            params.blocked_connection_timeout = blocked_timeout_s
        params.connection_attempts = 1  # retries are ours, with backoff and logging
        params.client_properties = {"connection_name": f"{client_name}.{role}", "product": "fedbroker"}
        self._params = params
        self._initial = reconnect_initial_s
        self._max = reconnect_max_s
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._on_tick = on_tick  # called on the I/O thread after every round of I/O, with the connection
        self._calls: collections.deque[_Call] = collections.deque()
        self._calls_lock = threading.Lock()
        self._stop = threading.Event()
        self._conn: Any = None
        self.connected = threading.Event()
        self.reconnects = 0
        self._thread = threading.Thread(target=self._run, name=f"bus-io-{role}", daemon=True)
        self._started = False
        self._start_lock = threading.Lock()

    @property
    def connection_name(self) -> str:
        return str(self._params.client_properties["connection_name"])

    def start(self) -> None:
        with self._start_lock:
            if not self._started and not self._stop.is_set():
                self._started = True
                self._thread.start()

    def on_io_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[[], Any], *, timeout: float, what: str) -> None:
        """Run `fn` on the I/O thread and wait; connection errors retry it until `timeout`."""
        if self.on_io_thread():
            fn()
            return
        if self._stop.is_set():
            raise BusError(f"bus is closed; not {what}")
        call = _Call(fn, deadline=time.monotonic() + timeout, what=what)
        with self._calls_lock:
            self._calls.append(call)
        self._wake()
        call.wait(lambda: BusError(f"timed out after {timeout:g}s {what}: broker {self.masked_url} unreachable"))

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread.is_alive() and not self.on_io_thread():
            self._thread.join(timeout)
        with self._calls_lock:
            calls, self._calls = list(self._calls), collections.deque()
        for call in calls:
            call.abandon(BusError(f"bus closed before {call.what}"))

    def _wake(self) -> None:
        conn = self._conn
        if conn is not None:
            try:
                conn.add_callback_threadsafe(_noop)
            except Exception:  # closed meanwhile: the loop notices by itself
                pass

    def _drain(self) -> None:
        while True:
            with self._calls_lock:
                if not self._calls:
                    return
                call = self._calls[0]
            if call.claim():
                try:
                    call.fn()
                except _connection_errors():
                    call.unclaim()  # stays at the head: retried after the reconnect
                    raise
                except BaseException as exc:
                    call.finish(exc)
                else:
                    call.finish()
            with self._calls_lock:
                if self._calls and self._calls[0] is call:
                    self._calls.popleft()

    def _backoff(self, failures: int) -> float:
        ceiling = min(self._max, self._initial * 2 ** min(failures, 30))
        return random.uniform(ceiling / 2, ceiling)

    def _run(self) -> None:
        import pika

        failures = 0
        ever_connected = False
        while not self._stop.is_set():
            conn = None
            try:
                conn = pika.BlockingConnection(self._params)
                self._on_connect(conn)
                self._conn = conn
                self.connected.set()
                if ever_connected:
                    self.reconnects += 1
                    log.info(
                        "bus %s reconnected to %s (reconnect #%d)", self.role, self.masked_url, self.reconnects
                    )
                else:
                    log.info("bus %s connected to %s", self.role, self.masked_url)
                ever_connected = True
                failures = 0
                while not self._stop.is_set():
                    self._drain()
                    conn.process_data_events(time_limit=1.0)
                    if self._on_tick is not None:
                        self._on_tick(conn)
                self._drain()  # acks and publishes handed over before close() still go out
            except _connection_errors() as exc:
                delay = self._backoff(failures)
                failures += 1
                state = "lost" if self.connected.is_set() else "failed"
                log.warning(
                    "bus %s connection to %s %s (%s: %s); reconnecting in %.2fs",
                    self.role, self.masked_url, state, type(exc).__name__, exc, delay,
                )
                self._teardown(conn)
                self._stop.wait(delay)
                continue
            except Exception:
                log.exception("bus %s I/O thread failed unexpectedly; reconnecting", self.role)
                self._teardown(conn)
                self._stop.wait(self._backoff(failures))
                failures += 1
                continue
            self._teardown(conn)

    def _teardown(self, conn: Any) -> None:
        self._conn = None
        self.connected.clear()
        self._on_disconnect()
        if conn is not None and conn.is_open:
            try:
                conn.close()
            except Exception as exc:
                log.debug("bus %s: closing the connection failed: %s", self.role, exc)


def _noop() -> None:
    pass


@dataclass
class _AmqpConsumer:
    kind: Literal["tasks", "control", "events"]
    queue: str  # "" for an events subscriber until the broker names its queue
    dispatcher: _Dispatcher
    channel: Any = None  # the channel of the current connection, None while disconnected


def _header_int(headers: dict[str, Any], key: str) -> int:
    try:
        return max(0, int(headers.get(key, 0)))
    except (TypeError, ValueError):
        return 0


class AmqpBus:
    """The bus on RabbitMQ.

    Topology (re-declared on every connect, names from `Topology`): durable direct exchange
    `<ns>.tasks` → durable queue `<ns>.worker.<id>` per worker (routing key = worker id); durable
    direct `<ns>.control` → durable `<ns>.coordinator`; durable fanout `<ns>.events` → one
    exclusive auto-delete queue per subscriber (events during a subscriber's outage are missed:
    they are notifications, the coordinator's state is the truth); durable fanout `<ns>.dlx` →
    durable `<ns>.dead`. Consumer queues dead-letter into `<ns>.dlx`.

    Threading: two connections, each owned by its own I/O thread (`_Link`): one publishes, one
    consumes — RabbitMQ throttles publishing connections, which must never stall acks. Publishes
    from any thread are handed to the publisher thread and the caller waits for the confirm, so no
    connection is touched by two threads and an idle publisher still answers heartbeats.
    Deliveries go from the consumer I/O thread to one handler thread per consumer; `ack`/`nack`
    are handed back to the I/O thread, and wait until it sent them (a few seconds at most).

    Attempt counting (classic queues have no delivery counter): the header `x-fedbroker-attempts`
    holds how many earlier deliveries failed; a delivery's `attempts` is that + 1. A failed
    delivery — the handler raised or called `nack(requeue=True)`, or the broker redelivered a
    message whose consumer died or closed without settling it (`redelivered` flag) — is
    republished (confirmed, by queue name, at the back of the same queue) with the header + 1
    and only then is the original acked; when the count reaches `max_attempts` the original is
    nacked without requeue and RabbitMQ dead-letters it. A handler thus sees a message at most
    `max_attempts` times. A crash between republish and ack can duplicate a message, never lose
    it: handlers must be idempotent (`message_id` is stable across retries).

    Ack late, after the result is durable. RabbitMQ's `consumer_timeout` (30 min by default) must
    exceed the longest round, or the broker closes the channel and redelivers.

    Options: `max_attempts` (deliveries before dead-lettering); `reconnect_initial_s`,
    `reconnect_max_s` (backoff); `publish_timeout_s` (how long a publish retries through an outage
    before `BusError`; also pika's `blocked_connection_timeout`); `heartbeat_s` (unless the URL
    sets `heartbeat=`); `client_name` (prefix of the `connection_name` shown by RabbitMQ);
    `settle_timeout_s` (how long `ack`/`nack` wait for the I/O thread). Credentials come from the URL;
    logs show it with the password masked. TLS: an `amqps://` URL, verified against `ca_file` (default:
    the system's CAs) for the URL's host name, with `cert_file`/`key_file` as a client certificate.
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "fedbroker",
        max_attempts: int = 5,
        reconnect_initial_s: float = 0.5,
        reconnect_max_s: float = 30.0,
        publish_timeout_s: float = 30.0,
        heartbeat_s: float = 30.0,
        client_name: str | None = None,
        settle_timeout_s: float = 10.0,
        ca_file: str = "",
        cert_file: str = "",
        key_file: str = "",
    ) -> None:
        import pika  # noqa: F401  (fail here, not in a thread, when pika is missing)

        self.topology = Topology(_check_name("namespace", namespace))
        self.max_attempts = _check_max_attempts(max_attempts)
        self.publish_timeout_s = _check_positive("publish_timeout_s", publish_timeout_s)
        self.settle_timeout_s = _check_positive("settle_timeout_s", settle_timeout_s)
        initial = _check_positive("reconnect_initial_s", reconnect_initial_s)
        maximum = _check_positive("reconnect_max_s", reconnect_max_s)
        if maximum < initial:
            raise ConfigError("reconnect_max_s", f"must be >= reconnect_initial_s ({initial:g}), got {maximum:g}")
        heartbeat = _check_positive("heartbeat_s", heartbeat_s)
        if heartbeat < 1:
            raise ConfigError("heartbeat_s", f"must be >= 1 got {heartbeat:g}")
        if client_name is None:
            host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:60] or "host"
            client_name = f"{namespace}:{host}:{os.getpid()}"
        else:
            _check_name("client_name", client_name)
        self.masked_url = mask_url(url)
        link_options = dict(
            tls=_tls_context(url, ca_file=ca_file, cert_file=cert_file, key_file=key_file),
            url=url,
            client_name=client_name,
            heartbeat_s=heartbeat,
            blocked_timeout_s=self.publish_timeout_s,
            reconnect_initial_s=initial,
            reconnect_max_s=maximum,
        )
        self._lock = threading.Lock()
        self._workers: set[str] = set()  # worker queues to re-declare on every connect
        self._consumers: list[_AmqpConsumer] = []
        self._pub_channel: Any = None
        self._retry_channel: Any = None
        self._consumer_conn: Any = None
        self._consuming = threading.Event()  # set while every registered consumer is consuming
        self._started = False
        self._closed = False
        self._publisher = _Link(
            role="publisher",
            on_connect=self._on_publisher_connect,
            on_disconnect=self._on_publisher_disconnect,
            **link_options,
        )
        self._consumer = _Link(
            role="consumer",
            on_connect=self._on_consumer_connect,
            on_disconnect=self._on_consumer_disconnect,
            on_tick=self._revive_consumers,
            **link_options,
        )

    @property
    def reconnects(self) -> int:
        """Connections re-established after a loss, both links together (a Prometheus counter)."""
        return self._publisher.reconnects + self._consumer.reconnects

    @property
    def connection_names(self) -> tuple[str, str]:
        """`connection_name` client properties of the publisher and consumer connections."""
        return self._publisher.connection_name, self._consumer.connection_name

    # -- topology -------------------------------------------------------------------------------

    def _declare_topology(self, ch: Any) -> None:
        t = self.topology
        ch.exchange_declare(t.dead_letter_exchange, exchange_type="fanout", durable=True)
        ch.queue_declare(t.dead_queue, durable=True)
        ch.queue_bind(t.dead_queue, t.dead_letter_exchange)
        ch.exchange_declare(t.tasks_exchange, exchange_type="direct", durable=True)
        ch.exchange_declare(t.control_exchange, exchange_type="direct", durable=True)
        ch.exchange_declare(t.events_exchange, exchange_type="fanout", durable=True)
        self._declare_queue(ch, t.coordinator_queue, t.control_exchange, CONTROL_ROUTING_KEY)
        with self._lock:
            workers = sorted(self._workers)
        for worker_id in workers:
            self._declare_queue(ch, t.worker_queue(worker_id), t.tasks_exchange, worker_id)

    def _declare_queue(self, ch: Any, queue: str, exchange: str, routing_key: str) -> None:
        dlx = {"x-dead-letter-exchange": self.topology.dead_letter_exchange}
        ch.queue_declare(queue, durable=True, arguments=dlx)
        ch.queue_bind(queue, exchange, routing_key=routing_key)

    # -- publishing -----------------------------------------------------------------------------

    def _on_publisher_connect(self, conn: Any) -> None:
        ch = conn.channel()
        ch.confirm_delivery()
        self._declare_topology(ch)
        self._pub_channel = ch

    def _on_publisher_disconnect(self) -> None:
        self._pub_channel = None

    def _check_open(self) -> None:
        if self._closed:
            raise BusError("bus is closed")

    def _publish(self, exchange: str, routing_key: str, body: bytes, *, mandatory: bool, what: str) -> None:
        import pika
        import pika.exceptions as pex

        self._check_open()
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise TypeError(f"body must be bytes, got {type(body).__name__}")
        properties = pika.BasicProperties(
            delivery_mode=pika.DeliveryMode.Persistent,
            content_type=CONTENT_TYPE,
            message_id=uuid.uuid4().hex,
            timestamp=int(time.time()),
            app_id=self.topology.namespace,
        )
        payload = bytes(body)

        def publish() -> None:
            ch = self._pub_channel
            if ch is None:
                raise pex.ChannelWrongStateError("publisher channel not open")
            try:
                ch.basic_publish(exchange, routing_key, payload, properties, mandatory=mandatory)
            except pex.UnroutableError as exc:
                raise BusError(
                    f"{what} is unroutable: no queue bound for routing key {routing_key!r} on {exchange}"
                ) from exc
            except pex.NackError as exc:
                raise BusError(f"broker refused (nacked) {what}") from exc

        self._publisher.start()
        self._publisher.call(publish, timeout=self.publish_timeout_s, what=f"publishing {what}")

    def publish_task(self, worker_id: str, body: bytes) -> None:
        """Persistent and confirmed; `BusError` when no queue exists for the worker (mandatory)."""
        _check_name("worker_id", worker_id)
        self._publish(
            self.topology.tasks_exchange, worker_id, body, mandatory=True, what=f"task for worker {worker_id!r}"
        )

    def publish_control(self, body: bytes) -> None:
        self._publish(
            self.topology.control_exchange, CONTROL_ROUTING_KEY, body, mandatory=True, what="control message"
        )

    def publish_event(self, body: bytes) -> None:
        """Fanout; not mandatory, since an event with no subscriber is not an error."""
        self._publish(self.topology.events_exchange, "", body, mandatory=False, what="event")

    def declare_worker(self, worker_id: str) -> None:
        """Create the worker's durable queue now, so tasks published before it connects are kept."""
        self._check_open()
        _check_name("worker_id", worker_id)
        with self._lock:
            self._workers.add(worker_id)

        def declare() -> None:
            import pika.exceptions as pex

            if self._pub_channel is None:
                raise pex.ChannelWrongStateError("publisher channel not open")
            t = self.topology
            self._declare_queue(self._pub_channel, t.worker_queue(worker_id), t.tasks_exchange, worker_id)

        self._publisher.start()
        what = f"declaring the queue of worker {worker_id!r}"
        self._publisher.call(declare, timeout=self.publish_timeout_s, what=what)

    # -- consuming ------------------------------------------------------------------------------

    def consume_tasks(self, worker_id: str, handler: Handler) -> None:
        _check_name("worker_id", worker_id)
        self._check_open()
        with self._lock:
            self._workers.add(worker_id)
        queue = self.topology.worker_queue(worker_id)
        self._add_consumer(_AmqpConsumer("tasks", queue, _Dispatcher(f"tasks.{worker_id}", handler)))

    def consume_control(self, handler: Handler) -> None:
        self._check_open()
        queue = self.topology.coordinator_queue
        self._add_consumer(_AmqpConsumer("control", queue, _Dispatcher("control", handler)))

    def consume_events(self, handler: Handler) -> None:
        self._check_open()
        self._add_consumer(_AmqpConsumer("events", "", _Dispatcher("events", handler)))

    def _add_consumer(self, consumer: _AmqpConsumer) -> None:
        with self._lock:
            self._consumers.append(consumer)
            started = self._started
        if started:
            consumer.dispatcher.start()
            self._consumer.start()
            try:
                self._consumer.call(
                    lambda: self._start_consumer(consumer),
                    timeout=self.publish_timeout_s,
                    what=f"starting consumer {consumer.dispatcher.name}",
                )
            except BusError as exc:  # set up by the next connect anyway
                log.warning("%s", exc)

    def start(self) -> None:
        """Begin delivering to the registered handlers (consumers added later start at once)."""
        self._check_open()
        with self._lock:
            if self._started:
                return
            self._started = True
            consumers = list(self._consumers)
        for consumer in consumers:
            consumer.dispatcher.start()
        if consumers:
            self._consumer.start()
            if not self.wait_ready(self.publish_timeout_s):
                log.warning(
                    "bus consumers not ready after %gs (broker %s unreachable?); they start on connect",
                    self.publish_timeout_s, self.masked_url,
                )

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every registered consumer is consuming (e.g. an event subscription exists)."""
        with self._lock:
            if not self._consumers:
                return True
        return self._consuming.wait(timeout)

    def _on_consumer_connect(self, conn: Any) -> None:
        ch = conn.channel()
        self._declare_topology(ch)
        ch.confirm_delivery()  # this channel republishes retries, confirmed before the original is acked
        self._retry_channel = ch
        self._consumer_conn = conn
        with self._lock:
            consumers = list(self._consumers)
        for consumer in consumers:
            self._start_consumer(consumer)
        self._consuming.set()

    def _start_consumer(self, consumer: _AmqpConsumer) -> None:
        conn = getattr(self, "_consumer_conn", None)
        if consumer.channel is not None or conn is None or not conn.is_open or self._retry_channel is None:
            return  # already consuming on this connection, or the next connect will do it
        ch = conn.channel()
        ch.basic_qos(prefetch_count=1)
        dlx = {"x-dead-letter-exchange": self.topology.dead_letter_exchange}
        if consumer.kind == "events":
            result = ch.queue_declare("", exclusive=True, auto_delete=True, arguments=dlx)
            consumer.queue = result.method.queue
            ch.queue_bind(consumer.queue, self.topology.events_exchange)
        ch.basic_consume(consumer.queue, partial(self._on_message, consumer), auto_ack=False)
        consumer.channel = ch

    def _revive_consumers(self, conn: Any) -> None:
        """Consume again on a new channel when the broker closed a consumer's channel but not the connection:
        RabbitMQ does so when a delivery stays unacked past its consumer_timeout (and redelivers it). Without
        this the consumer would fall silent for good while its connection looks healthy."""
        with self._lock:
            consumers = list(self._consumers)
        for consumer in consumers:
            ch = consumer.channel
            if ch is not None and not ch.is_open:
                log.warning("bus consumer %s: the broker closed its channel (a delivery held past the broker's "
                            "consumer_timeout?); consuming again on a new channel", consumer.dispatcher.name)
                consumer.channel = None
                self._start_consumer(consumer)

    def _on_consumer_disconnect(self) -> None:
        self._consuming.clear()
        self._retry_channel = None
        self._consumer_conn = None
        with self._lock:
            for consumer in self._consumers:
                consumer.channel = None  # deliveries of the old connection become stale

    def _on_message(self, consumer: _AmqpConsumer, ch: Any, method: Any, props: Any, body: bytes) -> None:
        """On the I/O thread: count the attempt, then dead-letter, retry or hand to the handler."""
        headers = dict(props.headers or {})
        prior = _header_int(headers, ATTEMPTS_HEADER)
        if method.redelivered:  # an earlier delivery ended unsettled (consumer died or closed)
            self._retry(consumer, ch, method, props, body, failures=prior + 1)
            return
        attempts = prior + 1
        if attempts > self.max_attempts:  # a smaller max_attempts than the one that retried it
            self._dead_letter(consumer, ch, method, props, attempts - 1)
            return
        routing_key = headers.get(ROUTING_KEY_HEADER, method.routing_key)
        if isinstance(routing_key, bytes):
            routing_key = routing_key.decode("utf-8", "replace")
        consumer.dispatcher.put(
            Delivery(
                body=body,
                routing_key=str(routing_key),
                redelivered=attempts > 1,
                attempts=attempts,
                message_id=props.message_id,
                settle=partial(self._settle, consumer, ch, method, props, body, attempts),
            )
        )

    def _retry(
        self, consumer: _AmqpConsumer, ch: Any, method: Any, props: Any, body: bytes, *, failures: int
    ) -> None:
        import pika
        import pika.exceptions as pex

        if failures >= self.max_attempts:
            self._dead_letter(consumer, ch, method, props, failures)
            return
        headers = dict(props.headers or {})
        headers[ATTEMPTS_HEADER] = failures
        headers.setdefault(ROUTING_KEY_HEADER, method.routing_key)
        copy = pika.BasicProperties(
            delivery_mode=pika.DeliveryMode.Persistent,
            content_type=props.content_type,
            message_id=props.message_id,
            timestamp=props.timestamp,
            app_id=props.app_id,
            headers=headers,
        )
        try:
            self._retry_channel.basic_publish("", consumer.queue, body, copy, mandatory=True)
        except (pex.UnroutableError, pex.NackError) as exc:
            log.error(
                "could not requeue message %s on %s (%s); dead-lettering it", props.message_id, consumer.queue, exc
            )
            ch.basic_nack(method.delivery_tag, requeue=False)
            return
        ch.basic_ack(method.delivery_tag)
        log.info(
            "message %s on %s will be retried (failed deliveries: %d)", props.message_id, consumer.queue, failures
        )

    def _dead_letter(self, consumer: _AmqpConsumer, ch: Any, method: Any, props: Any, attempts: int) -> None:
        log.warning(
            "dead-lettering message %s from %s after %d deliveries", props.message_id, consumer.queue, attempts
        )
        ch.basic_nack(method.delivery_tag, requeue=False)

    def _settle(
        self, consumer: _AmqpConsumer, ch: Any, method: Any, props: Any, body: bytes, attempts: int, action: Action
    ) -> None:
        def settle() -> None:
            if consumer.channel is not ch or not ch.is_open:
                log.warning(
                    "%s of message %s dropped: its connection is gone, the broker redelivers it",
                    action,
                    props.message_id,
                )
                return
            if action == "ack":
                ch.basic_ack(method.delivery_tag)
            elif action == "dead":
                self._dead_letter(consumer, ch, method, props, attempts)
            else:
                self._retry(consumer, ch, method, props, body, failures=attempts)

        if consumer.channel is not ch:
            settle()  # stale: only logs, touches no connection
            return
        try:
            what = f"settling message {props.message_id} ({action})"
            self._consumer.call(settle, timeout=self.settle_timeout_s, what=what)
        except BusError as exc:
            log.warning("%s; the broker redelivers the message", exc)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop consuming (unacked messages go back to their queues), then the publisher. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            consumers = list(self._consumers)
        for consumer in consumers:
            consumer.dispatcher.stop(timeout=0)
        self._consumer.stop()
        for consumer in consumers:
            consumer.dispatcher.stop(timeout=1.0)
        self._publisher.stop()

    def __enter__(self) -> AmqpBus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "ATTEMPTS_HEADER",
    "AmqpBus",
    "Bus",
    "BusError",
    "DeadLetter",
    "Delivery",
    "Handler",
    "InProcessBus",
    "MemoryBroker",
    "Topology",
    "mask_url",
    "open_bus",
]


def delete_topology(url: str, namespace: str, worker_ids: Sequence[str]) -> None:
    """Remove a namespace's queues and exchanges from RabbitMQ (for short-lived demo and test namespaces)."""
    import pika

    names = Topology(namespace)
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        for queue in [names.coordinator_queue, names.dead_queue, *(names.worker_queue(w) for w in worker_ids)]:
            channel.queue_delete(queue)
        for exchange in (names.tasks_exchange, names.control_exchange, names.events_exchange,
                         names.dead_letter_exchange):
            channel.exchange_delete(exchange)
    finally:
        connection.close()
