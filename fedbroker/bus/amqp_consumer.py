"""The consuming half of `AmqpBus`: its own connection, prefetch 1, manual acks handed back to the connection's
thread, and attempt counting that dead-letters a poison message instead of redelivering it forever.

Attempt counting (classic queues have no delivery counter): the header `x-fedbroker-attempts` holds how many
earlier deliveries failed; a delivery's `attempts` is that + 1. A failed delivery — the handler raised or
called `nack(requeue=True)`, or the broker redelivered a message whose consumer died or closed without
settling it (`redelivered` flag) — is republished (confirmed, at the back of the same queue) with the header + 1
and only then is the original acked; when the count reaches `max_attempts` the original is nacked without requeue
and RabbitMQ dead-letters it. A crash between republish and ack can duplicate a message, never lose it: handlers
must be idempotent (`message_id` is stable across retries).

A copy is republished through the exchange that routes to its queue alone (a task through `<ns>.tasks` by its
worker id, a control message through `<ns>.control`), never through the default exchange: a provisioned
participant may write only its project's exchanges (app/fedbroker/app/provision/configs.py `broker_entry`). A
republish the broker refuses anyway (ACCESS_REFUSED: the user's permissions) dead-letters the original, with a
log line naming the user and the exchange, instead of closing the connection: a refusal that reconnected would
be redelivered, refused and reconnected again, for ever.

A redelivery is a failure only of a delivery the handler had: a copy that waited, unseen, behind a busy handler
when the broker closed its channel (a consumer timeout) is replaced by the redelivered one at the same count. A
task whose training outlived the broker's consumer timeout is therefore handled again (its update found
accepted, acked) instead of being counted to the dead-letter queue while it waited.

On quorum queues (`broker.queue_type: quorum`) the broker counts: `x-delivery-count` holds the earlier returned
deliveries of a redelivered message, a failed delivery is nacked with requeue (no copy, no header of ours) and the
queue's `x-delivery-limit` dead-letters it, at least once, after `max_attempts` deliveries. The header is believed
only on a delivery the broker flags as redelivered: on a first delivery it could only be the publisher's (a forged
one). An events subscriber's queue is exclusive, hence classic, and keeps the classic counting.

Who published a delivery (`Delivery.sender`) is its broker-validated `user_id`; a retried copy, republished by
this connection under its own user, names the original publisher in `x-fedbroker-sender`, believed only on a
message whose user_id is this connection's own user.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from fedbroker.bus.amqp_link import Link, LinkSettings, broker_version
from fedbroker.bus.amqp_topology import TopologyDeclarer
from fedbroker.bus.base import ATTEMPTS_HEADER, ROUTING_KEY_HEADER, SENDER_HEADER, Action, Delivery, Dispatcher
from fedbroker.errors import BusError

log = logging.getLogger(__name__)

DELIVERY_COUNT_HEADER = "x-delivery-count"  # a quorum queue's count of a message's earlier, returned deliveries


@dataclass
class _Consumer:
    kind: Literal["tasks", "control", "events"]
    queue: str  # "" for an events subscriber until the broker names its queue
    dispatcher: Dispatcher
    route: tuple[str, str] | None = None  # (exchange, routing key) reaching `queue` alone; None: the default one
    channel: Any = None  # the channel of the current connection, None while disconnected

    def broker_counts(self, topology: TopologyDeclarer) -> bool:
        """Whether the broker counts this consumer's deliveries and dead-letters at the limit (a quorum queue)."""
        return topology.quorum and self.kind != "events"

    def retry_route(self) -> tuple[str, str]:
        """Where a retried copy is republished: the queue's own route, else the default exchange by queue name
        (an events subscriber's exclusive queue, whose fanout exchange would copy it to every subscriber)."""
        return self.route or ("", self.queue)


def _header_int(headers: dict[str, Any], key: str) -> int:
    try:
        return max(0, int(headers.get(key, 0)))
    except (TypeError, ValueError):
        return 0


