"""A secure round the aggregation service lost is abandoned and opened again, and the job finishes
(coordinator/secure_reopen.py).

The real aggregation service (gRPC, in this process, on a spool) is restarted on its spool while every worker
trains for secure round 1, after the round's keys and shares were exchanged: the service that comes back holds
the job but not the round's keys or masked sum, the same state a replica finds when it takes a job over from
an owner that died (`SecureSession.lost`), and it refuses the masked uploads saying so. The coordinator
abandons round 1, recorded `abandoned` with that reason and each participant's ε for the training it did, and
opens round 2 from the same global version; each worker trains again (and spends ε again: its own ledger and
the coordinator's record agree). With the bound at 0 the same loss fails the job, naming the cause.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

import fedbroker.worker.agent
from fedbroker.config import DPPolicy
from fedbroker.coordinator import secure_reopen
from fedbroker.job.status import ParticipantStatus, RoundStatus
from fedbroker.secagg.secure_round import ROUND_LOST
from fedbroker.worker.ledger import PrivacyLedger
from tests.faults.harness import Federation, job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WORKERS = ["s1", "s2", "s3"]
SECURE_JOB = job(aggregation={"secure": True, "weighting": "fedavg"}, training={"rounds": 1},
                 evaluation={"every": 0}, schedule={"min_workers": 3, "min_clients": 3})


class FirstTrainingHeld:
    """Each worker's first training waits for `release` (after `entered` names it): the keys and shares of
    round 1 are exchanged by then, and no masked upload has reached the service."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real, self.release, self.entered = real, threading.Event(), set[str]()
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        worker = threading.current_thread().name.rpartition(".")[2]
        with self._lock:
            first = worker not in self.entered
            self.entered.add(worker)
        if first:
            self.release.wait(60)
        return self.real(*args, **kwargs)


def lose_round_one(federation: Federation, monkeypatch: pytest.MonkeyPatch) -> str:
    """Submit the secure job, restart the service on its spool while round 1 trains; the job's id."""
    held = FirstTrainingHeld(fedbroker.worker.agent.train_local)
    monkeypatch.setattr(fedbroker.worker.agent, "train_local", held)
    for index, worker in enumerate(WORKERS):
        federation.add_worker(worker, index=index, count=len(WORKERS), dp=DPPolicy(enabled=True, epsilon_budget=100))
    job_id = federation.submit(SECURE_JOB)
    wait_for(lambda: held.entered >= set(WORKERS), 60, "every worker training round 1")
    federation.stop_aggregator()
    federation.start_aggregator()  # on its spool: the job is back, round 1's keys and masked sum are not
    held.release.set()
    return job_id


def finished(federation: Federation, job_id: str) -> Any:
    return wait_for(lambda: (r := federation.store.job(job_id)) is not None and r.status in ("completed", "failed")
                    and r, 90, f"job {job_id} to finish", interval=0.1)


def test_a_lost_secure_round_is_abandoned_and_opened_again(federation: Federation,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = lose_round_one(federation, monkeypatch)
    row = finished(federation, job_id)
    assert row.status == "completed", row.error

    store = federation.store
    lost, again = store.rounds(job_id)
    assert (lost.round, lost.status, again.round, again.status) == (1, RoundStatus.ABANDONED, 2, RoundStatus.CLOSED)
    assert lost.model_version is None and again.model_version is not None  # no version came of round 1
    abandoned = [e.message for e in store.events(job_id) if e.kind == "round_abandoned"]
    assert len(abandoned) == 1 and ROUND_LOST in abandoned[0] and "re-opened as round 2" in abandoned[0]

    first = {p.worker_id: p for p in store.participants(job_id, 1)}
    second = {p.worker_id: p for p in store.participants(job_id, 2)}
    assert set(first) == set(second) == set(WORKERS)
    for worker in WORKERS:
        # round 1: trained, refused by the service that lost the round, its ε kept on its row
        assert first[worker].status == ParticipantStatus.FAILED and ROUND_LOST in (first[worker].reason or "")
        assert first[worker].epsilon is not None and first[worker].epsilon > 0
        # round 2: trained again; the job's ε on the site is cumulative, so the record is the ledger's, once
        assert second[worker].status == ParticipantStatus.AGGREGATED
        ledger = PrivacyLedger(str(federation.tmp / f"{worker}-ledger.json"), worker_id=worker)
        spent = ledger.epsilon(job_id)
        assert second[worker].epsilon == pytest.approx(spent, rel=1e-9) and spent > first[worker].epsilon
        assert store.recorded_epsilon(worker) == pytest.approx(ledger.total_epsilon(), rel=1e-9)
        history = ledger.history(job_id)  # (noise, sampling rate, steps), steps summed over equal rates
        assert sum(steps for _, _, steps in history) == 2 * round(1 / history[0][1])  # two one-epoch trainings


def test_the_job_fails_naming_the_cause_once_its_reopens_are_spent(federation: Federation,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(secure_reopen, "MAX_SECURE_REOPENS", 0)
    job_id = lose_round_one(federation, monkeypatch)
    row = finished(federation, job_id)
    assert row.status == "failed"
    assert ROUND_LOST in row.error and "MAX_SECURE_REOPENS 0" in row.error
    assert [(r.round, r.status) for r in federation.store.rounds(job_id)] == [(1, RoundStatus.FAILED)]
    # no later round closes, so the ε of round 1's trainings reaches the record by the workers' reports alone
    def on_record(worker: str) -> bool:  # the ledger as the worker last wrote it, beside what the store recorded
        ledger = PrivacyLedger(str(federation.tmp / f"{worker}-ledger.json"), worker_id=worker)
        spent = ledger.epsilon(job_id)
        return spent > 0 and federation.store.recorded_epsilon(worker) == pytest.approx(ledger.total_epsilon(),
                                                                                        rel=1e-9)

    for worker in WORKERS:
        wait_for(lambda w=worker: on_record(w), 60, f"{worker}'s reported ε on the record")
