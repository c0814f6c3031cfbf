"""What a worker charges and shares: the noised label histogram is charged to its ledger once, reported in
its ε, kept across restarts, and is all that DWFed's ISH is computed from; a ledger that holds less ε than
the coordinator recorded makes the worker refuse to train."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedbroker import envelope
from fedbroker.bus import open_bus
from fedbroker.catalogue import settings_from_json
from fedbroker.config import DPPolicy, WorkerConfig
from fedbroker.errors import ConfigError, LedgerBehind
from fedbroker.label_stats import reported_ish
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker.agent import WorkerAgent

DWFED = {"alignment": "none", "weighting": "dwfed", "selection": "all", "weighting_params": {"ish_form": "ratio"}}


def agent(tmp_path: Path, *, histogram_epsilon: float, budget: float = 10.0) -> tuple[WorkerAgent, list[Any]]:
    config = WorkerConfig(id="owner", ledger_path=str(tmp_path / "ledger.json"), device="cpu",
                          histogram_epsilon=histogram_epsilon,
                          dp=DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=budget))
    sent: list[Any] = []
    bus = open_bus(None, namespace=f"privacy-{tmp_path.name}")
    bus.publish_control = lambda body: sent.append(envelope.decode(body, expect=("registration", "heartbeat")))  # type: ignore[method-assign]
    return WorkerAgent(config, bus), sent


def test_the_noised_histogram_is_charged_once_reported_in_epsilon_and_kept_across_restarts(tmp_path: Path) -> None:
    worker, sent = agent(tmp_path, histogram_epsilon=0.5)
    assert worker.ledger.total_epsilon() == pytest.approx(0.5)
    worker.register()
    registration = sent[-1].registration
    assert registration.epsilon_spent == pytest.approx(0.5)
    assert list(registration.label_histogram) == [int(c) for c in worker.shared_histogram]
    doc = json.loads((tmp_path / "ledger.json").read_text(encoding="utf-8"))
    assert doc["releases"]["label_histogram"]["epsilon"] == 0.5
    restarted, _ = agent(tmp_path, histogram_epsilon=0.5)  # the same draw again, at no new cost
    assert restarted.ledger.total_epsilon() == pytest.approx(0.5)
    assert np.array_equal(restarted.shared_histogram, worker.shared_histogram)
    redrawn, _ = agent(tmp_path, histogram_epsilon=2.0)  # another ε: a new release, and both count
    assert redrawn.ledger.total_epsilon() == pytest.approx(2.5)


def test_an_exact_histogram_costs_nothing_and_a_release_past_the_budget_is_refused(tmp_path: Path) -> None:
    exact, _ = agent(tmp_path / "exact", histogram_epsilon=0.0)
    assert exact.ledger.total_epsilon() == 0.0 and np.array_equal(exact.shared_histogram, exact.histogram)
    with pytest.raises(ConfigError, match="worker.histogram_epsilon: .* above the owner's budget 1"):
        agent(tmp_path / "poor", histogram_epsilon=3.0, budget=1.0)


def test_dwfed_ish_is_computed_from_the_released_histogram_not_the_exact_one(tmp_path: Path) -> None:
    worker, _ = agent(tmp_path, histogram_epsilon=0.01)  # noise of scale 100 per count: far from the data
    assert not np.array_equal(worker.shared_histogram, worker.histogram)
    population = [0.1] * 10
    task = pb.RoundTask(population_distribution=population, participants=3, aggregation_json=json.dumps(DWFED))
    settings = settings_from_json(json.dumps(DWFED))
    released = reported_ish(worker.shared_histogram, population, participants=3, settings=settings)
    exact = reported_ish(worker.histogram, population, participants=3, settings=settings)
    assert released != exact
    assert worker._ish(task) == released


def test_a_ledger_below_the_coordinators_record_refuses_to_train(tmp_path: Path) -> None:
    worker, _ = agent(tmp_path, histogram_epsilon=0.0)
    worker.check_ledger(0.0)
    with pytest.raises(LedgerBehind, match=r"holds ε 0, below the 3.93 the coordinator recorded .* restore it"):
        worker.check_ledger(3.93)
