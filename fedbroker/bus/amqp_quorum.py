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


class ConfirmChannel:
    """pika's own channel in confirm mode (publishes without waiting, one by one), kept across batches so each
    queue meets this channel's publisher once, not every round; replaced after a nack or a closed channel."""

    def __init__(self, conn: Any, deadline: float) -> None:
        box: dict[str, Any] = {}
        self.outcome: dict[int, bool] = {}  # delivery tag → acked (True) or nacked (False)
        self.returned: set[str] = set()  # routing keys the broker returned unroutable
        self.sent = 0  # delivery tags used so far
        self.base = 1  # the first delivery tag of the batch in flight (earlier ones are settled)
        self.nacked = False

        def on_open(channel: Any) -> None:
            box["channel"] = channel
            channel.add_on_return_callback(lambda _ch, method, _props, _body: self.returned.add(method.routing_key))
            channel.confirm_delivery(self._on_confirm, callback=lambda _frame: box.update(ready=True))

        conn._impl.channel(on_open_callback=on_open)
        wait(conn, lambda: bool(box.get("ready")), deadline, "a confirm channel to open")
        self.channel = box["channel"]

    def _on_confirm(self, frame: Any) -> None:
        from pika import spec

        method = frame.method
        acked = isinstance(method, spec.Basic.Ack)
        self.nacked = self.nacked or not acked
        tags = range(self.base, method.delivery_tag + 1) if method.multiple else (method.delivery_tag,)
        for tag in tags:
            self.outcome.setdefault(tag, acked)

    @property
    def usable(self) -> bool:
        """Open, and never nacked (a nack means a queue leader this channel cannot reach: amqp_quorum)."""
        return bool(self.channel.is_open) and not self.nacked

    def close(self) -> None:
        """Close it (a channel the broker or the connection closed is left as it is)."""
        if self.channel.is_open:
            self.channel.close()


class Batch:
    """The messages of one batch not confirmed yet, kept across attempts (and reconnects: a lost connection
    re-runs the publish on the next one, where only these are sent)."""

    def __init__(self, messages: Sequence[tuple[str, bytes, Any]]) -> None:
        self.waiting = list(messages)  # (routing key, body, properties), not confirmed yet
        self.returned: set[str] = set()  # routing keys the broker returned unroutable

    def publish(self, conn: Any, exchange: str, channels: dict[str, ConfirmChannel], *, deadline: float,
                what: str) -> list[str]:
        """Until every message is confirmed (the unroutable ones' keys back, sorted), nacked ones sent again on
        a fresh channel; `BusError` when the broker still refuses at `deadline`. `channels["batch"]` is the kept
        confirm channel (made or replaced here). Connection errors propagate (the link reconnects, calls again)."""
        while True:
            kept = channels.get("batch")
            if kept is None or not kept.usable:
                if kept is not None:
                    kept.close()
                kept = channels["batch"] = ConfirmChannel(conn, deadline)
            self._attempt(conn, exchange, kept, deadline)
            if not self.waiting:
                return sorted(self.returned)
            if time.monotonic() >= deadline:
                raise BusError(f"broker refused (nacked) {len(self.waiting)} of {what} until the deadline")
            conn.process_data_events(time_limit=RETRY_PAUSE_S)

    def _attempt(self, conn: Any, exchange: str, kept: ConfirmChannel, deadline: float) -> None:
        import pika.exceptions as pex

        sent = list(self.waiting)
        first = kept.base = kept.sent + 1
        kept.returned.clear()
        for routing_key, body, properties in sent:
            kept.channel.basic_publish(exchange, routing_key, body, properties, mandatory=True)
        kept.sent += len(sent)
        wait(conn, lambda: len(kept.outcome) >= len(sent) or not kept.channel.is_open, deadline, "the confirms")
        if not kept.channel.is_open:
            raise pex.ChannelClosed(0, "the confirm channel closed under a batch")
        self.returned |= kept.returned
        self.waiting = [message for tag, message in enumerate(sent, start=first) if not kept.outcome.get(tag, False)]
        kept.outcome.clear()


def wait(conn: Any, done: Any, deadline: float, what: str) -> None:
    """Serve the connection until `done()`; `BusError` at `deadline`."""
    while not done():
        if time.monotonic() >= deadline:
            raise BusError(f"timed out waiting for {what}")
        conn.process_data_events(time_limit=POLL_S)