class Consumers:
    """Every consumer of one bus, on one connection owned by its I/O thread (`Link`).

    Deliveries go from the I/O thread to one handler thread per consumer (`Dispatcher`), so a handler that
    trains for minutes never stops heartbeats; `ack`/`nack` are handed back to the I/O thread and wait until
    it sent them (`settle_timeout_s` at most). Each consumer has its own channel with prefetch 1; one more
    channel, in confirm mode, republishes retries.
    """

    def __init__(
        self, settings: LinkSettings, topology: TopologyDeclarer, *, max_attempts: int, settle_timeout_s: float,
        timeout_s: float,
    ) -> None:
        self.topology = topology
        self.max_attempts = max_attempts
        self.settle_timeout_s = settle_timeout_s
        self.timeout_s = timeout_s  # how long starting a consumer waits for the connection
        self.user = settings.user  # this connection's own user: the user_id of the copies it republishes
        self._lock = threading.Lock()
        self._consumers: list[_Consumer] = []
        self._retry_channel: Any = None
        self._conn: Any = None
        self._consuming = threading.Event()  # set while every registered consumer is consuming
        self._started = False
        self.link = Link(role="consumer", settings=settings, on_connect=self._on_connect,
                         on_disconnect=self._on_disconnect, on_tick=self._revive)

    def add(self, kind: Literal["tasks", "control", "events"], queue: str, dispatcher: Dispatcher, *,
            route: tuple[str, str] | None = None) -> None:
        """Register a consumer of `queue` ("" for a fresh events queue), whose retries go through `route`; once
        started, it consumes at once."""
        consumer = _Consumer(kind, queue, dispatcher, route)
        with self._lock:
            self._consumers.append(consumer)
            started = self._started
        if started:
            consumer.dispatcher.start()
            self.link.start()
            try:
                self.link.call(
                    lambda: self._start_consumer(consumer),
                    timeout=self.timeout_s,
                    what=f"starting consumer {consumer.dispatcher.name}",
                )
            except BusError as exc:  # set up by the next connect anyway
                log.warning("%s", exc)

    def start(self) -> None:
        """Begin delivering to the registered handlers; an unreachable broker only delays it to the connect."""
        with self._lock:
            if self._started:
                return
            self._started = True
            consumers = list(self._consumers)
        for consumer in consumers:
            consumer.dispatcher.start()
        if consumers:
            self.link.start()
            if not self.wait_ready(self.timeout_s):
                log.warning(
                    "bus consumers not ready after %gs (broker %s unreachable?); they start on connect",
                    self.timeout_s, self.link.masked_url,
                )

    def wait_ready(self, timeout: float) -> bool:
        """Wait until every registered consumer is consuming (e.g. an event subscription exists)."""
        with self._lock:
            if not self._consumers:
                return True
        return self._consuming.wait(timeout)

    def stop(self) -> None:
        """Stop the handler threads, then the connection: unacked messages go back to their queues."""
        with self._lock:
            consumers = list(self._consumers)
        for consumer in consumers:
            consumer.dispatcher.stop(timeout=0)
        self.link.stop()
        for consumer in consumers:
            consumer.dispatcher.stop(timeout=1.0)

    # -- the connection (I/O thread) -------------------------------------------------------------

    def _on_connect(self, conn: Any) -> None:
        self.topology.broker_version = broker_version(conn)
        ch = conn.channel()
        self.topology.declare(ch)
        ch.confirm_delivery()  # this channel republishes retries, confirmed before the original is acked
        self._retry_channel = ch
        self._conn = conn
        with self._lock:
            consumers = list(self._consumers)
        for consumer in consumers:
            self._start_consumer(consumer)
        self._consuming.set()

    def _start_consumer(self, consumer: _Consumer) -> None:
        conn = self._conn
        if consumer.channel is not None or conn is None or not conn.is_open or self._retry_channel is None:
            return  # already consuming on this connection, or the next connect will do it
        ch = conn.channel()
        ch.basic_qos(prefetch_count=1)
        if consumer.kind == "events":
            result = ch.queue_declare("", exclusive=True, auto_delete=True, arguments=self.topology.dead_lettering)
            consumer.queue = result.method.queue
            ch.queue_bind(consumer.queue, self.topology.names.events_exchange)
        arguments = self.topology.task_consumer_arguments if consumer.kind == "tasks" else {}
        ch.basic_consume(consumer.queue, partial(self._on_message, consumer), auto_ack=False,
                         arguments=arguments or None)
        consumer.channel = ch

    def _revive(self, conn: Any) -> None:
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

    def _on_disconnect(self) -> None:
        self._consuming.clear()
        self._retry_channel = None
        self._conn = None
        with self._lock:
            for consumer in self._consumers:
                consumer.channel = None  # deliveries of the old connection become stale

    # -- deliveries -------------------------------------------------------------------------------

    def _on_message(self, consumer: _Consumer, ch: Any, method: Any, props: Any, body: bytes) -> None:
        """On the I/O thread: count the attempt, then dead-letter, retry or hand to the handler."""
        headers = dict(props.headers or {})
        if consumer.broker_counts(self.topology):
            # the broker's count, on a delivery it says it delivered before; a first delivery's header is forged
            prior = _header_int(headers, DELIVERY_COUNT_HEADER) if method.redelivered else 0
            if method.redelivered and consumer.dispatcher.withdraw(props.message_id) is not None:
                log.info("message %s on %s redelivered while it waited for its handler", props.message_id,
                         consumer.queue)
        else:
            prior = _header_int(headers, ATTEMPTS_HEADER)
        if method.redelivered and not consumer.broker_counts(self.topology):  # an earlier delivery ended unsettled
            unseen = consumer.dispatcher.withdraw(props.message_id)
            if unseen is None:  # the handler had it: a failure
                self._retry(consumer, ch, method, props, body, failures=prior + 1)
                return
            log.info("message %s on %s redelivered while it waited for its handler: not a failure",
                     props.message_id, consumer.queue)
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
                redelivered=attempts > 1 or bool(method.redelivered),
                attempts=attempts,
                message_id=props.message_id,
                settle=partial(self._settle, consumer, ch, method, props, body, attempts),
                sender=self._sender(props),
                published_at=float(props.timestamp) if isinstance(props.timestamp, int) else None,
            )
        )

    def _sender(self, props: Any) -> str | None:
        """The broker user that published the message: its validated user_id, or for a copy this connection
        republished (its own user_id), the original publisher its header names."""
        user = props.user_id
        if user and user == self.user:
            named = (props.headers or {}).get(SENDER_HEADER)
            if isinstance(named, bytes):
                named = named.decode("utf-8", "replace")
            if isinstance(named, str):
                return named or None
        return str(user) if user else None

    def _retry(self, consumer: _Consumer, ch: Any, method: Any, props: Any, body: bytes, *, failures: int) -> None:
        import pika
        import pika.exceptions as pex

        if failures >= self.max_attempts:
            self._dead_letter(consumer, ch, method, props, failures)
            return
        headers = dict(props.headers or {})
        headers[ATTEMPTS_HEADER] = failures
        headers.setdefault(ROUTING_KEY_HEADER, method.routing_key)
        headers[SENDER_HEADER] = self._sender(props) or ""  # the copy's own user_id is ours
        copy = pika.BasicProperties(
            delivery_mode=pika.DeliveryMode.Persistent,
            content_type=props.content_type,
            message_id=props.message_id,
            timestamp=props.timestamp,
            app_id=props.app_id,
            headers=headers,
            user_id=self.user or None,
        )
        exchange, routing_key = consumer.retry_route()
        try:
            self._retry_channel.basic_publish(exchange, routing_key, body, copy, mandatory=True)
        except (pex.UnroutableError, pex.NackError) as exc:
            log.error(
                "could not requeue message %s on %s (%s); dead-lettering it", props.message_id, consumer.queue, exc
            )
            ch.basic_nack(method.delivery_tag, requeue=False)
            return
        except pex.ChannelClosedByBroker as exc:  # refused (its permissions): a reconnect would only repeat it
            log.error(
                "the broker refused user %r the retry of message %s on %s through exchange %r (%s %s); "
                "dead-lettering it instead (check that user's write permission)", self.user,
                props.message_id, consumer.queue, exchange or "amq.default", exc.reply_code, exc.reply_text,
            )
            ch.basic_nack(method.delivery_tag, requeue=False)
            self._reopen_retry_channel()
            return
        ch.basic_ack(method.delivery_tag)
        log.info(
            "message %s on %s will be retried (failed deliveries: %d)", props.message_id, consumer.queue, failures
        )

    def _reopen_retry_channel(self) -> None:
        """A new confirm channel for retries, after the broker closed the last one; a connection error here is
        the link's (it reconnects)."""
        ch = self._conn.channel()
        ch.confirm_delivery()
        self._retry_channel = ch

    def _dead_letter(self, consumer: _Consumer, ch: Any, method: Any, props: Any, attempts: int) -> None:
        log.warning(
            "dead-lettering message %s from %s after %d deliveries", props.message_id, consumer.queue, attempts
        )
        ch.basic_nack(method.delivery_tag, requeue=False)

    def _settle(
        self, consumer: _Consumer, ch: Any, method: Any, props: Any, body: bytes, attempts: int, action: Action
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
            elif consumer.broker_counts(self.topology):  # the broker counts it, and dead-letters at its limit
                ch.basic_nack(method.delivery_tag, requeue=True)
            else:
                self._retry(consumer, ch, method, props, body, failures=attempts)

        if consumer.channel is not ch:
            settle()  # stale: only logs, touches no connection
            return
        try:
            what = f"settling message {props.message_id} ({action})"
            # Never abandoned: an ack dropped on a live channel would hold its delivery (prefetch 1: the
            # consumer's every later one) until the channel closed. A busy I/O thread settles it late.
            self.link.call(settle, timeout=self.settle_timeout_s, what=what, expires=False)
        except BusError as exc:
            log.warning("%s; it runs once the connection's thread is free (if the connection is lost first, the "
                        "broker redelivers the message)", exc)
