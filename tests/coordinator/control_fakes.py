"""A coordinator's control handler without a network, for tests that feed it control messages one at a time: a
delivery that records how it was settled, the handler on an in-process bus, and `send`."""

from __future__ import annotations

from typing import Any

from fedbroker.bus import InProcessBus, envelope
from fedbroker.coordinator.control import SenderBinding
from fedbroker.coordinator.control_handler import ControlHandler
from fedbroker.coordinator.events import JobWatcher
from fedbroker.coordinator.participants import EpsilonBounds, WorkerBudgets
from fedbroker.coordinator.store import StateStore


class FakeDelivery:
    """A control message as the bus hands it over: its body, the broker user that sent it, how it was settled."""

    def __init__(self, body: bytes, sender: str | None) -> None:
        self.body, self.sender, self.published_at, self.settled_as = body, sender, None, ""

    def ack(self) -> None:
        self.settled_as = "ack"

    def nack(self, *, requeue: bool) -> None:
        self.settled_as = "requeue" if requeue else "dead"


def control_handler(store: StateStore, users: dict[str, list[str]], *, namespace: str = "control-test") -> ControlHandler:
    """The handler over `store`, binding each broker user in `users` to the worker ids it may speak for."""
    return ControlHandler(bus=InProcessBus(namespace=namespace), store=store, events=JobWatcher(None),  # type: ignore[arg-type]
                          budgets=WorkerBudgets(), async_job=lambda job_id: None, bounds=EpsilonBounds(store),
                          senders=SenderBinding(users))


def send(h: ControlHandler, sender: str | None, **message: Any) -> FakeDelivery:
    """One control message from broker user `sender`, handled; the delivery says how it was settled."""
    delivery = FakeDelivery(envelope.encode(**message), sender)
    h.on_control(delivery)  # type: ignore[arg-type]
    return delivery
