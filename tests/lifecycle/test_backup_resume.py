"""A host backed up mid-round while everything runs, restored elsewhere: its coordinator resumes the open round
with the update the aggregation service had accepted, and the job completes."""

from __future__ import annotations

from pathlib import Path

import pytest

import fedbroker.worker.agent
from fedbroker.app.backup import backup, restore
from fedbroker.worker.agent import WorkerAgent
from tests.faults.harness import Federation, HoldsRound, Training, job, wait_for

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(240)
def test_a_host_backed_up_mid_round_and_restored_elsewhere_resumes_its_job_to_completion(
        rabbitmq_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fedbroker.worker.agent, "train_local", Training())
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    held = HoldsRound.at(2)  # w1 holds its round-2 task; w0 trains and uploads it
    fed = Federation(rabbitmq_url, old)  # its state folder is `old` (coordinator.sqlite, checkpoints/), spool old/spool
    try:
        fed.add_worker("w0", index=0, count=2, agent_class=WorkerAgent)
        fed.add_worker("w1", index=1, count=2, agent_class=held)
        job_id = fed.submit(job(training={"rounds": 3}))
        wait_for(lambda: held.holding == {"w1"} and fed.book.status(job_id, 2) == (["w0"], True), 120,
                 "w0's round-2 update accepted while w1 holds its task")
        backup({"coordinator": str(old), "spool": str(old / "spool"), "ledger": str(old / "w0-ledger.json")},
               str(tmp_path / "host.tar.gz"))  # online: the coordinator, the service and the workers all run
    finally:
        held.release.set()
        fed.close()

    restore(str(tmp_path / "host.tar.gz"), {"coordinator": str(new), "spool": str(new / "spool"),
                                            "ledger": str(new / "w0-ledger.json")})
    training = Training()
    monkeypatch.setattr(fedbroker.worker.agent, "train_local", training)
    fed = Federation(rabbitmq_url, new, start_coordinator=False)
    try:
        assert fed.store.job(job_id).rounds_done == 1 and fed.book.status(job_id, 2) == (["w0"], True)
        assert fed.store.last_checkpoint(job_id).checkpoint.startswith(str(new / "checkpoints"))
        fed.add_worker("w0", index=0, count=2)
        fed.add_worker("w1", index=1, count=2)
        fed.start_coordinator()
        fed.wait_job(job_id, 150)
        assert [r.status for r in fed.store.rounds(job_id)] == ["closed"] * 3
        assert [r.aggregated for r in fed.store.rounds(job_id)] == [2, 2, 2]
        assert training.count == {"w0": 1, "w1": 2}  # w0's round-2 update came back with the spool
    finally:
        fed.close()
