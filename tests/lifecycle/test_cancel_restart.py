"""A cancel is durable: a coordinator that stops before the job's thread acts on it finishes it on start."""

from __future__ import annotations

from fedbroker.bus import open_bus
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.job.spec import parse_job
from fedbroker.rpc.aggregation_client import AggregatorClient
from tests.lifecycle.test_jobs import JOB


def test_a_job_asked_to_cancel_is_cancelled_by_the_next_coordinator_and_never_runs_again(tmp_path):
    store = StateStore(str(tmp_path / "state.sqlite"))
    job = parse_job(dict(JOB, schedule=dict(JOB["schedule"], min_workers=3, wait_for_workers_s=600)))
    store.add_job("j-1", job.name, job.to_json(), job.training.rounds, job.model.to_json(), submitter="alice")
    store.set_job_status("j-1", "running")
    assert store.request_cancel("j-1", by="alice")
    store.set_job_status("j-1", "running")  # a job thread starting meanwhile does not undo it
    assert store.job("j-1").status == "cancelling"

    coordinator = Coordinator(bus=open_bus(None, namespace="t"), store=store,
                              aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                              checkpoint_dir=str(tmp_path / "ck"), poll_interval_s=0.05)
    coordinator.start()
    try:
        assert coordinator.wait("j-1", timeout=60) == "cancelled"
    finally:
        coordinator.stop()
    assert store.job("j-1").error == "cancelled by alice" and store.rounds("j-1") == []
    assert [e.kind for e in store.events("j-1")] == ["submitted", "running", "cancelling", "cancelled"]
    assert not store.request_cancel("j-1", by="alice")  # it has ended: nothing to cancel
