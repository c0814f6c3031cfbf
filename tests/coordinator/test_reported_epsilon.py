"""The ε a site reports for training it did is on the record as soon as its report is accepted, whatever the
order of the report and the round's end (a secure round abandoned as lost, a plain round failed, the job
cancelled), and stays there if the job ends right after: no "next closed round" has to bring it.

Three views must agree at every moment: the worker's recorded ε (what budgets are checked against:
`recorded_epsilon`, `workers()`), the job's record (its participant rows: `jobs show`, `ledger`) and the site's
own record (`site_jobs`: the SiteRecord call). Each test runs on SQLite and on a scratch PostgreSQL."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from fedbroker.config import DPPolicy
from fedbroker.coordinator.participants import EpsilonBounds
from fedbroker.coordinator.store import StateStore
from fedbroker.job.spec import TrainingConfig
from fedbroker.job.status import JobStatus, ParticipantStatus
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.secagg.secure_round import ROUND_LOST
from tests.coordinator.control_fakes import control_handler, send

JOB = "secure-job"
SITES = ["s1", "s2", "s3"]
POLICY = DPPolicy(enabled=True, noise_multiplier=1.1, epsilon_budget=50.0)
LOST = f"secure_protocol: {ROUND_LOST} (another replica took the job over)"
SPENT = 0.75   # the ε s1 reports for its training of round 1


def a_round_with_every_upload_counted(store: StateStore, *, plain: bool = False) -> None:
    """Round 1 of a job, every site's upload counted by the coordinator (`uploaded`): the state in which a
    masked upload was accepted before the replica owning the round died (or a plain round about to fail)."""
    for site in SITES:
        store.upsert_worker(worker_id=site, categories=["digits"], histogram=[1, 2], dp=POLICY, epsilon_spent=0.0,
                            device="cpu", num_samples=500)
    store.add_job(JOB, "plain" if plain else "secure", "{}", 2, "{}")
    store.set_job_status(JOB, JobStatus.RUNNING)
    store.open_round(JOB, 1, SITES)
    store.set_uploaded(JOB, 1, SITES)


def on_record(store: StateStore, site: str) -> tuple[float | None, float | None, float]:
    """A site's ε in the three views: its recorded ε, its round-1 row in the job's record, its site record."""
    row = next(p for p in store.participants(JOB, 1) if p.worker_id == site)
    site_record = next(j.epsilon for j in store.site_jobs(site) if j.job_id == JOB)
    return store.recorded_epsilon(site), row.epsilon, site_record


def report(store: StateStore, site: str = "s1", epsilon: float = SPENT, *, reason: str = LOST) -> bool:
    return store.record_outcome(JOB, 1, site, ParticipantStatus.FAILED, f"{reason} (trained first)", epsilon=epsilon)


@pytest.mark.parametrize("order", ["report, then abandon", "abandon, then report"])
def test_a_failure_report_of_a_lost_secure_round_is_on_the_record_at_once_in_either_order(
        any_store: StateStore, order: str) -> None:
    store = any_store
    a_round_with_every_upload_counted(store)
    if order == "report, then abandon":
        assert report(store)  # before the fix: refused as an unknown task (its row said `uploaded`), ε dropped
        assert on_record(store, "s1") == (SPENT, SPENT, SPENT)
    store.abandon_round(JOB, 1, 1.0, why=f"{LOST}; re-opened as round 2 from version 0")
    if order == "abandon, then report":
        assert report(store)
    assert on_record(store, "s1") == (SPENT, SPENT, SPENT)
    row = next(p for p in store.participants(JOB, 1) if p.worker_id == "s1")
    assert row.status == ParticipantStatus.FAILED
    store.set_job_status(JOB, JobStatus.FAILED, "reopens spent")  # no next closed round ever comes
    assert on_record(store, "s1") == (SPENT, SPENT, SPENT)
    assert next(w for w in store.workers() if w.worker_id == "s1").epsilon_spent == SPENT
    assert on_record(store, "s2") == (0.0, None, 0.0)  # no report, no ε: nothing invented for the others


@pytest.mark.parametrize("order", ["report, then fail", "fail, then report"])
def test_a_plain_failed_round_keeps_the_epsilon_of_its_discarded_uploads_and_of_a_report_in_either_order(
        any_store: StateStore, order: str) -> None:
    store = any_store
    a_round_with_every_upload_counted(store, plain=True)
    store.record_outcome(JOB, 1, "s3", ParticipantStatus.REFUSED, "budget")  # no ε: nothing kept
    discarded = [("s2", 10, 0.5, 0.3)]  # the service's list of the uploads it dropped unaggregated
    if order == "report, then fail":
        assert report(store, reason="upload refused")
    store.fail_round(JOB, 1, 1.0, discarded=discarded)
    if order == "fail, then report":
        assert report(store, reason="upload refused")
    store.set_job_status(JOB, JobStatus.FAILED, "round 1: too few uploads")
    assert on_record(store, "s1") == (SPENT, SPENT, SPENT)
    assert on_record(store, "s2") == (0.5, 0.5, 0.5)
    rows = {p.worker_id: p for p in store.participants(JOB, 1)}
    assert rows["s2"].status == ParticipantStatus.DISCARDED and "round 1 failed" in rows["s2"].reason


@pytest.mark.parametrize("order", ["report, then cancel", "cancel, then report"])
def test_a_cancelled_round_keeps_a_reported_epsilon_in_either_order(any_store: StateStore, order: str) -> None:
    store = any_store
    a_round_with_every_upload_counted(store)
    if order == "report, then cancel":
        assert report(store, reason="round_closed")
    assert store.cancel_job(JOB, by="alice", round_number=1, discarded=[("s1", 10, 0.5, 0.2)])
    if order == "cancel, then report":
        assert report(store, reason="round_closed")
    assert on_record(store, "s1") == (SPENT, SPENT, SPENT)  # the larger of the two: the job's ε is cumulative


def test_a_later_lower_report_or_upload_never_lowers_the_record(any_store: StateStore) -> None:
    """A dishonest site reporting less than it spent cannot take back what its own earlier word put on the
    record: a row's ε only grows (a site's ε for a job is cumulative)."""
    store = any_store
    a_round_with_every_upload_counted(store)
    assert report(store)
    assert report(store, epsilon=0.1, reason="a second, lower report")
    assert on_record(store, "s1") == (SPENT, SPENT, SPENT)
    store.close_round(JOB, 1, model_version=1, aggregated=SITES, updates=[("s1", 10, 0.2, 0.1)], accuracy=None,
                      loss=None, seconds=1.0, checkpoint="", stats={}, model_spec_json="{}")
    assert on_record(store, "s1") == (SPENT, SPENT, SPENT)


def test_a_report_for_a_round_the_site_was_not_in_is_refused_and_changes_nothing(any_store: StateStore) -> None:
    store = any_store
    a_round_with_every_upload_counted(store)
    store.upsert_worker(worker_id="outsider", categories=["digits"], histogram=[1, 2], dp=POLICY, epsilon_spent=0.0,
                        device="cpu", num_samples=500)
    store.abandon_round(JOB, 1, 1.0, why=LOST)
    assert not report(store, "outsider")
    assert not store.record_outcome(JOB, 2, "s1", ParticipantStatus.FAILED, "never asked", epsilon=SPENT)
    assert store.recorded_epsilon("outsider") == 0.0 and store.recorded_epsilon("s1") == 0.0
    assert [p.worker_id for p in store.participants(JOB)] == SITES


def test_through_the_control_queue_a_report_lands_at_once_and_a_forged_or_inflated_one_changes_nothing(
        tmp_path: Path) -> None:
    """The whole path of a report (the sender binding, the bound on what a job's tasks were priced at, the
    store) while the round's masked uploads are counted and before the coordinator abandons it."""
    store = StateStore(str(tmp_path / "c.sqlite"))
    a_round_with_every_upload_counted(store)
    bounds = EpsilonBounds(store)
    bounds.note_tasks(JOB, SITES, time.time() + 60, TrainingConfig(rounds=2, local_epochs=1, batch_size=32, lr=0.1))
    priced = bounds.limit("s1", JOB)
    assert priced > 0
    handler = control_handler(store, {site: [site] for site in [*SITES, "outsider"]})

    def outcome(sender: str, worker: str, epsilon: float, round_number: int = 1) -> str:
        return send(handler, sender, task_outcome=pb.TaskOutcome(
            job_id=JOB, round=round_number, worker_id=worker, status=pb.TaskOutcome.FAILED,
            reason=f"{LOST} (trained first)", epsilon=epsilon)).settled_as

    assert outcome("s1", "s1", priced * 0.8) == "ack"
    assert store.recorded_epsilon("s1") == pytest.approx(priced * 0.8)  # on the record at once, still `uploaded`
    assert outcome("s2", "s2", priced * 100) == "ack"  # above what its tasks were priced at: refused, not stored
    assert outcome("s3", "s2", priced * 0.5) == "dead"  # another site's broker user: dead-lettered
    assert outcome("s3", "s3", priced * 0.5, round_number=2) == "ack"  # a round it was never asked in: ignored
    assert store.recorded_epsilon("s2") == 0.0 and store.recorded_epsilon("s3") == 0.0
    store.abandon_round(JOB, 1, 1.0, why=LOST)
    assert store.recorded_epsilon("s1") == pytest.approx(priced * 0.8)
    store.close()
