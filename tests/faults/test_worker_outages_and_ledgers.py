"""A worker rides out an aggregation service that cannot take its update (down, or its spool disk full) for as
long as the round can still use the update, and gives up at the round's deadline; a worker whose ledger was
lost refuses to train, and the coordinator's recorded ε does not fall. Real broker, real gRPC service."""

from __future__ import annotations

import errno
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import fedbroker.aggregators.spool as spool_module
import fedbroker.rpc.plumbing
from fedbroker.config import DPPolicy
from fedbroker.errors import ConfigError
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.retry import Backoff
from fedbroker.worker.agent import WorkerAgent
from tests.faults.harness import Federation, Training, job, sample, wait_for

pytestmark = [pytest.mark.integration]

# The old budget: 5 deliveries of a task (broker.max_attempts), each ending at its first refusal.
OLD_BUDGET_ATTEMPTS = 5 * 5
DP = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=1000.0)


class FullDisk:
    """The disk under the service's spool is full for updates while `full` is set (the file write itself
    fails with ENOSPC, as on a full volume); counts the refused writes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = threading.Event()
        self.full.set()
        self.refused = 0
        real = spool_module._write_npz

        def write(path: Path, *args: Any, **kwargs: Any) -> None:
            if self.full.is_set() and path.parent.name.startswith("round-"):
                self.refused += 1
                raise OSError(errno.ENOSPC, "No space left on device")
            real(path, *args, **kwargs)

        monkeypatch.setattr(spool_module, "_write_npz", write)


@pytest.fixture
def quick_rpc_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retries every few tens of milliseconds, so many more tries than the old budget take seconds."""
    monkeypatch.setattr(fedbroker.rpc.plumbing, "RPC_BACKOFF", Backoff(initial_s=0.02, max_s=0.1))


def reports(agent: WorkerAgent) -> list[tuple[float, int, str]]:
    """(time, status, reason) of every outcome the worker reports from now on."""
    out: list[tuple[float, int, str]] = []
    report = agent._report

    def recording(task: pb.RoundTask, status: Any, reason: str, **kwargs: Any) -> None:
        out.append((time.time(), status, reason))
        report(task, status, reason, **kwargs)

    agent._report = recording  # type: ignore[method-assign]
    return out


@pytest.mark.timeout(90)
def test_worker_retries_a_full_spool_past_the_old_budget_and_uploads_once_it_has_room(
        federation: Federation, training: Training, quick_rpc_retries: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    fed = federation
    disk = FullDisk(monkeypatch)
    refused_before = sample("fedbroker_aggregator_uploads_rejected_total", {"reason": "spool_full"})
    worker = fed.add_worker("patient", index=0, count=2)
    told = reports(worker)
    # the round's deadline is NEVER_S: the worker retries until the test gives the spool room, however slowly
    job_id = fed.submit(job(training={"rounds": 1}, schedule={"min_workers": 1}))
    wait_for(lambda: disk.refused > 2 * OLD_BUDGET_ATTEMPTS, 40, "the worker to keep retrying its upload")
    assert told == []  # still retrying: nothing reported, nothing dead-lettered
    assert [p.status for p in fed.store.participants(job_id, 1)] == ["published"]
    disk.full.clear()  # room again
    fed.wait_job(job_id, 30)
    assert [(p.worker_id, p.status) for p in fed.store.participants(job_id, 1)] == [("patient", "aggregated")]
    assert training.count["patient"] == 1  # the same update, re-sent: trained (and ε spent) once
    assert sample("fedbroker_aggregator_uploads_rejected_total", {"reason": "spool_full"}) - refused_before \
        == disk.refused  # refused as spool_full (UNAVAILABLE), never as an opaque UNKNOWN
    assert fed.dead_letters() == []


@pytest.mark.timeout(120)
def test_worker_gives_up_on_a_full_spool_at_the_rounds_deadline_not_before(
        federation: Federation, training: Training, quick_rpc_retries: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline is the test's subject, so it is a real one: 20 s, in which a worker that trains in well under
    a second and retries every 0.1 s at most tries far more than the old budget even on a loaded machine."""
    fed = federation
    disk = FullDisk(monkeypatch)
    worker = fed.add_worker("patient", index=0, count=2)
    told = reports(worker)
    job_id = fed.submit(job(training={"rounds": 1}, schedule={"min_workers": 1, "round_timeout_s": 20}))
    wait_for(lambda: told, 60, "the worker to give up")
    deadline = float(fed.store.round(job_id, 1).deadline)
    ((when, status, reason),) = told
    assert status == pb.TaskOutcome.FAILED
    assert when >= deadline, f"gave up {deadline - when:.2f}s before the round's deadline: {reason}"
    assert disk.refused > OLD_BUDGET_ATTEMPTS
    assert training.count["patient"] == 1
    row = wait_for(lambda: (r := fed.store.job(job_id)).status != "running" and r, 20, "the job to end")
    assert row.status == "failed" and "min_clients" in row.error
    assert fed.dead_letters() == []  # reported and acked at the deadline, not dead-lettered


@pytest.mark.timeout(120)
def test_worker_whose_ledger_was_lost_refuses_to_train_and_the_recorded_epsilon_does_not_fall(
        federation: Federation, training: Training) -> None:
    fed = federation
    first = fed.add_worker("owner", index=0, count=2, dp=DP)
    done = fed.submit(job(training={"rounds": 1}, schedule={"min_workers": 1}))
    fed.wait_job(done, 60)
    spent = first.ledger.total_epsilon()
    assert spent > 0
    wait_for(lambda: fed.store.recorded_epsilon("owner") == pytest.approx(spent, rel=1e-9), 10,
             "the coordinator to record the worker's ε")
    fed.stop_worker("owner")

    ledger = Path(first.ledger.path)
    ledger.unlink()
    with pytest.raises(ConfigError, match="missing, but its mark"):  # the mark next to it still knows
        fed.add_worker("owner", index=0, count=2, dp=DP)
    Path(first.ledger.mark_path).unlink()  # the whole folder lost: only the coordinator knows now

    decreases = sample("fedbroker_coordinator_epsilon_decreases_total", {"message": "registration"})
    second = fed.add_worker("owner", index=0, count=2, dp=DP)
    assert second.ledger.total_epsilon() == 0.0
    wait_for(lambda: sample("fedbroker_coordinator_epsilon_decreases_total", {"message": "registration"})
             > decreases, 10, "the coordinator to notice the lower ε")
    assert fed.store.recorded_epsilon("owner") == pytest.approx(spent, rel=1e-9)  # kept, not lowered

    refused = sample("fedbroker_worker_tasks_refused_total", {"worker_id": "owner", "reason": "ledger_behind"})
    job_id = fed.submit(job(training={"rounds": 1}, schedule={"min_workers": 1}))  # ends on the refusal
    row = wait_for(lambda: (r := fed.store.job(job_id)).status in ("completed", "failed") and r, 40,
                   "the job to end")
    assert row.status == "failed"  # its only worker refused: nothing trained, nothing aggregated
    (p,) = fed.store.participants(job_id, 1)
    assert p.status == "refused" and "ledger" in p.reason and "restore" in p.reason
    assert training.count["owner"] == 1  # only the first job's round
    assert second.ledger.total_epsilon() == 0.0
    assert sample("fedbroker_worker_tasks_refused_total", {"worker_id": "owner", "reason": "ledger_behind"}) \
        == refused + 1
    time.sleep(1.0)  # heartbeats with the lower ε keep coming: the record still does not fall
    assert fed.store.recorded_epsilon("owner") == pytest.approx(spent, rel=1e-9)
