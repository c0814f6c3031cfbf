"""Message bus for control messages (tasks, worker reports, round events); weights never ride on it.

Two implementations share one interface (`Bus`) and one behaviour:

* `AmqpBus` (`amqp.py`) talks to RabbitMQ with durable topology, persistent messages, publisher confirms,
  manual acks, prefetch 1, dead-lettering of poison messages and reconnection with jittered backoff; its
  parts: `amqp_link.py` (a connection and its thread), `amqp_topology.py`, `amqp_publisher.py`,
  `amqp_consumer.py`;
* `InProcessBus` (`memory.py`) does the same inside one process (the embedded demo needs no broker).

What they share (the interface, `Delivery`, broker names, the attempts header) is in `base.py`.
`open_bus(url)` picks one from the URL. Bodies are opaque bytes (serialized envelopes built elsewhere).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from fedbroker.bus.amqp import AMQP_ONLY_OPTIONS, AmqpBus
from fedbroker.bus.amqp_topology import delete_topology
from fedbroker.bus.base import ATTEMPTS_HEADER, Bus, Delivery, Handler, Topology, mask_url
from fedbroker.bus.memory import DeadLetter, InProcessBus, MemoryBroker
from fedbroker.errors import BusError, ConfigError


def open_bus(url: str | None, *, namespace: str = "fedbroker", **options: Any) -> Bus:
    """`None`/`""` → `InProcessBus`; `amqp://` or `amqps://` → `AmqpBus` (options: see `AmqpBus`).

    AMQP-only options are accepted and ignored in process, so one config works for both.
    """
    if not url:
        mem_options = {k: v for k, v in options.items() if k not in AMQP_ONLY_OPTIONS}
        return InProcessBus(namespace=namespace, **mem_options)
    scheme = urlsplit(url).scheme.lower()
    if scheme not in ("amqp", "amqps"):
        raise ConfigError("broker_url", f"scheme must be amqp:// or amqps://, got {scheme or 'none'}://")
    return AmqpBus(url, namespace=namespace, **options)


__all__ = [
    "ATTEMPTS_HEADER",
    "AmqpBus",
    "Bus",
    "BusError",
    "DeadLetter",
    "Delivery",
    "Handler",
    "InProcessBus",
    "MemoryBroker",
    "Topology",
    "delete_topology",
    "mask_url",
    "open_bus",
]
