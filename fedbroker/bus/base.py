"""What both buses share: the `Bus` interface, `Delivery`, broker names, the attempts headers, the handler threads.

Bodies are opaque bytes (serialized envelopes built elsewhere); weights never ride on the bus.
"""

from __future__ import annotations

import collections
import logging
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from fedbroker.errors import ConfigError

log = logging.getLogger(__name__)

# Header carrying how many earlier deliveries of this message failed (classic queues have no counter).
ATTEMPTS_HEADER = "x-fedbroker-attempts"
# Header keeping the routing key the publisher chose, since a retried copy is re-routed by queue name.
ROUTING_KEY_HEADER = "x-fedbroker-routing-key"
# Header of a retried copy naming the broker user that published the original: the copy is republished by the
# consumer's own connection (its own, broker-validated user_id), so the header is believed only on a message
# whose user_id is the consumer's own user (`amqp_consumer`), never on one another user published.
SENDER_HEADER = "x-fedbroker-sender"
CONTROL_ROUTING_KEY = "coordinator"
CONTENT_TYPE = "application/octet-stream"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")  # fullmatch: `$` would pass a trailing newline

Action = Literal["ack", "requeue", "dead"]


def check_name(field: str, value: str) -> str:
    """A namespace, worker id or client name, checked before it becomes part of a broker name."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
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
        """Direct exchange routing each task to its worker's queue by worker id."""
        return f"{self.namespace}.tasks"

    @property
    def control_exchange(self) -> str:
        """Direct exchange for workers' reports to the coordinator."""
        return f"{self.namespace}.control"

    @property
    def events_exchange(self) -> str:
        """Fanout exchange for round events: every subscriber gets its own copy."""
        return f"{self.namespace}.events"

    @property
    def dead_letter_exchange(self) -> str:
        """Where consumer queues send poison messages, so they leave the queue but are kept."""
        return f"{self.namespace}.dlx"

    @property
    def coordinator_queue(self) -> str:
        """The coordinator's durable queue of control messages."""
        return f"{self.namespace}.coordinator"

    @property
    def dead_queue(self) -> str:
        """Durable queue holding dead letters until an operator looks at them."""
        return f"{self.namespace}.dead"

    def worker_queue(self, worker_id: str) -> str:
        """A worker's durable task queue: tasks wait there while the worker is down."""
        return f"{self.namespace}.worker.{worker_id}"


class Delivery:
    """One delivered message, handed to a handler; settle it exactly once with `ack` or `nack`.

    `ack`/`nack` may be called from any thread, long after the handler returned (training runs in
    its own thread). The first settlement wins; later ones are ignored with a warning, so a
    `finally: delivery.nack(...)` safety net cannot undo an ack.
    """

    __slots__ = ("_lock", "_settle", "_settled", "attempts", "body", "message_id", "published_at", "redelivered",
                 "routing_key", "sender")

    def __init__(
        self,
        *,
        body: bytes,
        routing_key: str,
        redelivered: bool,
        attempts: int,
        message_id: str | None,
        settle: Callable[[Action], None],
        sender: str | None = None,
        published_at: float | None = None,
    ) -> None:
        self.body = body
        self.routing_key = routing_key
        self.redelivered = redelivered  # True when this message was delivered before: handle idempotently
        self.attempts = attempts  # 1 on the first delivery
        self.message_id = message_id  # stable across redeliveries: a key for idempotent handling
        # The broker user that published it, as the broker validated it (RabbitMQ refuses a user_id that is not
        # the publishing connection's user); None when unknown (no user_id, or an in-process bus without users).
        self.sender = sender
        self.published_at = published_at  # the publisher's clock (AMQP timestamp, whole seconds); None: not given
        self._settle = settle
        self._lock = threading.Lock()
        self._settled: Action | None = None

    @property
    def settled(self) -> bool:
        """Whether `ack` or `nack` was called, so a safety net settles only what nothing settled."""
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
            f"redelivered={self.redelivered}, message_id={self.message_id!r}, sender={self.sender!r}, "
            f"{len(self.body)} bytes)"
        )


Handler = Callable[[Delivery], None]


class Bus(Protocol):
    """What the services use of a bus; `InProcessBus` and `AmqpBus` keep the same semantics."""

    @property
    def reconnects(self) -> int:
        """Connections re-established after a loss (a Prometheus counter; always 0 in process)."""

    def publish_task(self, worker_id: str, body: bytes) -> None:
        """Persistent, and taken by the broker on return; `Unroutable` when the worker has no queue."""

    def publish_tasks(self, tasks: Sequence[tuple[str, bytes]]) -> list[str]:
        """Every (worker id, body) task persistent, with ONE wait for the broker to take them all; returns
        the worker ids whose task was unroutable (no queue). BusError: none of them may be taken; retry all."""

    def publish_control(self, body: bytes) -> None:
        """A worker's report to the coordinator, persistent and taken by the broker on return."""

    def publish_event(self, body: bytes) -> None:
        """A notification to whoever subscribes now; missed by those who do not (the state store is the truth)."""

    def consume_tasks(self, worker_id: str, handler: Handler) -> None:
        """Hand this worker's tasks to `handler`, one at a time, from `start` on."""

    def consume_control(self, handler: Handler) -> None:
        """Hand the coordinator's control messages to `handler`, one at a time, from `start` on."""

    def consume_events(self, handler: Handler) -> None:
        """Hand the events published from now on to `handler`."""

    def declare_worker(self, worker_id: str) -> None:
        """Create the worker's queue before it connects, so its first tasks are kept, not refused."""

    def dead_letter_count(self, *, timeout_s: float = 2.0) -> int:
        """Poison messages waiting for an operator (a metric); `BusError` past `timeout_s`."""

    def start(self) -> None:
        """Begin delivering to the registered handlers; consumers added later start at once."""

    def wait_ready(self, timeout: float) -> bool:
        """Whether every consumer is consuming within `timeout`: an event subscriber then misses nothing published."""

    def close(self) -> None:
        """Stop delivering (unacked messages go back to their queues) and release the connections."""


