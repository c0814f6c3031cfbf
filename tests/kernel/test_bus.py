"""Behaviour of the message bus, run against both the in-process bus and a real RabbitMQ."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fedbroker.bus import (
    AmqpBus,
    Bus,
    BusError,
    Delivery,
    InProcessBus,
    MemoryBroker,
    Topology,
    mask_url,
    open_bus,
)
from fedbroker.errors import ConfigError
from tests.rabbitmq_node import PrivateRabbitMQ
from tests.source_roots import ROOT

WORKERS = ("w1", "w2")  # every worker id the tests use, so teardown can delete their queues


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


class Inbox:
    """A handler that records deliveries; acks them itself when `auto_ack`."""

    def __init__(self, *, auto_ack: bool = True) -> None:
        self.auto_ack = auto_ack
        self.deliveries: list[Delivery] = []
        self._lock = threading.Lock()

    def __call__(self, delivery: Delivery) -> None:
        with self._lock:
            self.deliveries.append(delivery)
        if self.auto_ack:
            delivery.ack()

    @property
    def bodies(self) -> list[bytes]:
        with self._lock:
            return [d.body for d in self.deliveries]

    def wait(self, n: int, timeout: float = 10.0) -> list[Delivery]:
        assert wait_for(lambda: len(self.deliveries) >= n, timeout), f"{len(self.deliveries)} of {n} deliveries"
        return list(self.deliveries)


class Harness:
    """Opens buses on one unique namespace and removes everything they created."""

    def __init__(self, backend: str, url: str | None) -> None:
        self.backend = backend
        self.url = url
        self.namespace = f"fbtest-{uuid.uuid4().hex[:10]}"
        self.topology = Topology(self.namespace)
        self.buses: list[Bus] = []

    def open(self, **options: Any) -> Any:
        options = {"reconnect_initial_s": 0.1, "reconnect_max_s": 1.0, "publish_timeout_s": 10.0, **options}
        bus = open_bus(self.url, namespace=self.namespace, **options)
        self.buses.append(bus)
        return bus

    def ready_count(self, queue: str) -> int:
        """Messages waiting in `queue`, not counting delivered-but-unacked ones."""
        if self.backend == "memory":
            return MemoryBroker.for_namespace(self.namespace).ready_count(queue)
        with _raw_channel(self.url) as ch:
            return int(ch.queue_declare(queue, passive=True).method.message_count)

    def dead_bodies(self) -> list[bytes]:
        if self.backend == "memory":
            return [d.body for d in MemoryBroker.for_namespace(self.namespace).dead]
        bodies = []
        with _raw_channel(self.url) as ch:
            while True:
                method, _, body = ch.basic_get(self.topology.dead_queue, auto_ack=True)
                if method is None:
                    return bodies
                bodies.append(body)

    def cleanup(self) -> None:
        for bus in self.buses:
            bus.close()
        if self.backend == "memory":
            MemoryBroker.forget(self.namespace)
            return
        t = self.topology
        with _raw_channel(self.url) as ch:
            for queue in (t.coordinator_queue, t.dead_queue, *(t.worker_queue(w) for w in WORKERS)):
                ch.queue_delete(queue)
            for exchange in (t.tasks_exchange, t.control_exchange, t.events_exchange, t.dead_letter_exchange):
                ch.exchange_delete(exchange)


class _raw_channel:
    """A plain pika channel for inspecting the broker from the test's side."""

    def __init__(self, url: str | None) -> None:
        import pika

        assert url
        self._conn = pika.BlockingConnection(pika.URLParameters(url))

    def __enter__(self) -> Any:
        return self._conn.channel()

    def __exit__(self, *exc: object) -> None:
        if self._conn.is_open:
            self._conn.close()


@pytest.fixture(params=[pytest.param("memory"), pytest.param("amqp", marks=pytest.mark.integration)])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    url = request.getfixturevalue("rabbitmq_url") if request.param == "amqp" else None
    h = Harness(request.param, url)
    yield h
    h.cleanup()


@pytest.fixture
def amqp(rabbitmq_url: str) -> Iterator[Harness]:
    h = Harness("amqp", rabbitmq_url)
    yield h
    h.cleanup()


@pytest.fixture
def private_amqp(private_rabbitmq: PrivateRabbitMQ) -> Iterator[Harness]:
    """On the session's private node: for a test that has the broker close its connections."""
    h = Harness("amqp", private_rabbitmq.url)
    yield h
    h.cleanup()


