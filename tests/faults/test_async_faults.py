"""Asynchronous mode under faults, against the real RabbitMQ and gRPC: the aggregation service, the
coordinator or a worker dies mid-job, and still every update that got a (first) receipt is counted in
exactly one version (or the closed buffer), and none twice.

The fault falls mid-job by construction: the slow worker holds its first task (unacked, untrained) until
the test releases it, after the fast worker's first update is in."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from fedbroker.worker.agent import WorkerAgent
from tests.faults.harness import Federation, HoldsNth, Training, job, wait_for

pytestmark = [pytest.mark.integration]

ASYNC_JOB = job(training={"rounds": 4},
                schedule={"mode": "async", "buffer_size": 2, "max_staleness": 8, "staleness": "hinge"})


class Receipts:
    """Every receipt a worker's upload got: (worker, task, duplicate)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.seen: list[tuple[str, int, bool]] = []
        self._lock = threading.Lock()
        real = WorkerAgent._upload

        def upload(agent: WorkerAgent, client: Any, task: Any, result: Any) -> Any:
            receipt = real(agent, client, task, result)
            with self._lock:
                self.seen.append((agent.config.id, task.round, receipt.duplicate))
            return receipt

        monkeypatch.setattr(WorkerAgent, "_upload", upload)

    def first(self) -> set[tuple[str, int]]:
        with self._lock:
            return {(w, t) for w, t, duplicate in self.seen if not duplicate}


@pytest.fixture
def receipts(monkeypatch: pytest.MonkeyPatch) -> Receipts:
    return Receipts(monkeypatch)


def counted(fed: Federation, job_id: str) -> Counter[tuple[str, int]]:
    """(worker, task) of every update in the job's versions and its (closed) buffer, with multiplicity."""
    state = fed.book.buffer_status(job_id)[1]
    folded = [u for v in state.summaries for u in v.updates] + state.folded
    return Counter((u.worker_id, u.task) for u in folded)


def start(fed: Federation, receipts: Receipts) -> tuple[str, type[HoldsNth], int]:
    """The job, the slow worker's holder, and the fast worker's first task (its update accepted)."""
    held = HoldsNth.nth(1)
    fed.add_worker("fast", index=0, count=2)
    fed.add_worker("slow", index=1, count=2, agent_class=held)
    job_id = fed.submit(ASYNC_JOB)
    wait_for(lambda: "slow" in held.holding and any(w == "fast" for w, _ in receipts.first()), 60,
             "the fast worker's first update, the slow one holding its task")
    (fast_task,) = sorted(t for w, t in receipts.first() if w == "fast")[:1]
    return job_id, held, fast_task


def assert_each_receipt_counted_once(fed: Federation, job_id: str, receipts: Receipts) -> None:
    counts = counted(fed, job_id)
    assert all(n == 1 for n in counts.values()), counts          # none twice
    assert receipts.first() <= set(counts), (receipts.first(), counts)  # none lost
    rows = fed.store.rounds(job_id)
    assert [r.round for r in rows] == [1, 2, 3, 4] and len({r.model_version for r in rows}) == 4


@pytest.mark.timeout(120)
def test_async_service_restart_loses_no_accepted_update(federation: Federation, training: Training,
                                                         receipts: Receipts) -> None:
    fed = federation
    job_id, held, fast_task = start(fed, receipts)
    fed.stop_aggregator()
    fed.start_aggregator(spool=True)  # same port, same spool
    held.release.set()
    fed.wait_job(job_id, 90)
    assert_each_receipt_counted_once(fed, job_id, receipts)
    assert ("fast", fast_task) in counted(fed, job_id)  # accepted before the crash, counted after it


@pytest.mark.timeout(120)
def test_async_coordinator_restart_resumes_without_double_counting(federation: Federation, training: Training,
                                                                   receipts: Receipts) -> None:
    fed = federation
    job_id, held, _ = start(fed, receipts)
    fed.stop_coordinator()
    fed.start_coordinator()  # resumes the job: asks the service where it is, re-sends outstanding tasks
    held.release.set()
    fed.wait_job(job_id, 90)
    assert_each_receipt_counted_once(fed, job_id, receipts)


@pytest.mark.timeout(120)
def test_async_worker_crash_mid_task_gets_its_task_again(federation: Federation, training: Training,
                                                          receipts: Receipts) -> None:
    fed = federation
    fast, slow = HoldsNth.nth(2), HoldsNth.nth(1)  # fast holds its second task until slow's redelivered one is in
    fed.add_worker("fast", index=0, count=2, agent_class=fast)
    fed.add_worker("slow", index=1, count=2, agent_class=slow)
    job_id = fed.submit(ASYNC_JOB)
    wait_for(lambda: "slow" in slow.holding and "fast" in fast.holding, 60, "both workers holding a task")
    task = slow.holding["slow"]
    fed.stop_worker("slow")  # dies holding its task, unacked: the broker redelivers it to the next consumer
    fed.add_worker("slow", index=1, count=2)
    wait_for(lambda: fed.book.status(job_id, task)[0] == ["slow"], 60, "the redelivered task's update")
    fast.release.set()
    fed.wait_job(job_id, 90)
    slow.release.set()  # the dead agent's thread wakes after the job ended: its upload is refused
    assert_each_receipt_counted_once(fed, job_id, receipts)
    assert counted(fed, job_id)[("slow", task)] == 1
