"""The bus on RabbitMQ (`AmqpBus`), through pika: durable topology, persistent messages, publisher confirms,
manual acks, prefetch 1, dead-lettering of poison messages and reconnection with jittered backoff.

pika is imported where it is used, so the in-process bus works without it.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import re
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal
from urllib.parse import parse_qs, urlsplit

from fedbroker.bus.base import (
    ATTEMPTS_HEADER,
    CONTENT_TYPE,
    CONTROL_ROUTING_KEY,
    ROUTING_KEY_HEADER,
    Action,
    Delivery,
    Dispatcher,
    Handler,
    Topology,
    check_max_attempts,
    check_name,
    check_url,
    mask_url,
)
from fedbroker.errors import BusError, ConfigError, Unroutable
from fedbroker.retry import Backoff

log = logging.getLogger(__name__)

AMQP_ONLY_OPTIONS = {
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


def _check_positive(field: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(field, f"must be a number > 0, got {value!r}")
    return float(value)


class _Call:
    """Work handed to a link's I/O thread; the caller waits for its result with a deadline. Past it, a call
    that `expires` is abandoned (never run); one that does not stays queued and runs when the thread gets to
    it (an ack: dropping it would leave its delivery unacked on a live channel for good)."""

    def __init__(self, fn: Callable[[], object], *, deadline: float, what: str, expires: bool = True) -> None:
        self.fn = fn
        self.deadline = deadline
        self.what = what
        self.expires = expires
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._state = "pending"  # → running → done, or pending → abandoned
        self._error: BaseException | None = None

    def claim(self) -> bool:
        with self._lock:
            if self._state == "pending" and self.expires and time.monotonic() > self.deadline:
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
            if time.monotonic() >= self.deadline:
                if not self.expires:
                    raise timeout_error()  # the caller stops waiting; the call still runs
                if self.abandon(timeout_error()):
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
        reconnect: Backoff,
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
        self._reconnect = reconnect
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

    def call(self, fn: Callable[[], object], *, timeout: float, what: str, expires: bool = True) -> None:
        """Run `fn` on the I/O thread and wait; connection errors retry it until `timeout`. `expires=False`:
        past `timeout` the caller stops waiting (BusError) but `fn` still runs, late (see `_Call`)."""
        if self.on_io_thread():
            fn()
            return
        if self._stop.is_set():
            raise BusError(f"bus is closed; not {what}")
        call = _Call(fn, deadline=time.monotonic() + timeout, what=what, expires=expires)
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
                delay = self._reconnect.delay(failures)
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
                self._stop.wait(self._reconnect.delay(failures))
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
    dispatcher: Dispatcher
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

        self.topology = Topology(check_name("namespace", namespace))
        self.max_attempts = check_max_attempts(max_attempts)
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
            check_name("client_name", client_name)
        self.masked_url = mask_url(check_url(url))
        tls = _tls_context(url, ca_file=ca_file, cert_file=cert_file, key_file=key_file)
        reconnect = Backoff(initial_s=initial, max_s=maximum)

        def link(role: str, on_connect: Callable[[Any], None], on_disconnect: Callable[[], None],
                 on_tick: Callable[[Any], None] | None = None) -> _Link:
            return _Link(role=role, url=url, client_name=client_name, heartbeat_s=heartbeat,
                         blocked_timeout_s=self.publish_timeout_s, reconnect=reconnect, on_connect=on_connect,
                         on_disconnect=on_disconnect, tls=tls, on_tick=on_tick)

        self._lock = threading.Lock()
        self._workers: set[str] = set()  # worker queues to re-declare on every connect
        self._consumers: list[_AmqpConsumer] = []
        self._pub_channel: Any = None
        self._batch_channel: Any = None
        self._pub_conn: Any = None
        self._returned: list[str] = []  # routing keys of tasks a batch got back unroutable (I/O thread only)
        self._retry_channel: Any = None
        self._consumer_conn: Any = None
        self._consuming = threading.Event()  # set while every registered consumer is consuming
        self._started = False
        self._closed = False
        self._publisher = link("publisher", self._on_publisher_connect, self._on_publisher_disconnect)
        self._consumer = link("consumer", self._on_consumer_connect, self._on_consumer_disconnect,
                              on_tick=self._revive_consumers)

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
        batch = conn.channel()  # publish_tasks: a transaction, committed once per batch
        batch.tx_select()
        batch.add_on_return_callback(lambda _ch, method, _props, _body: self._returned.append(method.routing_key))
        self._batch_channel = batch
        self._pub_conn = conn

    def _on_publisher_disconnect(self) -> None:
        self._pub_channel = None
        self._batch_channel = None
        self._pub_conn = None

    def _check_open(self) -> None:
        if self._closed:
            raise BusError("bus is closed")

    def _properties(self) -> Any:
        import pika

        return pika.BasicProperties(
            delivery_mode=pika.DeliveryMode.Persistent,
            content_type=CONTENT_TYPE,
            message_id=uuid.uuid4().hex,
            timestamp=int(time.time()),
            app_id=self.topology.namespace,
        )

    def _publish(self, exchange: str, routing_key: str, body: bytes, *, mandatory: bool, what: str) -> None:
        import pika.exceptions as pex

        self._check_open()
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise TypeError(f"body must be bytes, got {type(body).__name__}")
        properties = self._properties()
        payload = bytes(body)

        def publish() -> None:
            ch = self._pub_channel
            if ch is None:
                raise pex.ChannelWrongStateError("publisher channel not open")
            try:
                ch.basic_publish(exchange, routing_key, payload, properties, mandatory=mandatory)
            except pex.UnroutableError as exc:
                raise Unroutable(
                    f"{what} is unroutable: no queue bound for routing key {routing_key!r} on {exchange}"
                ) from exc
            except pex.NackError as exc:
                raise BusError(f"broker refused (nacked) {what}") from exc

        self._publisher.start()
        self._publisher.call(publish, timeout=self.publish_timeout_s, what=f"publishing {what}")

    def publish_task(self, worker_id: str, body: bytes) -> None:
        """Persistent and confirmed; `BusError` when no queue exists for the worker (mandatory)."""
        check_name("worker_id", worker_id)
        self._publish(
            self.topology.tasks_exchange, worker_id, body, mandatory=True, what=f"task for worker {worker_id!r}"
        )

    def publish_tasks(self, tasks: Sequence[tuple[str, bytes]]) -> list[str]:
        """Persistent tasks published in one AMQP transaction: N publishes and one tx.commit, so the
        broker's answer is awaited once for the batch instead of once per task (one confirm each). The
        commit returns when the broker has taken every message (persistent ones written to disk, as a
        confirm would wait for); unroutable ones come back as basic.return frames before commit-ok.
        `bench/control_plane.py` measures this against a confirm channel with all the batch outstanding."""
        import pika.exceptions as pex

        self._check_open()
        for worker_id, _ in tasks:
            check_name("worker_id", worker_id)
        messages = [(worker_id, bytes(body), self._properties()) for worker_id, body in tasks]
        unroutable: list[str] = []

        def publish() -> None:
            ch, conn = self._batch_channel, self._pub_conn
            if ch is None or conn is None:
                raise pex.ChannelWrongStateError("publisher channel not open")
            self._returned.clear()
            for worker_id, payload, properties in messages:
                ch.basic_publish(self.topology.tasks_exchange, worker_id, payload, properties, mandatory=True)
            ch.tx_commit()
            conn.process_data_events(time_limit=0)  # dispatches the basic.return callbacks
            unroutable[:] = sorted(set(self._returned))
            self._returned.clear()

        if messages:
            self._publisher.start()
            self._publisher.call(publish, timeout=self.publish_timeout_s, what=f"publishing {len(messages)} task(s)")
        return unroutable

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
        check_name("worker_id", worker_id)
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

    def dead_letter_count(self, *, timeout_s: float = 2.0) -> int:
        """Messages waiting in `<ns>.dead`, by a passive declare: read-only, it creates nothing. Bounded by
        `timeout_s` (a metrics scrape must not hang on a broker outage): `BusError` after it."""
        self._check_open()
        counts: list[int] = []

        def count() -> None:
            import pika.exceptions as pex

            ch = self._pub_channel
            if ch is None:
                raise pex.ChannelWrongStateError("publisher channel not open")
            counts.append(int(ch.queue_declare(self.topology.dead_queue, passive=True).method.message_count))

        self._publisher.start()
        self._publisher.call(count, timeout=timeout_s, what="reading the dead-letter queue's depth")
        return counts[-1]

    # -- consuming ------------------------------------------------------------------------------

    def consume_tasks(self, worker_id: str, handler: Handler) -> None:
        check_name("worker_id", worker_id)
        self._check_open()
        with self._lock:
            self._workers.add(worker_id)
        queue = self.topology.worker_queue(worker_id)
        self._add_consumer(_AmqpConsumer("tasks", queue, Dispatcher(f"tasks.{worker_id}", handler)))

    def consume_control(self, handler: Handler) -> None:
        self._check_open()
        queue = self.topology.coordinator_queue
        self._add_consumer(_AmqpConsumer("control", queue, Dispatcher("control", handler)))

    def consume_events(self, handler: Handler) -> None:
        self._check_open()
        self._add_consumer(_AmqpConsumer("events", "", Dispatcher("events", handler)))

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
            # Never abandoned: an ack dropped on a live channel would hold its delivery (prefetch 1: the
            # consumer's every later one) until the channel closed. A busy I/O thread settles it late.
            self._consumer.call(settle, timeout=self.settle_timeout_s, what=what, expires=False)
        except BusError as exc:
            log.warning("%s; it runs once the connection's thread is free (if the connection is lost first, the "
                        "broker redelivers the message)", exc)

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
