"""Fixtures of the fault-injection tests: a federation to break, and a private broker that is always put back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import fedbroker.worker.agent
from tests.faults.harness import BUS_USERS, Federation, Training, restore_broker
from tests.rabbitmq_node import PrivateRabbitMQ


@pytest.fixture
def training(monkeypatch: pytest.MonkeyPatch) -> Training:
    """Every worker's training in this test, counted per worker (and slowed down or failed on demand)."""
    hook = Training()
    monkeypatch.setattr(fedbroker.worker.agent, "train_local", hook)
    return hook


@pytest.fixture
def broker(private_rabbitmq: PrivateRabbitMQ) -> Iterator[PrivateRabbitMQ]:
    """The session's private node, for a test that disturbs the broker: afterwards it runs and answers."""
    try:
        yield private_rabbitmq
    finally:
        restore_broker(private_rabbitmq)


@pytest.fixture
def federation(rabbitmq_url: str, tmp_path: Path) -> Iterator[Federation]:
    """A federation on the machine's broker, which its tests only publish to and consume from."""
    fed = Federation(rabbitmq_url, tmp_path)
    try:
        yield fed
    finally:
        fed.close()


@pytest.fixture
def broker_federation(broker: PrivateRabbitMQ, tmp_path: Path) -> Iterator[Federation]:
    """A federation on the private node, for a test that stops its broker or cuts its connections there."""
    fed = Federation(broker.url, tmp_path)
    try:
        yield fed
    finally:
        restore_broker(broker)  # the federation's links close cleanly on a broker that answers
        fed.close()



@pytest.fixture(params=BUS_USERS)
def each_federation(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Federation]:
    """`federation` as guest on the machine's broker, then with per-participant broker users."""
    if request.param == "guest":
        fed = Federation(request.getfixturevalue("rabbitmq_url"), tmp_path)
    else:
        node: PrivateRabbitMQ = request.getfixturevalue("private_rabbitmq")
        fed = Federation(node.url, tmp_path, users=node)
    try:
        yield fed
    finally:
        fed.close()


@pytest.fixture
def provisioned_federation(private_rabbitmq: PrivateRabbitMQ, tmp_path: Path) -> Iterator[Federation]:
    """A federation as a kit deploys it (per-participant broker users, sites bound to theirs), for a bus test whose
    guest run would add nothing: on the session's private node."""
    fed = Federation(private_rabbitmq.url, tmp_path, users=private_rabbitmq)
    try:
        yield fed
    finally:
        fed.close()


@pytest.fixture(params=BUS_USERS)
def each_broker_federation(request: pytest.FixtureRequest, broker: PrivateRabbitMQ,
                           tmp_path: Path) -> Iterator[Federation]:
    """`broker_federation` as guest, then with per-participant broker users (both on the private node)."""
    fed = Federation(broker.url, tmp_path, users=broker if request.param == "provisioned" else None)
    try:
        yield fed
    finally:
        restore_broker(broker)
        fed.close()
