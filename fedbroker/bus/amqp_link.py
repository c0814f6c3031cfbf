"""One RabbitMQ connection kept alive by its own thread (`Link`): pika is not thread-safe, so every other
thread hands work to the connection's thread (`PendingCall`) and waits for it with a deadline.

The thread reconnects with capped, jittered backoff and keeps heartbeats going while handlers train for
minutes. pika is imported where it is used, so the in-process bus works without it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fedbroker.bus.amqp_problem import ProblemLog
from fedbroker.bus.base import broker_urls, mask_url
from fedbroker.errors import BusError, ConfigError
from fedbroker.retry import Backoff

log = logging.getLogger(__name__)


def tls_context(url: str, *, ca_file: str, cert_file: str, key_file: str) -> ssl.SSLContext | None:
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


def _noop() -> None:
    pass


@dataclass(frozen=True)
class LinkSettings:
    """What every connection of one bus shares, checked once by the bus, so its two links connect alike."""

    url: str  # one broker URL, or a cluster's nodes separated by commas (`broker_urls`)
    client_name: str  # prefix of the connection_name RabbitMQ shows, the link's role appended
    heartbeat_s: float  # unless the URL sets heartbeat=
    blocked_timeout_s: float  # unless the URL sets blocked_connection_timeout=
    reconnect: Backoff
    tls: ssl.SSLContext | None = None
    user: str = ""  # the URL's user name: every message is published with it as its (broker-validated) user_id
    problems: ProblemLog = field(default_factory=ProblemLog, compare=False)  # both links say a problem once


def url_user(url: str) -> str:
    """The user name a broker URL logs in with ("" when it names none, e.g. a client certificate's EXTERNAL
    login): the user_id RabbitMQ checks on every message the connection publishes."""
    import pika

    credentials = pika.URLParameters(url).credentials
    return str(getattr(credentials, "username", "") or "")


def broker_version(conn: Any) -> tuple[int, ...] | None:
    """The RabbitMQ version a connection's server announced (its `version` server property), None if it gave
    none: what the broker honours (per-queue consumer timeouts from 3.12) depends on it."""
    properties = getattr(getattr(conn, "_impl", None), "server_properties", None) or {}
    raw = properties.get("version", b"")
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
    numbers = []
    for part in text.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if digits:
            numbers.append(int(digits))
        if not digits or digits != part:  # "0-rc" ends the version
            break
    return tuple(numbers) or None


class PendingCall:
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
        """Take the call to run it on the I/O thread; False when it expired or its caller gave it up."""
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
        """Put a call that failed with the connection back, to run again on the next connection."""
        with self._lock:
            if self._state == "running":
                self._state = "pending"

    def abandon(self, error: BaseException) -> bool:
        """Give up a call that has not started, so it never runs; False when it already runs or ran."""
        with self._lock:
            if self._state != "pending":
                return False
            self._state = "abandoned"
            self._error = error
            self._done.set()
            return True

    def finish(self, error: BaseException | None = None) -> None:
        """Record the outcome and release the waiting caller."""
        with self._lock:
            self._state = "done"
            self._error = error
            self._done.set()

    def wait(self, timeout_error: Callable[[], BaseException]) -> None:
        """Block the caller until the call ran (raising its error) or its deadline passed."""
        while not self._done.wait(min(0.25, max(0.01, self.deadline - time.monotonic()))):
            if time.monotonic() >= self.deadline:
                if not self.expires:
                    raise timeout_error()  # the caller stops waiting; the call still runs
                if self.abandon(timeout_error()):
                    break
        if self._error is not None:
            raise self._error


class Link:
    """One pika `BlockingConnection`, owned and touched by exactly one thread (pika is not thread-safe).

    The thread connects (capped, jittered exponential backoff), calls `on_connect` (topology,
    channels, consumers), then loops on `process_data_events(time_limit=…)`, which services
    heartbeats even while handlers train for minutes, and runs `PendingCall`s queued by other threads
    (woken with `add_callback_threadsafe`). On connection loss it tears down and reconnects;
    calls that were not completed stay queued and run on the next connection unless their
    deadline passed. With several broker addresses (a cluster's nodes) each connect tries the next one: a lost
    node is left for the next at once, and the backoff waits only after every node has failed in a row. The backoff starts over only after a connection held for the longest wait: one the broker
    keeps closing soon after it opens (an operation it refuses on every connect) is retried ever more slowly,
    not twice a second.
    """

    def __init__(
        self,
        *,
        role: str,
        settings: LinkSettings,
        on_connect: Callable[[Any], None],
        on_disconnect: Callable[[], None],
        on_tick: Callable[[Any], None] | None = None,
    ) -> None:
        self.role = role
        self._urls = broker_urls(settings.url)
        self._problems = settings.problems
        self._params = [_connection_parameters(role, settings, url=url) for url in self._urls]
        self._node = 0  # index of the address the current (or next) connection uses
        self._reconnect = settings.reconnect
        self._on_connect = on_connect
        self._on_disconnect = on_disconnect
        self._on_tick = on_tick  # called on the I/O thread after every round of I/O, with the connection
        self._calls: collections.deque[PendingCall] = collections.deque()
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
        """The name RabbitMQ shows for this connection, to find it in the management UI."""
        return str(self._params[0].client_properties["connection_name"])

    @property
    def masked_url(self) -> str:
        """The address the current (or next) connection uses, password masked: for logs and errors."""
        return mask_url(self._urls[self._node])

    @property
    def node(self) -> int:
        """Which of the broker addresses (0-based) the current (or next) connection uses."""
        return self._node

    def start(self) -> None:
        """Start the I/O thread on first use, so a bus that never publishes opens no publisher connection."""
        with self._start_lock:
            if not self._started and not self._stop.is_set():
                self._started = True
                self._thread.start()

    def on_io_thread(self) -> bool:
        """True on the connection's own thread, where pika may be called directly."""
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[[], object], *, timeout: float, what: str, expires: bool = True) -> None:
        """Run `fn` on the I/O thread and wait; connection errors retry it until `timeout`. `expires=False`:
        past `timeout` the caller stops waiting (BusError) but `fn` still runs, late (see `PendingCall`)."""
        if self.on_io_thread():
            fn()
            return
        if self._stop.is_set():
            raise BusError(f"bus is closed; not {what}")
        call = PendingCall(fn, deadline=time.monotonic() + timeout, what=what, expires=expires)
        with self._calls_lock:
            self._calls.append(call)
        self._wake()
        call.wait(lambda: BusError(f"timed out after {timeout:g}s {what}: broker {self.masked_url} unreachable"))

    def stop(self, timeout: float = 10.0) -> None:
        """Close the connection after the calls already handed over; calls still queued then fail."""
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
        up_since = 0.0
        while not self._stop.is_set():
            conn = None
            try:
                conn = pika.BlockingConnection(self._params[self._node])
                self._on_connect(conn)
                self._conn = conn
                self.connected.set()
                self._problems.connected()
                self._log_connected(again=ever_connected)
                ever_connected = True
                up_since = time.monotonic()
                self._serve(conn)
            except _connection_errors() as exc:
                if self.connected.is_set() and time.monotonic() - up_since >= self._reconnect.max_s:
                    failures = 0  # it had held: a new outage starts from the shortest wait
                failures, delay = self._next_node(failures)
                url = self._urls[(self._node - 1) % len(self._urls)]  # the one that failed
                self._problems.failed(self.role, exc, url, connected_before=self.connected.is_set(), delay=delay)
                self._teardown(conn)
                self._stop.wait(delay)
                continue
            except Exception:
                log.exception("bus %s I/O thread failed unexpectedly; reconnecting", self.role)
                self._teardown(conn)
                failures, delay = self._next_node(failures)
                self._stop.wait(delay)
                continue
            self._teardown(conn)

    def _next_node(self, failures: int) -> tuple[int, float]:
        """After a failed or lost connection: move on to the next address; (failures so far, seconds to wait):
        none while an address of this round is untried, the backoff's once all failed in a row."""
        failures += 1
        count = len(self._urls)
        self._node = (self._node + 1) % count
        delay = self._reconnect.delay(failures // count - 1) if failures % count == 0 else 0.0
        return failures, delay

    def _log_connected(self, *, again: bool) -> None:
        if again:
            self.reconnects += 1
            log.info("bus %s reconnected to %s (reconnect #%d)", self.role, self.masked_url, self.reconnects)
        else:
            log.info("bus %s connected to %s", self.role, self.masked_url)

    def _serve(self, conn: Any) -> None:
        while not self._stop.is_set():
            self._drain()
            conn.process_data_events(time_limit=1.0)
            if self._on_tick is not None:
                self._on_tick(conn)
        self._drain()  # acks and publishes handed over before close() still go out

    def _teardown(self, conn: Any) -> None:
        self._conn = None
        self.connected.clear()
        self._on_disconnect()
        if conn is not None and conn.is_open:
            try:
                conn.close()
            except Exception as exc:
                log.debug("bus %s: closing the connection failed: %s", self.role, exc)


def _connection_parameters(role: str, settings: LinkSettings, *, url: str | None = None) -> Any:
    """pika's parameters from the URL (`url`, else the first of the settings' addresses); the URL's own query
    options win over the bus's settings."""
    import pika

    url = url if url is not None else broker_urls(settings.url)[0]
    params = pika.URLParameters(url)
    query = parse_qs(urlsplit(url).query)
    if params.ssl_options is not None and "ssl_options" not in query:
        # pika's own amqps:// default checks host names but gives no host name to check (every handshake
        # fails): verify the broker's certificate for the URL's host, against our CA or the system's.
        params.ssl_options = pika.SSLOptions(settings.tls or ssl.create_default_context(), server_hostname=params.host)
    if "heartbeat" not in query:
        params.heartbeat = math.ceil(settings.heartbeat_s)
    if "blocked_connection_timeout" not in query:
        params.blocked_connection_timeout = settings.blocked_timeout_s
    if "stack_timeout" not in query:
        # pika gives TCP + TLS + AMQP handshake 15 s, then starts over: on a loaded machine a handshake that
        # needs longer never completes, and the calls waiting on it fail. As long as a call waits, at least.
        params.stack_timeout = max(params.stack_timeout, settings.blocked_timeout_s)
    params.connection_attempts = 1  # retries are ours, with backoff and logging
    params.client_properties = {"connection_name": f"{settings.client_name}.{role}", "product": "fedbroker"}
    return params