# -- both implementations ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_task_is_routed_only_to_its_worker(harness: Harness) -> None:
    coordinator, worker = harness.open(), harness.open()
    inboxes = {w: Inbox() for w in WORKERS}
    for w in WORKERS:
        worker.consume_tasks(w, inboxes[w])
    worker.start()
    coordinator.publish_task("w1", b"for w1")
    coordinator.publish_task("w2", b"for w2")
    inboxes["w1"].wait(1)
    inboxes["w2"].wait(1)
    time.sleep(0.2)
    assert inboxes["w1"].bodies == [b"for w1"]
    assert inboxes["w2"].bodies == [b"for w2"]
    assert inboxes["w1"].deliveries[0].routing_key == "w1"


@pytest.mark.timeout(60)
def test_task_published_before_worker_consumes_is_delivered_later(harness: Harness) -> None:
    coordinator = harness.open()
    coordinator.declare_worker("w1")
    coordinator.publish_task("w1", b"early task")
    worker, inbox = harness.open(), Inbox()
    worker.consume_tasks("w1", inbox)
    worker.start()
    [delivery] = inbox.wait(1)
    assert (delivery.body, delivery.attempts, delivery.redelivered) == (b"early task", 1, False)


@pytest.mark.timeout(60)
def test_a_batch_of_tasks_is_delivered_persistent_and_names_the_unroutable(harness: Harness) -> None:
    coordinator = harness.open()
    coordinator.declare_worker("w1")  # w2 has no queue
    unroutable = coordinator.publish_tasks([("w1", b"one"), ("w2", b"lost"), ("w1", b"two")])
    assert unroutable == ["w2"]
    assert wait_for(lambda: harness.ready_count(harness.topology.worker_queue("w1")) == 2)
    worker, inbox = harness.open(), Inbox()
    worker.consume_tasks("w1", inbox)
    worker.start()
    assert [d.body for d in inbox.wait(2)] == [b"one", b"two"]
    assert coordinator.publish_tasks([]) == []
    assert coordinator.publish_tasks([("w1", b"three")]) == []  # the batch channel is reused
    assert [d.body for d in inbox.wait(3)][-1] == b"three"


@pytest.mark.timeout(60)
def test_unacked_message_is_redelivered_after_consumer_closes(harness: Harness) -> None:
    coordinator = harness.open()
    coordinator.declare_worker("w1")
    first, unacked = harness.open(), Inbox(auto_ack=False)
    first.consume_tasks("w1", unacked)
    first.start()
    coordinator.publish_task("w1", b"task")
    unacked.wait(1)
    first.close()
    second, inbox = harness.open(), Inbox()
    second.consume_tasks("w1", inbox)
    second.start()
    [delivery] = inbox.wait(1)
    assert (delivery.body, delivery.redelivered, delivery.attempts) == (b"task", True, 2)
    assert delivery.message_id == unacked.deliveries[0].message_id


@pytest.mark.timeout(60)
def test_nack_with_requeue_redelivers_with_attempts_counted(harness: Harness) -> None:
    bus, seen = harness.open(), Inbox(auto_ack=False)

    def handler(delivery: Delivery) -> None:
        seen(delivery)
        if delivery.attempts == 1:
            delivery.nack(requeue=True)
        else:
            delivery.ack()

    bus.consume_control(handler)
    bus.start()
    bus.publish_control(b"report")
    seen.wait(2)
    time.sleep(0.2)
    got = [(d.attempts, d.redelivered, d.body) for d in seen.deliveries]
    assert got == [(1, False, b"report"), (2, True, b"report")]
    assert harness.ready_count(harness.topology.coordinator_queue) == 0


@pytest.mark.timeout(60)
def test_poison_message_is_dead_lettered_after_max_attempts_and_never_handed_over_again(harness: Harness) -> None:
    bus, calls = harness.open(max_attempts=3), Inbox(auto_ack=False)

    def handler(delivery: Delivery) -> None:
        calls(delivery)
        raise ValueError("cannot decode")

    bus.declare_worker("w1")
    bus.consume_tasks("w1", handler)
    bus.start()
    bus.publish_task("w1", b"poison")
    calls.wait(3)
    assert wait_for(lambda: harness.dead_bodies() == [b"poison"], 10)
    time.sleep(0.5)
    assert [d.attempts for d in calls.deliveries] == [1, 2, 3]
    assert harness.ready_count(harness.topology.worker_queue("w1")) == 0