def mask_url(url: str) -> str:
    """The URL with its password replaced, safe for logs and error messages.

    Parsed by hand, not with urlsplit: a password holding an unescaped '#', '/' or '?' ends urlsplit's
    authority early and would leave the rest of the password in the "path" or "fragment", in clear.
    The userinfo ends at the LAST '@' (a password may hold '@' too); everything before it after the
    first ':' is masked. An '@' later in the URL (a vhost) only masks more than needed, never less.
    A comma-separated list (`broker_urls`) is masked item by item when every item is a URL or a bare host:port;
    otherwise (a ',' in a password) as one URL, which masks more, never less.
    """
    if "," in url:
        items = url.split(",")
        if all("://" in item or _HOST_PORT.fullmatch(item.strip()) for item in items):
            return ",".join(_mask_one(item) for item in items)
    return _mask_one(url)


def _mask_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    at = rest.rfind("@")
    if at < 0:
        return url
    user, colon, _password = rest[:at].partition(":")
    if not colon:  # a user name without a password
        return url
    return f"{scheme}{sep}{user}:***@{rest[at + 1:]}"


_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252})(:[0-9]{1,5})?")


def broker_urls(url: str) -> tuple[str, ...]:
    """The broker addresses a `broker.url` names: one URL, or a cluster's nodes separated by commas. An item with
    no `://` is `host[:port]` and reuses the first URL's scheme, credentials, virtual host and options, so the
    password is written once. Items are never echoed in an error (a ',' left unescaped in a password would
    split it into one)."""
    items = [item.strip() for item in url.split(",")]
    if not items or not items[0] or "://" not in items[0]:
        raise ConfigError("broker.url", "must start with an amqp:// or amqps:// URL")
    first = items[0]
    scheme, _, rest = first.partition("://")
    at = rest.rfind("@")
    userinfo, location = rest[: at + 1], rest[at + 1:]
    cut = min((i for i in (location.find("/"), location.find("?")) if i >= 0), default=len(location))
    tail = location[cut:]  # the virtual host and options every bare host:port item shares
    out = [first]
    for number, item in enumerate(items[1:], start=2):
        if "://" in item:
            out.append(item)
        elif _HOST_PORT.fullmatch(item):
            out.append(f"{scheme}://{userinfo}{item}{tail}")
        else:
            raise ConfigError("broker.url", f"item {number} of the comma-separated list is neither an amqp(s):// URL "
                                            f"nor host:port (a ',' in a password must be percent-encoded as %2C)")
    return tuple(out)


def check_url(url: str) -> str:
    """A broker URL whose user name and password the URL parsers read as written: an unescaped '#', '/'
    or '?' in them would end the authority early (the broker would see a truncated password, or a port
    made of its tail), so it is refused here, naming the fix and never showing the password. A comma-separated
    list (`broker_urls`) is checked item by item."""
    if "," in url:
        for item in broker_urls(url):
            check_url(item)
        return url
    _scheme, sep, rest = url.partition("://")
    userinfo = rest[: rest.rfind("@")] if sep and "@" in rest else ""
    bad = sorted({c for c in userinfo if c in "#/?"})
    if bad:
        raise ConfigError("broker.url", f"{mask_url(url)}: the user name or password holds unescaped "
                                        f"{' '.join(repr(c) for c in bad)}; percent-encode them (e.g. '#' as %23, "
                                        f"'/' as %2F, '?' as %3F)")
    return url


def check_max_attempts(max_attempts: int) -> int:
    """`max_attempts` as both buses need it: at least one delivery before a message is dead-lettered."""
    if not isinstance(max_attempts, int) or isinstance(max_attempts, bool) or max_attempts < 1:
        raise ConfigError("max_attempts", f"must be an integer >= 1, got {max_attempts!r}")
    return max_attempts


class Dispatcher:
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
        """Start the handler thread once; deliveries put before wait in the inbox."""
        if not self._started:
            self._started = True
            self._thread.start()

    def put(self, delivery: Delivery) -> None:
        """Queue a delivery for the handler (called on the I/O thread, which must never wait on a handler)."""
        with self._cond:
            self._inbox.append(delivery)
            self._cond.notify()

    def withdraw(self, message_id: str | None) -> Delivery | None:
        """Take back a delivery of `message_id` that waits in the inbox, never seen by the handler (None when
        there is none): the broker redelivered it (its channel closed under it), and the copy replaces it."""
        if message_id is None:
            return None
        with self._cond:
            for delivery in self._inbox:
                if delivery.message_id == message_id:
                    self._inbox.remove(delivery)
                    return delivery
        return None

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
