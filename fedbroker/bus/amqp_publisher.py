"""The publishing half of `AmqpBus`: its own connection, since RabbitMQ throttles publishing connections
and that must never stall a consumer's acks.

Every message is persistent and confirmed: a publish returns once the broker has taken it (written to disk)
or raises, so a caller never believes a message sent that the broker does not hold.

Every message carries `user_id`, the connection's user: RabbitMQ refuses (closes the channel on) a message whose
user_id is not the publishing connection's user, so a consumer knows who published what it receives
(deploy/SECURITY.md, "What binds each bus message to an identity").
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

from fedbroker.bus.amqp_link import Link, LinkSettings, broker_version
from fedbroker.bus.amqp_quorum import RETRY_PAUSE_S, Batch, ConfirmChannel
from fedbroker.bus.amqp_topology import TopologyDeclarer
from fedbroker.bus.base import CONTENT_TYPE
from fedbroker.errors import BusError, Unroutable


class Publisher:
    """Publishes from any thread through one connection's I/O thread: the caller waits for the confirm, no
    connection is touched by two threads, and an idle publisher still answers heartbeats.

    Two channels per connection: one in confirm mode for single messages and declarations, one in transaction
    mode for batches of tasks (`publish_tasks`). With quorum queues a batch goes on a fresh confirm channel
    instead, and a nacked message is sent again on a fresh channel until the deadline (`amqp_quorum`: why).
    """

    def __init__(self, settings: LinkSettings, topology: TopologyDeclarer, *, timeout_s: float) -> None:
        self.topology = topology
        self.timeout_s = timeout_s  # how long a call retries through an outage before BusError
        self.user = settings.user
        self._channel: Any = None
        self._batch_channel: Any = None
        self._conn: Any = None
        self._quorum_channels: dict[str, ConfirmChannel] = {}  # the kept batch confirm channel (quorum queues)
        self._returned: list[str] = []  # routing keys of tasks a batch got back unroutable (I/O thread only)
        self.link = Link(role="publisher", settings=settings, on_connect=self._on_connect,
                         on_disconnect=self._on_disconnect)

    def _on_connect(self, conn: Any) -> None:
        self.topology.broker_version = broker_version(conn)
        ch = conn.channel()
        ch.confirm_delivery()
        self.topology.declare(ch)
        self._channel = ch
        batch = conn.channel()  # publish_tasks: a transaction, committed once per batch
        batch.tx_select()
        batch.add_on_return_callback(lambda _ch, method, _props, _body: self._returned.append(method.routing_key))
        self._batch_channel = batch
        self._conn = conn

    def _on_disconnect(self) -> None:
        self._quorum_channels.clear()
        self._channel = None
        self._batch_channel = None
        self._conn = None

    def _properties(self) -> Any:
        import pika

        return pika.BasicProperties(
            delivery_mode=pika.DeliveryMode.Persistent,
            content_type=CONTENT_TYPE,
            message_id=uuid.uuid4().hex,
            timestamp=int(time.time()),
            app_id=self.topology.names.namespace,
            user_id=self.user or None,
        )

    def _confirm_channel(self) -> Any:
        import pika.exceptions as pex

        if self._channel is None:
            raise pex.ChannelWrongStateError("publisher channel not open")
        return self._channel

    def publish(self, exchange: str, routing_key: str, body: bytes, *, mandatory: bool, what: str) -> None:
        """One persistent message, confirmed; `Unroutable` when `mandatory` and no queue is bound for it."""
        import pika.exceptions as pex

        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise TypeError(f"body must be bytes, got {type(body).__name__}")
        properties = self._properties()
        payload = bytes(body)

        deadline = time.monotonic() + self.timeout_s

        def publish() -> None:
            while True:
                ch = self._confirm_channel()
                try:
                    ch.basic_publish(exchange, routing_key, payload, properties, mandatory=mandatory)
                    return
                except pex.UnroutableError as exc:
                    raise Unroutable(
                        f"{what} is unroutable: no queue bound for routing key {routing_key!r} on {exchange}"
                    ) from exc
                except pex.NackError as exc:
                    if not self.topology.quorum or time.monotonic() >= deadline:
                        raise BusError(f"broker refused (nacked) {what}") from exc
                self._fresh_confirm_channel()  # a quorum queue's stale leader on this channel (amqp_quorum)

        self.link.start()
        self.link.call(publish, timeout=self.timeout_s, what=f"publishing {what}")

    def publish_tasks(self, tasks: Sequence[tuple[str, bytes]]) -> list[str]:
        """Persistent tasks (worker id, body) published in one AMQP transaction: N publishes and one tx.commit,
        so the broker's answer is awaited once for the batch instead of once per task (one confirm each). The
        commit returns when the broker has taken every message (persistent ones written to disk, as a confirm
        would wait for); unroutable ones come back as basic.return frames before commit-ok, and their worker
        ids are returned. `bench/control_plane.py` measures this against a confirm channel with all the batch
        outstanding."""
        import pika.exceptions as pex

        exchange = self.topology.names.tasks_exchange
        messages = [(worker_id, bytes(body), self._properties()) for worker_id, body in tasks]
        unroutable: list[str] = []

        def publish() -> None:
            ch, conn = self._batch_channel, self._conn
            if ch is None or conn is None:
                raise pex.ChannelWrongStateError("publisher channel not open")
            self._returned.clear()
            for worker_id, payload, properties in messages:
                ch.basic_publish(exchange, worker_id, payload, properties, mandatory=True)
            ch.tx_commit()
            conn.process_data_events(time_limit=0)  # dispatches the basic.return callbacks
            unroutable[:] = sorted(set(self._returned))
            self._returned.clear()

        what = f"publishing {len(messages)} task(s)"
        if messages and self.topology.quorum:
            batch, deadline = Batch(messages), time.monotonic() + self.timeout_s

            def publish_confirmed() -> None:
                if self._conn is None:
                    raise pex.ChannelWrongStateError("publisher connection not open")
                unroutable[:] = batch.publish(self._conn, exchange, self._quorum_channels, deadline=deadline,
                                              what=what)

            self.link.start()
            self.link.call(publish_confirmed, timeout=self.timeout_s, what=what)
        elif messages:
            self.link.start()
            self.link.call(publish, timeout=self.timeout_s, what=what)
        return unroutable

    def _fresh_confirm_channel(self) -> None:
        """Replace the confirm channel after a pause (on the I/O thread), so the next publish meets the queue's
        current leader."""
        conn = self._conn
        if conn is None:
            return
        conn.process_data_events(time_limit=RETRY_PAUSE_S)
        old, self._channel = self._channel, None
        ch = conn.channel()
        ch.confirm_delivery()
        self._channel = ch
        if old is not None and old.is_open:
            old.close()

    def declare_worker(self, worker_id: str) -> None:
        """Create the worker's durable queue now (and on every reconnect), so tasks published before the
        worker connects are kept."""
        self.topology.add_worker(worker_id)

        def declare() -> None:
            self.topology.declare_worker(self._confirm_channel(), worker_id)

        self.link.start()
        self.link.call(declare, timeout=self.timeout_s, what=f"declaring the queue of worker {worker_id!r}")

    def dead_letter_count(self, *, timeout_s: float) -> int:
        """Messages waiting in the dead-letter queue, by a passive declare: read-only, it creates nothing."""
        counts: list[int] = []

        def count() -> None:
            ch = self._confirm_channel()
            counts.append(int(ch.queue_declare(self.topology.names.dead_queue, passive=True).method.message_count))

        self.link.start()
        self.link.call(count, timeout=timeout_s, what="reading the dead-letter queue's depth")
        return counts[-1]

    def stop(self) -> None:
        """Close the publishing connection once the publishes already handed over went out."""
        self.link.stop()
