"""The bus inside one process (`InProcessBus`): the embedded demo and the tests need no broker.

`MemoryBroker` stands in for RabbitMQ with the same semantics as `AmqpBus`: a queue per worker, one for the
coordinator, one per event subscriber, prefetch 1, attempts counted per message, dead letters kept.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

from fedbroker.bus.base import (
    CONTROL_ROUTING_KEY,
    Action,
    Delivery,
    Dispatcher,
    Handler,
    Topology,
    check_max_attempts,
    check_name,
)
from fedbroker.errors import BusError, Unroutable

log = logging.getLogger(__name__)


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
    sender: str | None = None  # the publishing bus's user (AmqpBus: the broker-validated user_id)
    published_at: float = field(default_factory=time.time)


class _MemConsumer:
    def __init__(self, dispatcher: Dispatcher, max_attempts: int) -> None:
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
        """The namespace's broker, created on first use: buses of one namespace meet as on one RabbitMQ."""
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
        """The named queue, created if missing (idempotent, as a durable queue_declare)."""
        with self.lock:
            return self.queues.setdefault(name, _MemQueue(name))

    def ready_count(self, queue: str) -> int:
        """Messages waiting in `queue` (not counting the ones delivered and unacked)."""
        with self.lock:
            q = self.queues.get(queue)
            return len(q.ready) if q else 0

    def enqueue(self, q: _MemQueue, message: _MemMessage) -> None:
        """Append a message and hand it on at once if a consumer is free."""
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
                        sender=message.sender,
                        published_at=message.published_at,
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
    attempt is counted, as RabbitMQ redelivery is counted by `AmqpBus`). `user`: the broker user this bus
    stands for (its messages' `Delivery.sender`, as RabbitMQ's validated user_id); None: no users.
    """

    def __init__(
        self, *, namespace: str = "fedbroker", max_attempts: int = 5, broker: MemoryBroker | None = None,
        user: str | None = None,
    ) -> None:
        self.topology = Topology(check_name("namespace", namespace))
        self.user = user
        self.max_attempts = check_max_attempts(max_attempts)
        self.broker = broker or MemoryBroker.for_namespace(namespace)
        self.reconnects = 0
        self._lock = threading.Lock()
        self._consumers: list[tuple[_MemQueue, _MemConsumer]] = []
        self._own_event_queues: list[_MemQueue] = []
        self._started = False
        self._closed = False

    @property
    def dead(self) -> list[DeadLetter]:
        """The dead letters of this namespace, for tests and the demo to inspect."""
        return self.broker.dead

    def dead_letter_count(self, *, timeout_s: float = 2.0) -> int:
        """Messages in the dead-letter queue (read-only; `timeout_s` is for `AmqpBus`'s sake)."""
        with self.broker.lock:
            return len(self.broker.dead)

    def _check_open(self) -> None:
        if self._closed:
            raise BusError("bus is closed")

    def _message(self, body: bytes, routing_key: str) -> _MemMessage:
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise TypeError(f"body must be bytes, got {type(body).__name__}")
        return _MemMessage(bytes(body), routing_key, uuid.uuid4().hex, sender=self.user)

    def publish_task(self, worker_id: str, body: bytes) -> None:
        """Queued for the worker; `Unroutable` when it has no queue, as `AmqpBus` (mandatory publish)."""
        self._check_open()
        check_name("worker_id", worker_id)
        with self.broker.lock:
            q = self.broker.queues.get(self.topology.worker_queue(worker_id))
            if q is None:
                raise Unroutable(
                    f"task for worker {worker_id!r} is unroutable: no queue for that worker (declare_worker first)"
                )
            self.broker.enqueue(q, self._message(body, worker_id))

    def publish_tasks(self, tasks: Sequence[tuple[str, bytes]]) -> list[str]:
        """Each task queued (the in-process broker takes them as they come); the unroutable ones' worker ids."""
        self._check_open()
        unroutable = []
        for worker_id, body in tasks:
            try:
                self.publish_task(worker_id, body)
            except Unroutable:
                unroutable.append(worker_id)
        return unroutable

    def publish_control(self, body: bytes) -> None:
        """Queued for the coordinator."""
        self._check_open()
        q = self.broker.declare(self.topology.coordinator_queue)
        self.broker.enqueue(q, self._message(body, CONTROL_ROUTING_KEY))

    def publish_event(self, body: bytes) -> None:
        """A copy to every current subscriber; none is not an error."""
        self._check_open()
        message = self._message(body, "")
        with self.broker.lock:
            for q in list(self.broker.event_queues):
                self.broker.enqueue(q, _MemMessage(message.body, "", message.message_id, sender=self.user))

    def declare_worker(self, worker_id: str) -> None:
        """Create the worker's queue, so tasks published before it consumes are kept."""
        self._check_open()
        self.broker.declare(self.topology.worker_queue(check_name("worker_id", worker_id)))

    def consume_tasks(self, worker_id: str, handler: Handler) -> None:
        """Hand this worker's tasks to `handler` from `start` on."""
        self.declare_worker(worker_id)
        self._consume(self.broker.declare(self.topology.worker_queue(worker_id)), handler)

    def consume_control(self, handler: Handler) -> None:
        """Hand the coordinator's control messages to `handler` from `start` on."""
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
        consumer = _MemConsumer(Dispatcher(q.name, handler), self.max_attempts)
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
        """Begin delivering to the registered handlers (consumers added later start at once)."""
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
        """Return unacked messages to their queues (an attempt counted) and drop this bus's event queues."""
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
