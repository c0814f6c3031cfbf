"""Fixtures of the fault-injection tests: a federation to break, and a broker that is always put back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import fedbroker.worker.agent
from tests.faults.harness import Federation, Training, restore_broker


@pytest.fixture
def training(monkeypatch: pytest.MonkeyPatch) -> Training:
    """Every worker's training in this test, counted per worker (and slowed down or failed on demand)."""
    hook = Training()
    monkeypatch.setattr(fedbroker.worker.agent, "train_local", hook)
    return hook


@pytest.fixture
def broker(rabbitmq_url: str) -> Iterator[str]:
    """The broker URL, for a test that disturbs the broker: afterwards it runs and answers, whatever happened."""
    try:
        yield rabbitmq_url
    finally:
        restore_broker(rabbitmq_url)


@pytest.fixture
def federation(rabbitmq_url: str, tmp_path: Path) -> Iterator[Federation]:
    fed = Federation(rabbitmq_url, tmp_path)
    try:
        yield fed
    finally:
        fed.close()
