"""Shared fixtures: the machine's RabbitMQ for tests that only publish and consume, a private node of the
session's own for tests that stop or reconfigure one, and the record that the machine's broker was left alone."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.rabbitmq_node import UNTOUCHED_CHECK, PrivateRabbitMQ, machine_broker_state, start_private_rabbitmq

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    """URL of a reachable RabbitMQ (`FEDBROKER_TEST_AMQP_URL`); skipped locally, a failure on CI. Tests publish
    and consume there under names of their own, and never stop or reconfigure it."""
    from fedbroker.bus import mask_url

    url = os.environ.get("FEDBROKER_TEST_AMQP_URL", DEFAULT_AMQP_URL)
    try:
        import pika

        params = pika.URLParameters(url)
        params.connection_attempts = 1
        params.socket_timeout = 3
        pika.BlockingConnection(params).close()
    except Exception as exc:  # any failure means: no broker to test against
        message = (
            f"RabbitMQ is not reachable at {mask_url(url)} ({type(exc).__name__}: {exc}); "
            "start one or set FEDBROKER_TEST_AMQP_URL"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return url


@pytest.fixture(scope="session")
def private_rabbitmq(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRabbitMQ]:
    """A RabbitMQ node of this session's own, for tests that stop, restart or reconfigure a broker; stopped by
    pid when the session ends, however it ends."""
    node = start_private_rabbitmq(tmp_path_factory.mktemp("rabbitmq"))
    try:
        yield node
    finally:
        node.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The check that the machine's broker was left alone runs after every other test."""
    last = [item for item in items if item.name == UNTOUCHED_CHECK]
    items[:] = [item for item in items if item.name != UNTOUCHED_CHECK] + last


@pytest.fixture(scope="session", autouse=True)
def machine_broker_at_start(request: pytest.FixtureRequest) -> dict[str, str] | RuntimeError | None:
    """The machine broker's state before the first test, when the check that compares it runs in this session
    (None otherwise). A broker that cannot be read is the check's failure or skip, not the first test's."""
    if not any(item.name == UNTOUCHED_CHECK for item in request.session.items):
        return None
    try:
        return machine_broker_state()
    except RuntimeError as exc:
        return exc
