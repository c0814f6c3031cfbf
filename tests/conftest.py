"""Shared fixtures: the RabbitMQ URL for integration tests."""

from __future__ import annotations

import os

import pytest

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    """URL of a reachable RabbitMQ (`FEDBROKER_TEST_AMQP_URL`); skipped locally, a failure on CI."""
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
