"""What a worker charges and shares: no label histogram at registration; the noised one goes only to a job
that asks, charged to its ledger once when first asked, reported in its ε, kept across restarts, and is all
that DWFed's ISH is computed from; a ledger that holds less ε than the coordinator recorded makes the
worker refuse to train."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedbroker.bus import envelope, open_bus
from fedbroker.config import DPPolicy, WorkerConfig
from fedbroker.errors import BudgetExceeded, LedgerBehind
from fedbroker.job.settings import sections_settings, settings_digest
from fedbroker.label_stats import reported_ish
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker.agent import WorkerAgent

DWFED = {"alignment": "none", "weighting": "dwfed", "selection": "all", "weighting_params": {"ish_form": "ratio"}}
ASK_HISTOGRAM = pb.ShareRequest(job_id="dwfed-job", category="digits", histogram=True)


def agent(tmp_path: Path, *, histogram_epsilon: float, budget: float = 10.0) -> tuple[WorkerAgent, list[Any]]:
    config = WorkerConfig(id="owner", ledger_path=str(tmp_path / "ledger.json"), device="cpu",
                          histogram_epsilon=histogram_epsilon,
                          dp=DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=budget))
    sent: list[Any] = []
    bus = open_bus(None, namespace=f"privacy-{tmp_path.name}")
    bus.publish_control = lambda body: sent.append(envelope.decode(body, expect=("registration", "heartbeat")))  # type: ignore[method-assign]
    return WorkerAgent(config, bus), sent


def test_registration_carries_no_histogram_and_starting_spends_nothing(tmp_path: Path) -> None:
    worker, sent = agent(tmp_path, histogram_epsilon=0.5)
    worker.register()
    registration = sent[-1].registration
    assert list(registration.label_histogram) == [] and registration.epsilon_spent == 0.0
    assert registration.num_samples == len(worker.y) and registration.num_classes == 10
    assert list(registration.input_shape) == [1, 8, 8]
    assert worker.ledger.total_epsilon() == 0.0 and worker.ledger.release("label_histogram") is None


def test_the_noised_histogram_is_charged_once_when_first_asked_reported_in_epsilon_and_kept_across_restarts(
        tmp_path: Path) -> None:
    worker, sent = agent(tmp_path, histogram_epsilon=0.5)
    first = worker.sharing.reply(ASK_HISTOGRAM)
    assert not first.refused and first.histogram_noised and first.histogram_epsilon == 0.5
    assert worker.ledger.total_epsilon() == pytest.approx(0.5)
    again = worker.sharing.reply(pb.ShareRequest(job_id="another-job", category="digits", histogram=True))
    assert list(again.label_histogram) == list(first.label_histogram)  # the same draw: no new cost
    assert worker.ledger.total_epsilon() == pytest.approx(0.5)
    worker.register()
    assert sent[-1].registration.epsilon_spent == pytest.approx(0.5)
    doc = json.loads((tmp_path / "ledger.json").read_text(encoding="utf-8"))
    assert doc["releases"]["label_histogram"]["epsilon"] == 0.5
    restarted, _ = agent(tmp_path, histogram_epsilon=0.5)
    assert list(restarted.sharing.reply(ASK_HISTOGRAM).label_histogram) == list(first.label_histogram)
    assert restarted.ledger.total_epsilon() == pytest.approx(0.5)
    redrawn, _ = agent(tmp_path, histogram_epsilon=2.0)  # another ε: a new release, and both count
    assert redrawn.sharing.reply(ASK_HISTOGRAM).histogram_epsilon == 2.0
    assert redrawn.ledger.total_epsilon() == pytest.approx(2.5)


def test_an_exact_histogram_costs_nothing_and_a_release_past_the_budget_is_refused(tmp_path: Path) -> None:
    exact, _ = agent(tmp_path / "exact", histogram_epsilon=0.0)
    reply = exact.sharing.reply(ASK_HISTOGRAM)
    assert not reply.histogram_noised and reply.histogram_epsilon == 0.0
    assert list(reply.label_histogram) == [int(c) for c in np.bincount(exact.y, minlength=10)]
    assert exact.ledger.total_epsilon() == 0.0
    poor, _ = agent(tmp_path / "poor", histogram_epsilon=3.0, budget=1.0)  # starts: nothing is drawn at start
    refused = poor.sharing.reply(ASK_HISTOGRAM)
    assert refused.refused and not refused.label_histogram
    assert "worker.histogram_epsilon" in refused.reason and "above the owner's budget" in refused.reason
    assert poor.ledger.total_epsilon() == 0.0


def test_dwfed_ish_is_computed_from_the_released_histogram_not_the_exact_one(tmp_path: Path) -> None:
    worker, _ = agent(tmp_path, histogram_epsilon=0.01)  # noise of scale 100 per count: far from the data
    released, _ = worker.sharing.histogram()
    exact_counts = np.bincount(worker.y, minlength=10)
    assert not np.array_equal(released, exact_counts)
    population = [0.1] * 10
    message = sections_settings("j", aggregation=DWFED)
    task = pb.RoundTask(job_id="j", population_distribution=population, participants=3,
                        settings_digest=settings_digest(message), settings=message)
    settings = worker.job_settings.for_task(task, fetch=lambda digest: pytest.fail("carried by the task")).algorithms
    from_release = reported_ish(released, population, participants=3, settings=settings)
    exact = reported_ish(exact_counts, population, participants=3, settings=settings)
    assert from_release != exact
    assert worker._ish(task) == from_release


def test_a_dwfed_task_draws_the_histogram_before_training_and_refuses_when_the_budget_cannot_pay_it(
        tmp_path: Path) -> None:
    """A DWFed round's ISH is computed from the released histogram: a worker asked to train one without having
    released it draws it first (charged), and refuses the task when that alone would pass its budget."""
    poor, _ = agent(tmp_path, histogram_epsilon=3.0, budget=1.0)
    task = pb.RoundTask(job_id="j", round=1, category="digits", population_distribution=[0.1] * 10, participants=2,
                        aggregation_json=json.dumps(DWFED), training_json=json.dumps({"rounds": 1}))
    with pytest.raises(BudgetExceeded, match="worker.histogram_epsilon: .* above the owner's budget"):
        poor.run_task(task)
    assert poor.ledger.total_epsilon() == 0.0


def test_a_ledger_below_the_coordinators_record_refuses_to_train(tmp_path: Path) -> None:
    worker, _ = agent(tmp_path, histogram_epsilon=0.0)
    worker.budget.check_ledger(0.0)
    with pytest.raises(LedgerBehind, match=r"holds ε 0, below the 3.93 the coordinator recorded .* restore it"):
        worker.budget.check_ledger(3.93)
