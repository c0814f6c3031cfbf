"""The bus on RabbitMQ (`AmqpBus`), through pika: durable topology, persistent messages, publisher confirms,
manual acks, prefetch 1, dead-lettering of poison messages and reconnection with jittered backoff.

This module checks the options and joins the parts, each in its own module: the connection kept alive by one
thread (`amqp_link`), the durable topology (`amqp_topology`), publishing (`amqp_publisher`) and consuming
(`amqp_consumer`). pika is imported where it is used, so the in-process bus works without it.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Sequence

from fedbroker.bus.amqp_consumer import Consumers
from fedbroker.bus.amqp_link import LinkSettings, tls_context, url_user
from fedbroker.bus.amqp_publisher import Publisher
from fedbroker.bus.amqp_topology import TopologyDeclarer
from fedbroker.bus.base import (
    CONTROL_ROUTING_KEY,
    Dispatcher,
    Handler,
    Topology,
    broker_urls,
    check_max_attempts,
    check_name,
    check_url,
    mask_url,
)
from fedbroker.errors import BusError, ConfigError
from fedbroker.retry import Backoff

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
    "consumer_timeout_s",
    "queue_type",
}


def _check_positive(field: str, value: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(field, f"must be a number > 0, got {value!r}")
    return float(value)


def _default_client_name(namespace: str) -> str:
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname())[:60] or "host"
    return f"{namespace}:{host}:{os.getpid()}"


class AmqpBus:
    """The bus on RabbitMQ.

    Topology (re-declared on every connect, names from `Topology`): durable direct exchange
    `<ns>.tasks` → durable queue `<ns>.worker.<id>` per worker (routing key = worker id); durable
    direct `<ns>.control` → durable `<ns>.coordinator`; durable fanout `<ns>.events` → one
    exclusive auto-delete queue per subscriber (events during a subscriber's outage are missed:
    they are notifications, the coordinator's state is the truth); durable fanout `<ns>.dlx` →
    durable `<ns>.dead`. Consumer queues dead-letter into `<ns>.dlx`.

    Threading: two connections, each owned by its own I/O thread (`Link`): one publishes (`Publisher`),
    one consumes (`Consumers`) — RabbitMQ throttles publishing connections, which must never stall acks.

    A failed delivery is retried with an attempts header, republished through its queue's own exchange (what a
    provisioned participant may write), and dead-lettered at `max_attempts` (see `amqp_consumer`): a handler sees a message at most `max_attempts` times, and must be idempotent.
    Ack late, after the result is durable. RabbitMQ's `consumer_timeout` (30 min by default) must
    exceed the longest round, or the broker closes the channel and redelivers: `consumer_timeout_s` sets it
    on every task queue and task consumer (`x-consumer-timeout`, honoured from RabbitMQ 3.12), so the broker
    applies the deployment's value (`consumer_timeout_honoured`).

    Every message is published with `user_id` = the URL's user, which RabbitMQ validates; a delivery's
    `sender` is the user that published it (deploy/SECURITY.md).

    Options: `max_attempts` (deliveries before dead-lettering); `reconnect_initial_s`,
    `reconnect_max_s` (backoff); `publish_timeout_s` (how long a publish retries through an outage
    before `BusError`; also pika's `blocked_connection_timeout`); `heartbeat_s` (unless the URL
    sets `heartbeat=`); `client_name` (prefix of the `connection_name` shown by RabbitMQ);
    `settle_timeout_s` (how long `ack`/`nack` wait for the I/O thread). Credentials come from the URL;
    logs show it with the password masked. TLS: an `amqps://` URL, verified against `ca_file` (default:
    the system's CAs) for the URL's host name, with `cert_file`/`key_file` as a client certificate.

    A cluster: `url` lists its nodes separated by commas (`amqp://u:p@h1:5672/%2F,h2:5672,h3:5672`: a bare
    host:port reuses the first URL's credentials, virtual host and options; every node logs in as one user, the
    user_id of every message). Each connection fails over to the next node when its node is lost: publishes not
    yet confirmed are sent again there (with the same message_id, so a consumer may see one twice), consumers
    subscribe again, and the settlements of the lost connection's deliveries are dropped (the broker redelivers
    those). `queue_type="quorum"` declares quorum queues, replicated on every node (see `amqp_topology`).
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
        consumer_timeout_s: float | None = None,
        queue_type: str = "classic",
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
            client_name = _default_client_name(namespace)
        else:
            check_name("client_name", client_name)
        if consumer_timeout_s is not None:
            consumer_timeout_s = _check_positive("consumer_timeout_s", consumer_timeout_s)
        self.masked_url = mask_url(check_url(url))
        users = {url_user(node) for node in broker_urls(url)}
        if len(users) > 1:
            raise ConfigError("broker.url", "every broker address must log in as the same user (each message's "
                                            "user_id is checked against its connection's user)")
        self.user = users.pop()
        settings = LinkSettings(
            url=url, client_name=client_name, heartbeat_s=heartbeat, blocked_timeout_s=self.publish_timeout_s,
            reconnect=Backoff(initial_s=initial, max_s=maximum),
            tls=tls_context(url, ca_file=ca_file, cert_file=cert_file, key_file=key_file), user=self.user,
        )
        declarer = TopologyDeclarer(self.topology, consumer_timeout_s=consumer_timeout_s, queue_type=queue_type,
                                    max_attempts=self.max_attempts)
        self._lock = threading.Lock()
        self._closed = False
        self._publisher = Publisher(settings, declarer, timeout_s=self.publish_timeout_s)
        self._consumer = Consumers(settings, declarer, max_attempts=self.max_attempts,
                                   settle_timeout_s=self.settle_timeout_s, timeout_s=self.publish_timeout_s)
        self._declarer = declarer

    @property
    def reconnects(self) -> int:
        """Connections re-established after a loss, both links together (a Prometheus counter)."""
        return self._publisher.link.reconnects + self._consumer.link.reconnects

    @property
    def broker_version(self) -> tuple[int, ...] | None:
        """The RabbitMQ version the last connection announced (None before the first connect)."""
        return self._declarer.broker_version

    @property
    def consumer_timeout_honoured(self) -> bool:
        """Whether the broker applies `consumer_timeout_s` to task deliveries (known once connected)."""
        return self._declarer.consumer_timeout_honoured

    @property
    def connection_names(self) -> tuple[str, str]:
        """`connection_name` client properties of the publisher and consumer connections."""
        return self._publisher.link.connection_name, self._consumer.link.connection_name

    def _check_open(self) -> None:
        if self._closed:
            raise BusError("bus is closed")

    # -- publishing -----------------------------------------------------------------------------

    def publish_task(self, worker_id: str, body: bytes) -> None:
        """Persistent and confirmed; `BusError` when no queue exists for the worker (mandatory)."""
        check_name("worker_id", worker_id)
        self._check_open()
        self._publisher.publish(self.topology.tasks_exchange, worker_id, body, mandatory=True,
                                what=f"task for worker {worker_id!r}")

    def publish_tasks(self, tasks: Sequence[tuple[str, bytes]]) -> list[str]:
        """Persistent tasks with one wait for the broker (a transaction); the unroutable worker ids back."""
        self._check_open()
        for worker_id, _ in tasks:
            check_name("worker_id", worker_id)
        return self._publisher.publish_tasks(tasks)

    def publish_control(self, body: bytes) -> None:
        """Persistent and confirmed, to the coordinator's queue; mandatory, so a missing queue is an error."""
        self._check_open()
        self._publisher.publish(self.topology.control_exchange, CONTROL_ROUTING_KEY, body, mandatory=True,
                                what="control message")

    def publish_event(self, body: bytes) -> None:
        """Fanout; not mandatory, since an event with no subscriber is not an error."""
        self._check_open()
        self._publisher.publish(self.topology.events_exchange, "", body, mandatory=False, what="event")

    def declare_worker(self, worker_id: str) -> None:
        """Create the worker's durable queue now, so tasks published before it connects are kept."""
        self._check_open()
        check_name("worker_id", worker_id)
        self._publisher.declare_worker(worker_id)

    def dead_letter_count(self, *, timeout_s: float = 2.0) -> int:
        """Messages waiting in `<ns>.dead`, read-only. Bounded by `timeout_s` (a metrics scrape must not hang
        on a broker outage): `BusError` after it."""
        self._check_open()
        return self._publisher.dead_letter_count(timeout_s=timeout_s)

    # -- consuming ------------------------------------------------------------------------------

    def consume_tasks(self, worker_id: str, handler: Handler) -> None:
        """Hand this worker's tasks to `handler`; its queue joins the topology declared on every connect."""
        check_name("worker_id", worker_id)
        self._check_open()
        self._declarer.add_worker(worker_id)
        queue = self.topology.worker_queue(worker_id)
        self._consumer.add("tasks", queue, Dispatcher(f"tasks.{worker_id}", handler),
                           route=(self.topology.tasks_exchange, worker_id))

    def consume_control(self, handler: Handler) -> None:
        """Hand the coordinator's control messages (worker reports) to `handler`."""
        self._check_open()
        self._consumer.add("control", self.topology.coordinator_queue, Dispatcher("control", handler),
                           route=(self.topology.control_exchange, CONTROL_ROUTING_KEY))

    def consume_events(self, handler: Handler) -> None:
        """Hand every event published from now on to `handler`, through a queue of this subscriber's own."""
        self._check_open()
        self._consumer.add("events", "", Dispatcher("events", handler))

    def start(self) -> None:
        """Begin delivering to the registered handlers (consumers added later start at once)."""
        self._check_open()
        self._consumer.start()

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every registered consumer is consuming (e.g. an event subscription exists)."""
        return self._consumer.wait_ready(timeout)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop consuming (unacked messages go back to their queues), then the publisher. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._consumer.stop()
        self._publisher.stop()

    def __enter__(self) -> AmqpBus:
        """Close on leaving the block, so a failing test or demo leaves no connection behind."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the bus (see `close`)."""
        self.close()
