"""A worker bound to its coordinator's broker user trains only tasks that user published: a site may publish to
the tasks exchange, and a task it forged could ask another site's worker for any training (epochs, batch) on a
real round. Its ledger names the worker, and another worker's ledger is refused."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from fedbroker.bus import Delivery, InProcessBus
from fedbroker.config import DPPolicy, WorkerConfig
from fedbroker.errors import ConfigError
from fedbroker.worker.agent import WorkerAgent
from fedbroker.worker.ledger import PrivacyLedger


def delivery(sender: str | None, settled: list[str]) -> Delivery:
    return Delivery(body=b"not even a task", routing_key="w0", redelivered=False, attempts=1, message_id="m",
                    settle=settled.append, sender=sender)


def test_a_task_from_another_broker_user_is_dead_lettered_untrained(tmp_path: Path) -> None:
    config = WorkerConfig(id="w0", ledger_path=str(tmp_path / "ledger.json"), device="cpu",
                          dp=DPPolicy(enabled=False), coordinator_broker_user="study-coordinator")
    agent = WorkerAgent(config, InProcessBus(namespace=f"sender-{uuid.uuid4().hex[:6]}"))
    agent.run_task = lambda task: pytest.fail("a forged task was run")  # type: ignore[method-assign]
    def count(outcome: str) -> float:
        return REGISTRY.get_sample_value("fedbroker_worker_tasks_total", {"worker_id": "w0", "outcome": outcome}) or 0

    foreign, malformed = count("foreign_sender"), count("malformed")
    settled: list[str] = []
    agent.on_task(delivery("study-hospital-b", settled))
    agent.on_task(delivery(None, settled))
    assert settled == ["dead", "dead"] and count("foreign_sender") == foreign + 2
    agent.on_task(delivery("study-coordinator", settled))  # the coordinator's is read (this one is malformed)
    assert count("malformed") == malformed + 1 and count("foreign_sender") == foreign + 2


def test_a_ledger_names_its_worker_and_refuses_another(tmp_path: Path) -> None:
    path = str(tmp_path / "ledger.json")
    PrivacyLedger(path).record("job", history=[(1.0, 0.1, 10)], epsilon=1.5)  # written before ledgers named one
    assert PrivacyLedger(path, worker_id="w0").worker_id == "w0"  # claimed on first use, ε kept
    assert json.loads(Path(path).read_text())["worker_id"] == "w0"
    assert PrivacyLedger(path).total_epsilon() == pytest.approx(1.5)
    with pytest.raises(ConfigError, match="privacy ledger of worker 'w0', not of 'w1'"):
        PrivacyLedger(path, worker_id="w1")