@pytest.mark.timeout(60)
def test_ack_from_another_thread_works_while_handler_thread_is_busy(harness: Harness) -> None:
    bus, release, acked = harness.open(), threading.Event(), threading.Event()
    seen = Inbox(auto_ack=False)

    def handler(delivery: Delivery) -> None:
        seen(delivery)
        if delivery.body == b"first":
            def train_then_ack() -> None:
                delivery.ack()
                acked.set()

            threading.Thread(target=train_then_ack).start()
            release.wait(20)  # the handler thread stays busy
        else:
            delivery.ack()

    bus.declare_worker("w1")
    bus.consume_tasks("w1", handler)
    bus.start()
    bus.publish_task("w1", b"first")
    bus.publish_task("w1", b"second")
    assert acked.wait(10)
    # prefetch 1: the broker sends "second" only once "first" is acked, handler still blocked
    assert wait_for(lambda: harness.ready_count(harness.topology.worker_queue("w1")) == 0, 10)
    assert seen.bodies == [b"first"]
    release.set()
    seen.wait(2)
    assert seen.bodies == [b"first", b"second"]


@pytest.mark.timeout(60)
def test_prefetch_one_holds_second_message_until_first_is_acked(harness: Harness) -> None:
    bus, inbox = harness.open(), Inbox(auto_ack=False)
    bus.declare_worker("w1")
    bus.consume_tasks("w1", inbox)
    bus.start()
    bus.publish_task("w1", b"one")
    bus.publish_task("w1", b"two")
    inbox.wait(1)
    time.sleep(0.5)
    assert inbox.bodies == [b"one"]
    assert harness.ready_count(harness.topology.worker_queue("w1")) == 1
    inbox.deliveries[0].ack()
    inbox.wait(2)
    assert inbox.bodies == [b"one", b"two"]


@pytest.mark.timeout(60)
def test_events_fan_out_to_every_subscriber(harness: Harness) -> None:
    subscribers = [(harness.open(), Inbox()) for _ in range(2)]
    for bus, inbox in subscribers:
        bus.consume_events(inbox)
        bus.start()
    harness.open().publish_event(b"round 1 completed")
    for _, inbox in subscribers:
        inbox.wait(1)
    time.sleep(0.2)
    assert [inbox.bodies for _, inbox in subscribers] == [[b"round 1 completed"]] * 2


@pytest.mark.timeout(60)
def test_control_messages_reach_the_coordinator_queue(harness: Harness) -> None:
    worker = harness.open()
    worker.publish_control(b"register w1")  # before the coordinator consumes: kept
    coordinator, inbox = harness.open(), Inbox()
    coordinator.consume_control(inbox)
    coordinator.start()
    worker.publish_control(b"heartbeat w1")
    inbox.wait(2)
    assert inbox.bodies == [b"register w1", b"heartbeat w1"]
    assert inbox.deliveries[0].routing_key == "coordinator"


def test_open_bus_without_url_is_in_process_and_rejects_other_schemes() -> None:
    bus = open_bus(None, namespace=f"fbtest-{uuid.uuid4().hex[:10]}", reconnect_max_s=5)
    assert isinstance(bus, InProcessBus)
    bus.close()
    bus.close()
    with pytest.raises(ConfigError, match="broker_url"):
        open_bus("http://localhost")
    with pytest.raises(ConfigError, match="max_attempts"):
        open_bus("", max_attempts=0)


