"""The broker side of `Topology`: the durable exchanges and queues an `AmqpBus` declares on every connect, so
a broker that lost them (a fresh node, a deleted queue) gets them back before anything is published or consumed.

Consumer queues dead-letter into `<ns>.dlx` → `<ns>.dead`, where poison messages wait for an operator.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from fedbroker.bus.base import CONTROL_ROUTING_KEY, Topology


class TopologyDeclarer:
    """Declares the namespace's topology on a channel, worker queues included: a worker queue declared once
    (by the coordinator or the worker) is re-declared on every later connect of either connection."""

    def __init__(self, names: Topology) -> None:
        self.names = names
        self._lock = threading.Lock()
        self._workers: set[str] = set()  # worker queues to re-declare on every connect

    @property
    def dead_lettering(self) -> dict[str, str]:
        """Queue arguments that route a message nacked without requeue to the dead-letter exchange."""
        return {"x-dead-letter-exchange": self.names.dead_letter_exchange}

    def add_worker(self, worker_id: str) -> None:
        """Remember a worker's queue, so every later connect declares it (called from any thread)."""
        with self._lock:
            self._workers.add(worker_id)

    def declare(self, ch: Any) -> None:
        """Everything, idempotently: the dead-letter pair, the three exchanges, the coordinator's and the
        known workers' queues."""
        t = self.names
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
            self.declare_worker(ch, worker_id)

    def declare_worker(self, ch: Any, worker_id: str) -> None:
        """The worker's durable queue, bound to the tasks exchange by its id (the routing key of its tasks)."""
        t = self.names
        self._declare_queue(ch, t.worker_queue(worker_id), t.tasks_exchange, worker_id)

    def _declare_queue(self, ch: Any, queue: str, exchange: str, routing_key: str) -> None:
        ch.queue_declare(queue, durable=True, arguments=self.dead_lettering)
        ch.queue_bind(queue, exchange, routing_key=routing_key)


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
