"""A plain round that fails keeps on the record the ε its uploads cost: the job fails right after, so no later
round can bring that ε (its workers' next uploads carry the job's cumulative ε; here none comes).

Three DP workers, a job that needs all three: two train and upload, the third refuses its task, so the round
ends with two uploads, fails, and fails the job. The aggregation service drops the two uploads unaggregated;
the coordinator keeps each with the ε its worker spent (before: their rows said `uploaded` with no ε, and the
sites' recorded ε stayed below their ledgers for good)."""

from __future__ import annotations

import pytest

from fedbroker.config import DPPolicy
from fedbroker.errors import TaskRefused
from fedbroker.job.status import ParticipantStatus, RoundStatus
from fedbroker.worker.ledger import PrivacyLedger
from tests.faults.harness import Federation, Training, job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TRAINING = ["a", "b"]
REFUSER = "refuser"


def test_a_failed_plain_round_keeps_the_epsilon_of_the_uploads_it_dropped(federation: Federation,
                                                                          training: Training) -> None:
    training.fail[REFUSER] = TaskRefused("injected: this site refuses the task before it trains")
    workers = [*TRAINING, REFUSER]
    for index, worker in enumerate(workers):
        federation.add_worker(worker, index=index, count=len(workers), dp=DPPolicy(enabled=True, epsilon_budget=100))
    job_id = federation.submit(job(training={"rounds": 1}, evaluation={"every": 0},
                                   schedule={"min_workers": 3, "min_clients": 3}))
    row = wait_for(lambda: (r := federation.store.job(job_id)) is not None and r.status in ("completed", "failed")
                   and r, 90, f"job {job_id} to end", interval=0.1)
    assert row.status == "failed" and "2 upload(s)" in row.error, row.error

    store = federation.store
    assert [(r.round, r.status) for r in store.rounds(job_id)] == [(1, RoundStatus.FAILED)]
    rows = {p.worker_id: p for p in store.participants(job_id, 1)}
    assert rows[REFUSER].status == ParticipantStatus.REFUSED and rows[REFUSER].epsilon is None
    for worker in TRAINING:
        spent = PrivacyLedger(str(federation.tmp / f"{worker}-ledger.json"), worker_id=worker).epsilon(job_id)
        assert spent > 0
        assert rows[worker].status == ParticipantStatus.DISCARDED and "round 1 failed" in rows[worker].reason
        assert rows[worker].epsilon == pytest.approx(spent, rel=1e-9)  # the job's record
        assert store.recorded_epsilon(worker) == pytest.approx(spent, rel=1e-9)  # what budgets are checked against
        site = {j.job_id: j for j in store.site_jobs(worker)}[job_id]  # the SiteRecord call's view
        assert site.epsilon == pytest.approx(spent, rel=1e-9) and site.rounds == 1
