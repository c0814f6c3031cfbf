"""A round opens only with workers that can afford it: what a worker's heartbeat reports (its ε left, and the
cost of each job's next round) and how the coordinator reads it (coordinator/participants.py)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from fedbroker.bus import envelope, open_bus
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig
from fedbroker.coordinator.participants import WorkerBudget, budget_from_heartbeat, why_unaffordable
from fedbroker.coordinator.records import WorkerRecord
from fedbroker.errors import BudgetExceeded
from fedbroker.job.spec import TrainingConfig
from fedbroker.privacy import job_epsilon_after_round
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker.agent import WorkerAgent

TRAINING = TrainingConfig(local_epochs=1, batch_size=32)
POLICY = {"noise_multiplier": 1.1, "max_grad_norm": 1.0, "delta": 1e-5, "epsilon_budget": 1.0}


def record(*, dp_enabled: bool = True, spent: float = 0.0, budget: float = 1.0, samples: int = 400) -> WorkerRecord:
    return WorkerRecord(worker_id="w", categories=("digits",), histogram=(),
                        dp=DPPolicy(enabled=dp_enabled, **{**POLICY, "epsilon_budget": budget}), epsilon_spent=spent,
                        device="cpu", num_samples=samples, last_seen=time.time())


def first_round(samples: int = 400) -> float:
    return job_epsilon_after_round([], num_samples=samples, config=TRAINING, noise_multiplier=1.1, delta=1e-5)


def test_a_worker_without_dp_or_without_a_budget_can_always_afford_a_round() -> None:
    assert why_unaffordable(record(dp_enabled=False), None, job_id="j", training=TRAINING) == ""
    assert why_unaffordable(record(), WorkerBudget(None), job_id="j", training=TRAINING) == ""


def test_before_its_first_heartbeat_the_registered_policy_prices_the_first_round() -> None:
    cost = first_round()
    assert why_unaffordable(record(budget=cost * 2), None, job_id="j", training=TRAINING) == ""
    why = why_unaffordable(record(budget=cost * 2, spent=cost * 1.5), None, job_id="j", training=TRAINING)
    assert why == f"the round would cost ε {cost:.3f}, {cost * 0.5:.3f} left of its budget"


def test_the_heartbeat_cost_decides_for_a_job_the_worker_knows() -> None:
    assert why_unaffordable(record(), WorkerBudget(0.5, {"j": 0.4}), job_id="j", training=TRAINING) == ""
    assert "would cost ε 0.600, 0.500 left" in why_unaffordable(record(), WorkerBudget(0.5, {"j": 0.6}), job_id="j",
                                                                  training=TRAINING)
    # on its ledger but its settings unknown (the worker restarted): the worker decides, while ε is left
    assert why_unaffordable(record(), WorkerBudget(0.5, {"j": None}), job_id="j", training=TRAINING) == ""
    assert "budget is spent" in why_unaffordable(record(), WorkerBudget(0.0, {"j": None}), job_id="j",
                                                 training=TRAINING)
    # a job it does not list has no history on its ledger: the first round's cost against what is left
    assert "would cost ε" in why_unaffordable(record(), WorkerBudget(first_round() / 2, {}), job_id="new",
                                              training=TRAINING)


def agent(tmp_path: Path, budget: float) -> tuple[WorkerAgent, list[Any]]:
    config = WorkerConfig(id="owner", ledger_path=str(tmp_path / "ledger.json"), device="cpu",
                          partition=PartitionSection(num_clients=3, client_index=0),
                          dp=DPPolicy(**{**POLICY, "epsilon_budget": budget}))
    sent: list[Any] = []
    bus = open_bus(None, namespace=f"afford-{tmp_path.name}")
    bus.publish_control = lambda body: sent.append(envelope.decode(body, expect=("heartbeat",)))  # type: ignore[method-assign]
    return WorkerAgent(config, bus), sent


def test_a_worker_heartbeat_reports_its_budget_and_each_known_jobs_next_round_cost(tmp_path: Path) -> None:
    worker, sent = agent(tmp_path, budget=0.05)
    n = len(worker.y)
    worker.ledger.record("old", history=[(1.1, 0.1, 10)], epsilon=0.01)
    task = pb.RoundTask(job_id="j", round=1, category="digits", training_json=json.dumps(asdict(TRAINING)),
                        deadline_unix=time.time() + 60)
    with pytest.raises(BudgetExceeded):   # the worker's own check still refuses, before anything else
        worker.run_task(task)
    worker.send_heartbeat()
    beat = sent[-1].heartbeat
    assert beat.budget_limited and beat.epsilon_left == pytest.approx(0.05 - 0.01)
    assert beat.epsilon_spent == pytest.approx(0.01)
    costs = {c.job_id: c for c in beat.job_costs}
    assert set(costs) == {"old", "j"}
    assert not costs["old"].known   # on the ledger, but no task of it seen since the worker started
    expected = job_epsilon_after_round([], num_samples=n, config=TRAINING, noise_multiplier=1.1, delta=1e-5)
    assert costs["j"].known and costs["j"].next_round_epsilon == pytest.approx(expected)
    # the coordinator reads the same: this worker cannot afford job j
    budget = budget_from_heartbeat(beat)
    assert "would cost ε" in why_unaffordable(record(samples=n, budget=0.05), budget, job_id="j", training=TRAINING)


def test_a_worker_without_dp_reports_no_budget(tmp_path: Path) -> None:
    config = WorkerConfig(id="free", ledger_path=str(tmp_path / "l.json"), device="cpu", dp=DPPolicy(enabled=False))
    beat = WorkerAgent(config, open_bus(None, namespace="afford-free")).heartbeat()
    assert not beat.budget_limited and not beat.job_costs
    assert budget_from_heartbeat(beat) == WorkerBudget(None)
