"""A job cancelled while its workers train: the ε they spend finishing that training is spent all the same,
and the job's record keeps it (the upload is refused, the outcome that says so carries the ε)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import fedbroker.worker.agent
from fedbroker.config import DPPolicy
from tests.faults.harness import Federation, job, wait_for

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(120)
def test_the_epsilon_of_a_training_that_outlives_its_jobs_cancel_stays_on_the_jobs_record(
        federation: Federation, monkeypatch: pytest.MonkeyPatch) -> None:
    fed = federation
    training, cancelled = threading.Event(), threading.Event()
    real = fedbroker.worker.agent.train_local

    def train_across_the_cancel(*args: Any, progress: Any = None, **kwargs: Any) -> Any:
        def step(done: int, total: int) -> None:
            training.set()
            cancelled.wait(60)  # the job is cancelled while this worker trains
            if progress is not None:
                progress(done, total)

        return real(*args, progress=step, **kwargs)

    monkeypatch.setattr(fedbroker.worker.agent, "train_local", train_across_the_cancel)
    dp = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=1000.0)
    fed.add_worker("h1", index=0, count=1, dp=dp)
    job_id = fed.submit(job(schedule={"min_workers": 1}, training={"rounds": 2}))
    assert training.wait(60), "the worker never started training"
    assert fed.coordinator is not None
    assert fed.coordinator.cancel(job_id, by="test") == "cancelled"
    cancelled.set()  # it finishes, spends its ε, and its upload is refused: the round was abandoned

    def recorded() -> Any:
        (row,) = fed.store.participants(job_id, 1)
        return row if row.epsilon else None

    row = wait_for(recorded, 60, "the refused upload's ε on the job's record")
    spent = fed.workers["h1"].ledger.epsilon(job_id)
    assert spent > 0 and row.epsilon == pytest.approx(spent)
    assert row.status == "cancelled" and "ε" in row.reason
    assert fed.store.job(job_id).status == "cancelled"
