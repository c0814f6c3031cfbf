"""What the coordinator's store hands out (coordinator/records.py): frozen records whose statuses are enums with
the very strings the SQLite file, the wire and `fedbroker status` have always used."""

from __future__ import annotations

import dataclasses

import pytest

from fedbroker.config import DPPolicy
from fedbroker.coordinator.records import JobRecord, WorkerRecord
from fedbroker.coordinator.store import StateStore
from fedbroker.job.status import JobStatus, ParticipantStatus, RoundStatus, WorkerState

POLICY = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=3.0)


def test_the_store_hands_out_frozen_records_with_enum_statuses(any_store: StateStore) -> None:
    store = any_store
    store.add_job("j", "j", '{"category": "digits", "schedule": {"mode": "async"}}', 2, "{}", submitter="alice")
    store.open_round("j", 1, ["w1"], deadline=5.0, started=1.0)
    store.upsert_worker(worker_id="w1", categories=["digits"], histogram=[1, 2], dp=POLICY, epsilon_spent=0.5,
                        device="cpu", num_samples=3, input_shape=[4], num_classes=2)
    job = store.job("j")
    assert isinstance(job, JobRecord) and job.status is JobStatus.PENDING and job.submitter == "alice"
    assert (job.category, job.mode) == ("digits", "async")
    (rnd,) = store.rounds("j")
    assert rnd.status is RoundStatus.OPEN and rnd.deadline == 5.0 and rnd.model_version is None and rnd.stats == {}
    (p,) = store.participants("j", 1)
    assert p.status is ParticipantStatus.PUBLISHED and p.epsilon is None
    (w,) = store.workers()
    assert isinstance(w, WorkerRecord) and w.dp == POLICY and w.state is WorkerState.IDLE
    assert (w.categories, w.histogram, w.input_shape) == (("digits",), (1, 2), (4,))
    assert [e.kind for e in store.events("j")] == ["submitted", "round_opened"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.status = JobStatus.RUNNING  # type: ignore[misc]


def test_statuses_are_the_strings_the_state_file_and_the_wire_always_held() -> None:
    assert [s.value for s in JobStatus] == ["pending", "running", "cancelling", "completed", "failed", "cancelled"]
    assert JobStatus.COMPLETED == "completed" and f"{JobStatus.CANCELLING}" == "cancelling"
    assert [s.value for s in RoundStatus] == ["open", "closed", "failed", "abandoned"]
    assert {s.value for s in WorkerState} == {"idle", "training", "uploading"}
    assert "completed" in {JobStatus.COMPLETED}  # a proto's string finds its status in a set of enums


def test_a_worker_without_dp_keeps_its_policy_disabled(any_store: StateStore) -> None:
    store = any_store
    store.upsert_worker(worker_id="w", categories=["c"], histogram=[], dp=DPPolicy(enabled=False, epsilon_budget=0.0),
                        epsilon_spent=0.0, device="cpu", num_samples=1)
    (w,) = store.workers()
    assert not w.dp.enabled
