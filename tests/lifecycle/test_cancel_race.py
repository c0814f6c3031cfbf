"""A cancel that lands as its job ends never rewrites how the job ended: the store cancels only a job that has
not ended, and the coordinator reads the status under the lock its job threads leave by. The interleaving is
made by construction (the job completes between the cancel's read and its write), never by sleeping.

Nor does a job cancelled as its thread starts ever run: the store marks `running` only a pending (or resumed
running) job, and the thread stops when it will not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from fedbroker.bus import open_bus
from fedbroker.config import DPPolicy
from fedbroker.coordinator.records import JobRecord
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.errors import Conflict
from fedbroker.job.spec import parse_job
from fedbroker.job.status import JobStatus
from fedbroker.rpc.aggregation_client import AggregatorClient
from tests.lifecycle.test_jobs import JOB


def add_job(store: StateStore, job_id: str) -> None:
    job = parse_job(JOB)
    store.add_job(job_id, job.name, job.to_json(), job.training.rounds, job.model.to_json(), submitter="alice")


@pytest.mark.parametrize("ended", [JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED])
def test_the_store_cancels_only_a_job_that_has_not_ended(tmp_path: Path, ended: JobStatus) -> None:
    store = StateStore(str(tmp_path / "state.sqlite"))
    add_job(store, "done")
    store.set_job_status("done", ended, "how it ended")
    changed = store.cancel_job("done", by="alice", round_number=1, discarded=[("w1", 5, 0.1, 0.2)])
    row = store.job("done")
    assert row is not None and (row.status, row.error) == (ended, "how it ended")
    assert changed is False
    assert [e.kind for e in store.events("done")].count(JobStatus.CANCELLED) == (ended == JobStatus.CANCELLED)
    assert "round_abandoned" not in [e.kind for e in store.events("done")]

    add_job(store, "live")
    store.set_job_status("live", JobStatus.RUNNING)
    assert store.cancel_job("live", by="alice") is True
    live = store.job("live")
    assert live is not None and (live.status, live.error) == (JobStatus.CANCELLED, "cancelled by alice")


class CompletesAfterTheRead(StateStore):
    """The job's thread writes `completed` right after the cancel read the job's status: the race, made."""

    racing: str | None = None

    def job(self, job_id: str) -> JobRecord | None:
        row = super().job(job_id)
        if job_id == self.racing:
            self.racing = None
            self.set_job_status(job_id, JobStatus.COMPLETED)
        return row


def test_a_cancel_landing_as_the_job_completes_leaves_it_completed(tmp_path: Path) -> None:
    store = CompletesAfterTheRead(str(tmp_path / "state.sqlite"))
    add_job(store, "j-1")
    store.set_job_status("j-1", JobStatus.RUNNING)  # left running by a stopped coordinator, not driven here
    coordinator = Coordinator(bus=open_bus(None, namespace="race"), store=store,
                              aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                              checkpoint_dir=str(tmp_path / "ck"))
    store.racing = "j-1"
    with pytest.raises(Conflict, match="already completed"):
        coordinator.cancel("j-1", by="alice")
    row = store.job("j-1")
    assert row is not None and row.status == JobStatus.COMPLETED and row.error == ""
    assert JobStatus.CANCELLED not in [e.kind for e in store.events("j-1")]


# ----- a job cancelled as its thread starts never runs -----------------------------------------------


def to_status(store: StateStore, job_id: str, status: JobStatus) -> None:
    """A pending job brought to `status` the way the coordinator gets it there."""
    if status in (JobStatus.RUNNING, JobStatus.CANCELLING):
        store.set_job_status(job_id, JobStatus.RUNNING)
    if status == JobStatus.CANCELLING:
        store.request_cancel(job_id, by="alice")
    elif status == JobStatus.CANCELLED:
        store.cancel_job(job_id, by="alice")
    elif status in (JobStatus.COMPLETED, JobStatus.FAILED):
        store.set_job_status(job_id, status, "how it ended" if status == JobStatus.FAILED else "")


@pytest.mark.parametrize("before", list(JobStatus))
def test_the_store_marks_running_only_a_pending_or_resumed_job(tmp_path: Path, before: JobStatus) -> None:
    store = StateStore(str(tmp_path / "state.sqlite"))
    add_job(store, "j-1")
    to_status(store, "j-1", before)
    events = [e.kind for e in store.events("j-1")]
    changed = store.set_job_status("j-1", JobStatus.RUNNING)
    row = store.job("j-1")
    assert row is not None
    if before in (JobStatus.PENDING, JobStatus.RUNNING):
        assert changed is True and row.status == JobStatus.RUNNING
    else:
        assert changed is False and row.status == before
        assert [e.kind for e in store.events("j-1")] == events
    if before in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED):  # ended: nothing rewrites it
        assert store.set_job_status("j-1", JobStatus.FAILED, "late failure") is False
        assert store.job("j-1") == row


def with_a_worker(store: StateStore) -> None:
    """One active worker of the job's category: the job's thread does not wait, it goes on to mark it running."""
    store.upsert_worker(worker_id="w1", categories=["digits"], histogram=[10] * 10, dp=DPPolicy(enabled=False),
                        epsilon_spent=0.0, device="cpu", num_samples=100, input_shape=[1, 8, 8], num_classes=10)


def coordinator_on(store: StateStore, tmp_path: Path) -> Coordinator:
    return Coordinator(bus=open_bus(None, namespace="race"), store=store,
                       aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                       checkpoint_dir=str(tmp_path / "ck"), poll_interval_s=0.05, aggregator_outage_s=5.0)


class CancelledAsStartReadsIt(StateStore):
    """A cancel lands right after `Coordinator.start` read the pending jobs, before it launches them."""

    on_pending_read: Callable[[], object] | None = None

    def jobs(self, status: JobStatus | None = None) -> list[JobRecord]:
        rows = super().jobs(status)
        if status == JobStatus.PENDING and self.on_pending_read is not None:
            hook, self.on_pending_read = self.on_pending_read, None
            hook()
        return rows


def test_a_pending_job_cancelled_as_the_coordinator_starts_never_runs(tmp_path: Path) -> None:
    store = CancelledAsStartReadsIt(str(tmp_path / "state.sqlite"))
    with_a_worker(store)
    add_job(store, "j-1")  # left pending by a stopped coordinator
    coordinator = coordinator_on(store, tmp_path)
    cancelled: list[str] = []
    store.on_pending_read = lambda: cancelled.append(coordinator.cancel("j-1", by="alice"))
    coordinator.start()
    try:
        assert coordinator.wait("j-1", timeout=30) == JobStatus.CANCELLED
    finally:
        coordinator.stop()
    assert cancelled == [JobStatus.CANCELLED]
    row = store.job("j-1")
    assert row is not None and (row.status, row.error) == (JobStatus.CANCELLED, "cancelled by alice")
    assert [e.kind for e in store.events("j-1")] == ["submitted", JobStatus.CANCELLED]
    assert store.rounds("j-1") == []


class CancelledAsTheThreadMarksItRunning(StateStore):
    """The job's cancel is recorded just before its thread marks it running: the race, made."""

    racing: str | None = None

    def set_job_status(self, job_id: str, status: JobStatus, error: str = "") -> bool:
        if job_id == self.racing and status == JobStatus.RUNNING:
            self.racing = None
            assert self.cancel_job(job_id, by="alice")
        return super().set_job_status(job_id, status, error)


def test_a_job_cancelled_as_its_thread_marks_it_running_stays_cancelled_and_never_runs(tmp_path: Path) -> None:
    store = CancelledAsTheThreadMarksItRunning(str(tmp_path / "state.sqlite"))
    with_a_worker(store)
    coordinator = coordinator_on(store, tmp_path)
    store.racing = "j-1"
    add_job(store, "j-1")
    coordinator.start()  # resumes the pending job
    try:
        assert coordinator.wait("j-1", timeout=30) == JobStatus.CANCELLED
    finally:
        coordinator.stop()
    assert store.racing is None  # the race was run
    assert [e.kind for e in store.events("j-1")] == ["submitted", JobStatus.CANCELLED]
    assert store.rounds("j-1") == []
