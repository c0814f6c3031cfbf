"""The suite leaves the machine's RabbitMQ exactly as it found it: a developer's deployment may be using it."""

from __future__ import annotations

import pytest

from tests.rabbitmq_node import UNTOUCHED_CHECK, machine_broker_state, missing

pytestmark = [pytest.mark.integration]


def test_the_suite_neither_restarts_nor_reconfigures_the_machines_broker(
        rabbitmq_url: str, machine_broker_at_start: dict[str, str] | RuntimeError | None) -> None:
    """Runs last (tests/conftest.py puts it there). It compares identities, not durations: the node's OS pid, the
    rabbit application's supervisor (new after a stop_app/start_app), its consumer_timeout and
    channel_tick_interval, and its users and vhosts, read before the first test and now. No test may add a
    user there even for a while, so the lists must be equal, whatever other suite runs on the machine."""
    assert test_the_suite_neither_restarts_nor_reconfigures_the_machines_broker.__name__ == UNTOUCHED_CHECK
    if isinstance(machine_broker_at_start, RuntimeError):
        missing(f"cannot read the machine's broker with rabbitmqctl: {machine_broker_at_start}")
    assert machine_broker_at_start is not None
    now = machine_broker_state()
    changed = [f"{what} was {machine_broker_at_start.get(what)!r}, is {value!r}" for what, value in now.items()
               if value != machine_broker_at_start.get(what)]
    assert not changed, "the machine's broker changed during the suite: " + "; ".join(changed)
