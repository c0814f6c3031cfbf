"""The broker side of `Topology`: the durable exchanges and queues an `AmqpBus` declares on every connect, so
a broker that lost them (a fresh node, a deleted queue) gets them back before anything is published or consumed.

Consumer queues dead-letter into `<ns>.dlx` → `<ns>.dead`, where poison messages wait for an operator.

A worker's task queue, and its consumer, carry `x-consumer-timeout` (the deployment's `broker.consumer_timeout_s`)
so that the timeout RabbitMQ applies to a held task is the one the coordinator keeps every round inside, whatever
the broker's own `consumer_timeout`: RabbitMQ honours it from 3.12 (the consumer's argument first, then the
queue's), and 3.10 and 3.11 accept and ignore it. From 4.3 classic queues have no consumer timeout at all
(RabbitMQ's consumer_timeouts.md), so the argument is left out there rather than risk a refused declaration.

`queue_type="quorum"` (a RabbitMQ cluster, deploy/RELIABILITY.md) declares the coordinator's, the workers' and
the dead-letter queue as quorum queues (Raft-replicated on every node, so one node's loss loses no message): the
consumer queues with the broker's delivery limit (`x-delivery-limit` = max_attempts - 1 redeliveries, the broker
dead-letters the next) and at-least-once dead-lettering (`x-dead-letter-strategy`, which RabbitMQ allows only
with `x-overflow: reject-publish`), so a poison message reaches `<ns>.dead` even across a node loss. Quorum queues
take `x-consumer-timeout` as classic ones do. RabbitMQ refuses a re-declaration whose queue type or these
arguments differ (PRECONDITION_FAILED, closing the channel): a quorum queue is therefore declared on a channel of
its own, and one that exists with other arguments (another `max_attempts`, a site's config that differs) keeps
them, with a warning; the consumer still dead-letters past its own `max_attempts` (`amqp_consumer`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from fedbroker.bus.base import CONTROL_ROUTING_KEY, Topology
from fedbroker.errors import ConfigError

log = logging.getLogger(__name__)

PRECONDITION_FAILED = 406
CONSUMER_TIMEOUT_ARGUMENT = "x-consumer-timeout"
HONOURED_FROM = (3, 12)   # the first RabbitMQ that applies a queue's (and a consumer's) x-consumer-timeout
SENT_BEFORE = (4, 3)      # the first that has no consumer timeout on classic queues: the argument is not sent
QUEUE_TYPES = ("classic", "quorum")


class TopologyDeclarer:
    """Declares the namespace's topology on a channel, worker queues included: a worker queue declared once
    (by the coordinator or the worker) is re-declared on every later connect of either connection."""

    def __init__(self, names: Topology, *, consumer_timeout_s: float | None = None, queue_type: str = "classic",
                 max_attempts: int = 5) -> None:
        if queue_type not in QUEUE_TYPES:
            raise ConfigError("broker.queue_type", f"must be one of {', '.join(QUEUE_TYPES)}, got {queue_type!r}")
        self.names = names
        self.consumer_timeout_s = consumer_timeout_s  # None: the broker's own consumer_timeout applies
        self.queue_type = queue_type
        self.max_attempts = max_attempts  # deliveries of a message before it is dead-lettered
        self.broker_version: tuple[int, ...] | None = None  # as the last connection's server announced it
        self._lock = threading.Lock()
        self._workers: set[str] = set()  # worker queues to re-declare on every connect

    @property
    def quorum(self) -> bool:
        """Whether the queues are quorum queues: the broker counts deliveries (`x-delivery-count`) and dead-letters."""
        return self.queue_type == "quorum"

    def _consumer_timeout(self) -> dict[str, int]:
        """`x-consumer-timeout` in milliseconds, where it is set and the broker is one it may be sent to."""
        if self.consumer_timeout_s is None or (self.broker_version is not None and self.broker_version >= SENT_BEFORE):
            return {}
        return {CONSUMER_TIMEOUT_ARGUMENT: round(self.consumer_timeout_s * 1000)}

    @property
    def consumer_timeout_honoured(self) -> bool:
        """Whether the broker applies our `consumer_timeout_s` to task deliveries (RabbitMQ 3.12 to 4.2): then
        it is the timeout the broker really applies; otherwise its own `consumer_timeout` is (unknown unless
        the deployment says it, since it cannot be read over AMQP)."""
        version = self.broker_version
        return bool(self._consumer_timeout()) and version is not None and version >= HONOURED_FROM

    @property
    def task_consumer_arguments(self) -> dict[str, int]:
        """A task consumer's arguments: the consumer timeout (which takes precedence over the queue's)."""
        return self._consumer_timeout()

    @property
    def dead_lettering(self) -> dict[str, str]:
        """Queue arguments that route a message nacked without requeue to the dead-letter exchange (also those
        of an events subscriber's exclusive queue, which stays classic: quorum queues cannot be exclusive)."""
        return {"x-dead-letter-exchange": self.names.dead_letter_exchange}

    def consumer_queue_arguments(self) -> dict[str, str | int]:
        """The arguments of the coordinator's and the workers' queues (the consumer timeout aside)."""
        if not self.quorum:
            return dict(self.dead_lettering)
        return {**self.dead_lettering, "x-queue-type": "quorum", "x-delivery-limit": self.max_attempts - 1,
                "x-dead-letter-strategy": "at-least-once", "x-overflow": "reject-publish"}

    def add_worker(self, worker_id: str) -> None:
        """Remember a worker's queue, so every later connect declares it (called from any thread)."""
        with self._lock:
            self._workers.add(worker_id)

    def declare(self, ch: Any) -> None:
        """Everything, idempotently: the dead-letter pair, the three exchanges, the coordinator's and the
        known workers' queues."""
        t = self.names
        ch.exchange_declare(t.dead_letter_exchange, exchange_type="fanout", durable=True)
        ch.queue_declare(t.dead_queue, durable=True, arguments={"x-queue-type": "quorum"} if self.quorum else None)
        ch.queue_bind(t.dead_queue, t.dead_letter_exchange)
        ch.exchange_declare(t.tasks_exchange, exchange_type="direct", durable=True)
        ch.exchange_declare(t.control_exchange, exchange_type="direct", durable=True)
        ch.exchange_declare(t.events_exchange, exchange_type="fanout", durable=True)
        self._declare_queue(ch, t.coordinator_queue, t.control_exchange, CONTROL_ROUTING_KEY)
        with self._lock:
            workers = sorted(self._workers)
        for worker_id in workers:
            self.declare_worker(ch, worker_id)

    def declare_worker(self, ch: Any, worker_id: str) -> None:
        """The worker's durable queue, bound to the tasks exchange by its id (the routing key of its tasks), with
        the consumer timeout (RabbitMQ does not compare this argument when a queue is declared again: a queue
        declared before keeps its own, which the consumer's argument overrides)."""
        t = self.names
        self._declare_queue(ch, t.worker_queue(worker_id), t.tasks_exchange, worker_id, self._consumer_timeout())

    def _declare_queue(self, ch: Any, queue: str, exchange: str, routing_key: str,
                       extra: dict[str, int] | None = None) -> None:
        arguments = {**self.consumer_queue_arguments(), **(extra or {})}
        if self.quorum:
            self._declare_apart(ch, queue, arguments)
        else:
            ch.queue_declare(queue, durable=True, arguments=arguments)
        ch.queue_bind(queue, exchange, routing_key=routing_key)

    def _declare_apart(self, ch: Any, queue: str, arguments: dict[str, Any]) -> None:
        """Declare on a channel of its own, which a refusal (the queue exists with other arguments) may close."""
        import pika.exceptions as pex

        probe = ch.connection.channel()
        try:
            probe.queue_declare(queue, durable=True, arguments=arguments)
        except pex.ChannelClosedByBroker as exc:
            if exc.reply_code != PRECONDITION_FAILED:
                raise
            log.warning("queue %s exists with other arguments, which it keeps (%s); change them by a policy or by "
                        "deleting the queue", queue, exc.reply_text)
            return
        probe.close()


def declared_names(names: Topology, worker_ids: Sequence[str]) -> tuple[list[str], list[str]]:
    """(queues, exchanges) that `TopologyDeclarer` declares for a namespace and these workers: what a teardown
    removes. The events subscribers' queues are left out: they are exclusive and go with their connection."""
    queues = [names.coordinator_queue, names.dead_queue, *(names.worker_queue(w) for w in worker_ids)]
    exchanges = [names.tasks_exchange, names.control_exchange, names.events_exchange, names.dead_letter_exchange]
    return queues, exchanges


def delete_topology(url: str, namespace: str, worker_ids: Sequence[str]) -> None:
    """Remove a namespace's queues and exchanges from RabbitMQ (for short-lived demo and test namespaces)."""
    import pika

    queues, exchanges = declared_names(Topology(namespace), worker_ids)
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        for queue in queues:
            channel.queue_delete(queue)
        for exchange in exchanges:
            channel.exchange_delete(exchange)
    finally:
        connection.close()
