"""Publishing to quorum queues through the loss of the node that led them.

What RabbitMQ 3.10.8 does, measured on a private three-node cluster (tests/ha/test_broker_node_loss.py): a
channel opened while a queue's leader is being re-elected keeps talking to the dead leader. On a confirm channel
every publish is then nacked, for as long as the channel lives (15 s and counting), while a channel opened 0.24 s
later works; on a transaction channel `tx.commit` answers commit-ok and the messages are dropped, silently. So
with quorum queues the bus never publishes a batch in a transaction: `confirmed_batch` sends it on a fresh
confirm channel with every message outstanding (one wait for the batch, as a commit is) and sends what the broker
nacked again on another fresh channel, until the caller's deadline. A message sent twice keeps its message_id;
the handlers are idempotent.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fedbroker.errors import BusError

RETRY_PAUSE_S = 0.2  # between a nacked attempt and the next, on a fresh channel
POLL_S = 0.05


class Batch:
    """The messages of one batch not confirmed yet, kept across attempts (and reconnects: a lost connection
    re-runs the publish on the next one, where only these are sent)."""

    def __init__(self, messages: Sequence[tuple[str, bytes, Any]]) -> None:
        self.waiting = list(messages)  # (routing key, body, properties), not confirmed yet
        self.returned: set[str] = set()  # routing keys the broker returned unroutable

    def publish(self, conn: Any, exchange: str, *, deadline: float, what: str) -> list[str]:
        """Until every message is confirmed (the unroutable ones' keys back, sorted), nacked ones sent again on
        a fresh channel; `BusError` when the broker still refuses at `deadline`. Connection errors propagate
        (the link reconnects and calls again)."""
        while True:
            self._attempt(conn, exchange, deadline)
            if not self.waiting:
                return sorted(self.returned)
            if time.monotonic() >= deadline:
                raise BusError(f"broker refused (nacked) {len(self.waiting)} of {what} until the deadline")
            conn.process_data_events(time_limit=RETRY_PAUSE_S)

    def _attempt(self, conn: Any, exchange: str, deadline: float) -> None:
        import pika.exceptions as pex
        from pika import spec

        box: dict[str, Any] = {}
        outcome: dict[int, bool] = {}  # delivery tag → acked (True) or nacked (False)

        def on_confirm(frame: Any) -> None:
            method = frame.method
            acked = isinstance(method, spec.Basic.Ack)
            tags = range(1, method.delivery_tag + 1) if method.multiple else (method.delivery_tag,)
            for tag in tags:
                outcome.setdefault(tag, acked)

        def on_open(channel: Any) -> None:
            box["channel"] = channel
            channel.add_on_return_callback(lambda _ch, method, _props, _body: self.returned.add(method.routing_key))
            channel.confirm_delivery(on_confirm, callback=lambda _frame: box.update(ready=True))

        conn._impl.channel(on_open_callback=on_open)  # pika's own channel: publishes without waiting, one by one
        self._wait(conn, lambda: bool(box.get("ready")), deadline, "a confirm channel to open")
        channel = box["channel"]
        sent = list(self.waiting)
        for routing_key, body, properties in sent:
            channel.basic_publish(exchange, routing_key, body, properties, mandatory=True)
        self._wait(conn, lambda: len(outcome) >= len(sent) or not channel.is_open, deadline, "the confirms")
        if not channel.is_open:
            raise pex.ChannelClosed(0, "the confirm channel closed under a batch")
        self.waiting = [message for tag, message in enumerate(sent, start=1) if not outcome.get(tag, False)]
        channel.close()

    @staticmethod
    def _wait(conn: Any, done: Any, deadline: float, what: str) -> None:
        while not done():
            if time.monotonic() >= deadline:
                raise BusError(f"timed out waiting for {what}")
            conn.process_data_events(time_limit=POLL_S)
