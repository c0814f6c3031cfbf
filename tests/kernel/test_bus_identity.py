"""What binds a bus message to the broker user that published it, and the consumer timeout task queues carry.

Against the machine's RabbitMQ under namespaces of their own (it is only published to, consumed from and, with
rabbitmqctl, listed: never reconfigured), and in process for the pieces that need no broker.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pika
import pytest

from fedbroker.bus import AmqpBus, Delivery, InProcessBus, Topology, delete_topology
from fedbroker.bus.amqp_link import broker_version
from fedbroker.bus.amqp_topology import TopologyDeclarer
from fedbroker.bus.base import SENDER_HEADER, Dispatcher
from fedbroker.errors import ConfigError


def wait_for(predicate: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return value


@pytest.fixture
def namespace(rabbitmq_url: str) -> Iterator[str]:
    name = f"fbident-{uuid.uuid4().hex[:8]}"
    yield name
    delete_topology(rabbitmq_url, name, ["w0"])


def collecting(fail_first: bool = False) -> tuple[list[Delivery], Any]:
    got: list[Delivery] = []

    def handler(delivery: Delivery) -> None:
        got.append(delivery)
        if fail_first and len(got) == 1:
            raise RuntimeError("first delivery fails: the bus retries a copy")
        delivery.ack()

    return got, handler


@pytest.mark.integration
def test_a_delivery_names_the_user_that_published_it_and_a_retried_copy_still_does(
        rabbitmq_url: str, namespace: str) -> None:
    got, handler = collecting(fail_first=True)
    with AmqpBus(rabbitmq_url, namespace=namespace) as coordinator, AmqpBus(rabbitmq_url, namespace=namespace) as site:
        coordinator.consume_control(handler)
        coordinator.start()
        site.publish_control(b"report")
        wait_for(lambda: len(got) == 2)
    assert [(d.sender, d.attempts) for d in got] == [("guest", 1), ("guest", 2)]
    assert all(d.published_at is not None and abs(d.published_at - time.time()) < 60 for d in got)


@pytest.mark.integration
def test_the_sender_header_is_believed_only_on_a_message_the_consumers_own_user_published(
        rabbitmq_url: str, namespace: str) -> None:
    """A retried copy names its original publisher in a header; a message whose user_id is not the consumer's
    own (here: none) cannot use that header to claim a user."""
    got, handler = collecting()
    with AmqpBus(rabbitmq_url, namespace=namespace) as coordinator:
        coordinator.consume_control(handler)
        coordinator.start()
        connection = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            exchange = Topology(namespace).control_exchange
            channel.basic_publish(exchange, "coordinator", b"claims",
                                  pika.BasicProperties(headers={SENDER_HEADER: "site-x"}))
            channel.basic_publish(exchange, "coordinator", b"own copy",
                                  pika.BasicProperties(user_id="guest", headers={SENDER_HEADER: "site-x"}))
        finally:
            connection.close()
        wait_for(lambda: len(got) == 2)
    assert [(d.body, d.sender) for d in got] == [(b"claims", None), (b"own copy", "site-x")]


@pytest.mark.integration
def test_task_queues_and_task_consumers_carry_the_consumer_timeout(rabbitmq_url: str, namespace: str) -> None:
    """Read with rabbitmqctl's listings (nothing on the broker changes); 3.10 accepts and ignores the argument,
    3.12 to 4.2 apply it: the consumer's first, then the queue's."""
    if shutil.which("rabbitmqctl") is None:
        message = "rabbitmqctl is not on PATH: the queue's arguments cannot be listed"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must check them, not skip)")
        pytest.skip(message)
    with AmqpBus(rabbitmq_url, namespace=namespace, consumer_timeout_s=90) as worker:
        worker.consume_tasks("w0", lambda d: d.ack())
        worker.start()
        assert worker.broker_version is not None
        assert worker.consumer_timeout_honoured == (worker.broker_version >= (3, 12))
        queue = Topology(namespace).worker_queue("w0")

        def listed(*args: str) -> str:
            done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=120)
            return done.stdout if done.returncode == 0 else ""

        queues = [line for line in listed("list_queues", "name", "arguments").splitlines() if line.startswith(queue)]
        assert queues and '"x-consumer-timeout",90000' in queues[0]
        consumers = [line for line in listed("list_consumers", "queue_name", "arguments").splitlines()
                     if line.startswith(queue)]
        assert consumers and '"x-consumer-timeout",90000' in consumers[0]


def test_the_consumer_timeout_is_sent_to_brokers_that_accept_it_and_honoured_from_3_12() -> None:
    declarer = TopologyDeclarer(Topology("t"), consumer_timeout_s=60)
    seen = {}
    for version in [(3, 10, 8), (3, 12, 0), (4, 1, 2), (4, 3, 0)]:
        declarer.broker_version = version
        seen[version] = (declarer.task_consumer_arguments, declarer.consumer_timeout_honoured)
    assert seen == {(3, 10, 8): ({"x-consumer-timeout": 60000}, False),
                    (3, 12, 0): ({"x-consumer-timeout": 60000}, True),
                    (4, 1, 2): ({"x-consumer-timeout": 60000}, True),
                    (4, 3, 0): ({}, False)}
    assert TopologyDeclarer(Topology("t")).task_consumer_arguments == {}


def test_the_broker_version_is_read_from_the_servers_properties() -> None:
    def conn(version: object) -> Any:
        return SimpleNamespace(_impl=SimpleNamespace(server_properties={"version": version}))

    assert broker_version(conn(b"3.10.8")) == (3, 10, 8)
    assert broker_version(conn("4.1.0-rc.1")) == (4, 1, 0)
    assert broker_version(conn(b"")) is None
    assert broker_version(SimpleNamespace()) is None


def test_an_unseen_delivery_is_withdrawn_from_the_inbox_and_a_handled_one_is_not() -> None:
    started, release = threading.Event(), threading.Event()

    def handler(delivery: Delivery) -> None:
        started.set()
        release.wait(10)

    def delivery(message_id: str) -> Delivery:
        return Delivery(body=b"", routing_key="", redelivered=False, attempts=1, message_id=message_id,
                        settle=lambda action: None)

    dispatcher = Dispatcher("withdraw", handler)
    dispatcher.start()
    try:
        dispatcher.put(delivery("busy"))
        assert started.wait(10)
        waiting = delivery("waiting")
        dispatcher.put(waiting)
        assert dispatcher.withdraw("busy") is None  # the handler has it
        assert dispatcher.withdraw(None) is None
        assert dispatcher.withdraw("waiting") is waiting
        assert dispatcher.withdraw("waiting") is None
    finally:
        release.set()
        dispatcher.stop()


def test_an_in_process_bus_names_its_user_as_the_sender() -> None:
    got, handler = collecting()
    namespace = f"ident-{uuid.uuid4().hex[:6]}"
    coordinator, site = InProcessBus(namespace=namespace), InProcessBus(namespace=namespace, user="site-a")
    try:
        coordinator.consume_control(handler)
        coordinator.start()
        site.publish_control(b"x")
        wait_for(lambda: got)
    finally:
        coordinator.close()
        site.close()
    assert got[0].sender == "site-a"


def test_a_consumer_timeout_must_be_positive(rabbitmq_url: str) -> None:
    with pytest.raises(ConfigError, match="consumer_timeout_s"):
        AmqpBus(rabbitmq_url, consumer_timeout_s=0)
