"""Issue 30, break 8: an asynchronous job's record holds the ε of every accepted upload, also one accepted as the
job reached its last version. Real RabbitMQ, real gRPC (the aggregation service and the coordinator's API on
loopback), DP workers with their own ledgers, every participant on its own broker user as a kit deploys it (a guest
run would add nothing: guest may do all a site's user may).

The race is made by construction, not by timing: the late worker holds its first task (unacked, untrained)
until the coordinator closes the buffer after the job's last version; the close is then held until the late
worker's upload has its receipt. Its update is in the buffer at the close (buffer of 2), or in a version past
`training.rounds` (buffer of 1)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from fedbroker.app.cli import main
from fedbroker.config import DPPolicy
from fedbroker.coordinator.service import serve
from fedbroker.rpc.aggregation_client import AggregatorClient
from tests.faults.harness import Federation, HoldsNth, job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

POLICY = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=500.0)


def jobs_show(fed: Federation, job_id: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """`fedbroker jobs show ID --json`, asked over the coordinator's gRPC API."""
    assert fed.coordinator is not None
    server, port = serve(fed.coordinator)
    try:
        capsys.readouterr()
        assert main(["jobs", "show", job_id, "--json", "--coordinator", f"127.0.0.1:{port}"]) == 0
        return dict(json.loads(capsys.readouterr().out))
    finally:
        server.stop(grace=0)


@pytest.mark.parametrize(("buffer_size", "rounds", "where"), [(2, 1, "in the buffer"), (1, 2, "in version")],
                         ids=["left-in-the-buffer", "in-a-version-past-the-last"])
def test_an_upload_accepted_as_the_job_ends_is_in_the_jobs_epsilon(
        provisioned_federation: Federation, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        buffer_size: int, rounds: int, where: str) -> None:
    fed = provisioned_federation
    held = HoldsNth.nth(1)
    # the fast worker's tasks after the last version's (one the loop may issue before it sees that version) wait
    # until the job has ended: the late worker's update is the only one to arrive in the race
    fast = HoldsNth.nth(buffer_size * rounds + 1)
    real_close = AggregatorClient.close_buffer

    def close_after_the_late_upload(client: AggregatorClient, closing: str) -> Any:
        held.release.set()  # the job has its last version: only now does the late worker train and upload
        wait_for(lambda: "late" in fed.book.buffer_status(closing)[1].accepted, 120, "the late worker's receipt")
        return real_close(client, closing)

    monkeypatch.setattr(AggregatorClient, "close_buffer", close_after_the_late_upload)
    fed.add_worker("fast", index=0, count=2, dp=POLICY, agent_class=fast)
    fed.add_worker("late", index=1, count=2, dp=POLICY, agent_class=held)
    try:
        job_id = fed.submit(job(training={"rounds": rounds}, schedule={
            "mode": "async", "buffer_size": buffer_size, "max_staleness": 8, "staleness": "hinge",
            "min_workers": 2}, evaluation={"every": 0}))  # no site is asked to score a version: the job ends on its own
        fed.wait_job(job_id, 200)
    finally:
        fast.release.set()  # its held task (if it got one) is refused now: the job ended

    late = fed.workers["late"].ledger.epsilon(job_id)
    assert late > 0 and held.holding == {"late": held.holding["late"]}  # it trained the task it held
    assert not [p for p in fed.store.participants(job_id) if p.worker_id == "late" and p.round > 0]  # in no row
    def ledgers() -> dict[str, float]:
        return {w: agent.ledger.epsilon(job_id) for w, agent in fed.workers.items()}

    def recorded() -> dict[str, float]:
        out: dict[str, float] = {}
        for p in fed.store.participants(job_id):
            out[p.worker_id] = max(out.get(p.worker_id, 0.0), p.epsilon or 0.0)
        return out

    # a task the fast worker trained after the end (if it got one) is reported as failed, with its ε
    wait_for(lambda: recorded() == ledgers(), 120, "the job's record to hold every ledger's ε")
    doc = jobs_show(fed, job_id, capsys)
    shown: dict[str, float] = {}
    for p in doc["participants"]:
        shown[p["worker_id"]] = max(shown.get(p["worker_id"], 0.0), float(p.get("epsilon", 0.0)))
    assert shown == ledgers()  # per site, the job's record is its ledger
    assert sum(shown.values()) == pytest.approx(sum(ledgers().values()), rel=1e-12)
    (row,) = [p for p in doc["participants"] if p["worker_id"] == "late"]
    assert row["round"] == 0 and row["status"] == "discarded" and where in row["reason"], row
