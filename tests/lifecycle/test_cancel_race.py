"""A cancel that lands as its job ends never rewrites how the job ended: the store cancels only a job that has
not ended, and the coordinator reads the status under the lock its job threads leave by. The interleaving is
made by construction (the job completes between the cancel's read and its write), never by sleeping."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedbroker.aggregation_client import AggregatorClient
from fedbroker.bus import open_bus
from fedbroker.coordinator.records import JobRecord, JobStatus
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.errors import Conflict
from fedbroker.spec import parse_job
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