def test_the_in_process_bus_needs_no_pika_and_the_package_exports_its_api() -> None:
    code = (
        "import sys; sys.modules['pika'] = None\n"  # any import of pika now fails
        "import fedbroker.bus as bus\n"
        "missing = [name for name in bus.__all__ if not hasattr(bus, name)]\n"
        "assert not missing, missing\n"
        "b = bus.open_bus(None, namespace='fbtest-nopika'); b.start(); b.close()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=ROOT)


def test_password_is_masked_in_urls_for_logs() -> None:
    assert mask_url("amqps://fl:s3cret@rabbit.example:5671/%2F?heartbeat=30") == (
        "amqps://fl:***@rabbit.example:5671/%2F?heartbeat=30"
    )
    assert mask_url("amqp://localhost/") == "amqp://localhost/"


@pytest.mark.parametrize("password", ["p#ss", "a/b", "wh?t", "p@ss", "x:y", "#/?@:", "%23enc"])
def test_a_password_with_url_delimiters_is_never_shown_by_mask_url(password: str) -> None:
    """urlsplit ends the authority at an unescaped '#', '/' or '?': the rest of the password was logged."""
    url = f"amqp://fl:{password}@rabbit.example:5672/%2F?heartbeat=30"
    masked = mask_url(url)
    assert password not in masked and masked == "amqp://fl:***@rabbit.example:5672/%2F?heartbeat=30"
    assert mask_url(f"fl:{password}@rabbit.example") == "fl:***@rabbit.example"   # no scheme


def test_a_broker_url_whose_password_needs_escaping_is_refused_without_showing_it() -> None:
    from fedbroker.bus.base import check_url

    for url in ("amqp://fl:p#ss@h/", "amqp://fl:a/b@h/", "amqp://fl:wh?t@h/"):
        with pytest.raises(ConfigError, match="percent-encode") as info:
            check_url(url)
        assert "p#ss" not in str(info.value) and "a/b" not in str(info.value) and "wh?t" not in str(info.value)
        assert "amqp://fl:***@h/" in str(info.value)
        with pytest.raises(ConfigError, match="percent-encode"):
            AmqpBus(url, namespace="fbtest-url")
    assert check_url("amqp://fl:p%23ss@h:5672/%2F?heartbeat=30") == "amqp://fl:p%23ss@h:5672/%2F?heartbeat=30"


# -- RabbitMQ only ----------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_unroutable_task_raises_bus_error_naming_the_worker(amqp: Harness) -> None:
    coordinator = amqp.open()
    with pytest.raises(BusError, match="w2"):
        coordinator.publish_task("w2", b"nobody listens")  # w2 never declared


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_messages_are_persistent_and_topology_is_durable(amqp: Harness) -> None:
    import pika.exceptions as pex

    coordinator = amqp.open()
    coordinator.declare_worker("w1")
    coordinator.publish_task("w1", b"task")
    t = amqp.topology
    with _raw_channel(amqp.url) as ch:
        _method, properties, body = ch.basic_get(t.worker_queue("w1"), auto_ack=True)
        assert body == b"task" and properties.delivery_mode == 2
    # redeclaring as non-durable is refused (406) only when the broker holds them as durable
    for queue in (t.worker_queue("w1"), t.coordinator_queue, t.dead_queue):
        with _raw_channel(amqp.url) as ch, pytest.raises(pex.ChannelClosedByBroker, match="durable"):
            ch.queue_declare(queue, durable=False)
    exchanges = {
        t.tasks_exchange: "direct",
        t.control_exchange: "direct",
        t.events_exchange: "fanout",
        t.dead_letter_exchange: "fanout",
    }
    for exchange, kind in exchanges.items():
        with _raw_channel(amqp.url) as ch, pytest.raises(pex.ChannelClosedByBroker, match="durable"):
            ch.exchange_declare(exchange, exchange_type=kind, durable=False)


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_consumption_and_publishing_resume_after_broker_closes_the_connections(
    private_amqp: Harness, private_rabbitmq: PrivateRabbitMQ, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fedbroker.bus")
    bus, inbox = private_amqp.open(), Inbox()
    assert isinstance(bus, AmqpBus)
    bus.declare_worker("w1")
    bus.consume_tasks("w1", inbox)
    bus.start()
    bus.publish_task("w1", b"before")
    inbox.wait(1)
    assert bus.reconnects == 0
    for name in bus.connection_names:
        private_rabbitmq.close_connection(name)
    bus.publish_task("w1", b"after")  # retried on the new connection if the old one is gone
    inbox.wait(2)
    assert inbox.bodies == [b"before", b"after"]
    assert wait_for(lambda: bus.reconnects == 2, 10), bus.reconnects
    assert "reconnected" in caplog.text
    assert "guest:guest@" not in caplog.text


@pytest.mark.timeout(60)
def test_an_ack_that_outwaits_a_busy_connection_thread_is_still_sent_and_the_next_task_comes(amqp: Harness) -> None:
    """A consumer's connection thread busy for longer than `settle_timeout_s` (1,000 stub workers on one
    connection did it in the bench): the handler stops waiting for its ack, but the ack is still sent once the
    thread is free. Dropped, it left the delivery unacked on a live channel, and with prefetch 1 the worker
    never got another task (a round of the bench waited for its deadline)."""
    bus, inbox = amqp.open(settle_timeout_s=0.2), Inbox(auto_ack=False)
    bus.declare_worker("w1")
    bus.consume_tasks("w1", inbox)
    bus.start()
    bus.publish_task("w1", b"one")
    (first,) = inbox.wait(1)
    busy, free = threading.Event(), threading.Event()

    def hold_the_thread() -> None:
        busy.set()
        free.wait(20)

    blocker = threading.Thread(target=lambda: bus._consumer.link.call(hold_the_thread, timeout=30, what="holding"))
    blocker.start()
    assert busy.wait(10)
    first.ack()  # waits settle_timeout_s, then returns: the ack stays queued behind the busy thread
    bus.publish_task("w1", b"two")
    time.sleep(0.5)
    assert inbox.bodies == [b"one"]  # prefetch 1: "two" waits for the ack
    free.set()
    blocker.join(10)
    inbox.wait(2)
    assert inbox.bodies == [b"one", b"two"]
    inbox.deliveries[1].ack()
    assert wait_for(lambda: amqp.ready_count(amqp.topology.worker_queue("w1")) == 0, 10)
