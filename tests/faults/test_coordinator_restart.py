"""The coordinator killed and restarted: it resumes the job from its durable state, including the round that
was open, and ends with the very model an uninterrupted run with the same seeds produces.

Worker training is deterministic here (no DP: the task seed fixes batch order and initialisation on CPU), so
every update is the same bit for bit. The running mean sums a round's updates in one BLAS pass in the order
they arrived, which may differ between the two runs, so the models agree to float32 rounding of that sum
(1e-6), far below what a lost, repeated or re-trained update would change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import fedbroker.coordinator.sync_rounds
from fedbroker.app.demo import free_port
from fedbroker.coordinator.service import CoordinatorClient
from fedbroker.coordinator.store import StateStore
from fedbroker.worker.agent import WorkerAgent
from tests.faults.harness import Federation, HoldsRound, Training, job, wait_for

pytestmark = [pytest.mark.integration]

JOB = job(training={"rounds": 3})


def run_two_workers(fed: Federation, agent_class: type[WorkerAgent] = WorkerAgent) -> None:
    fed.add_worker("w0", index=0, count=2, agent_class=agent_class)
    fed.add_worker("w1", index=1, count=2, agent_class=agent_class)


@pytest.fixture(scope="module")
def uninterrupted(rabbitmq_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    """The final model of the job run from start to end without a fault."""
    fed = Federation(rabbitmq_url, tmp_path_factory.mktemp("uninterrupted"))
    try:
        run_two_workers(fed)
        job_id = fed.submit(JOB)
        fed.wait_job(job_id, 60)
        return fed.checkpoint(job_id)
    finally:
        fed.close()


def assert_same_model(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert got.keys() == expected.keys()
    for name, array in expected.items():
        np.testing.assert_allclose(got[name], array, rtol=1e-6, atol=1e-6, err_msg=name)


def spawn_coordinator(fed: Federation, listen: str, log: Path) -> subprocess.Popen[bytes]:
    settings = {
        "broker.url": fed.url, "broker.namespace": fed.namespace, "aggregator.target": fed.target,
        "coordinator.listen": listen, "coordinator.state_dir": str(fed.tmp / "state"), "log_level": "INFO",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    for key, value in settings.items():
        env["FEDBROKER__" + key.upper().replace(".", "__")] = value
    return subprocess.Popen([sys.executable, "-m", "fedbroker", "coordinator"], env=env, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT)


@pytest.fixture
def outside(rabbitmq_url: str, tmp_path: Path) -> Iterator[Federation]:
    """Aggregation service and workers here; the coordinator is the test's to run as a process."""
    fed = Federation(rabbitmq_url, tmp_path, start_coordinator=False)
    try:
        yield fed
    finally:
        fed.close()


@pytest.mark.timeout(120)
def test_coordinator_killed_mid_round_resumes_and_ends_with_the_uninterrupted_model(
        outside: Federation, training: Training, uninterrupted: dict[str, np.ndarray]) -> None:
    fed = outside
    held = HoldsRound.at(2)  # round 2 cannot end before the kill: the workers hold its tasks until released
    run_two_workers(fed, held)
    listen, log = f"127.0.0.1:{free_port()}", fed.tmp / "coordinator.log"
    process = spawn_coordinator(fed, listen, log)
    try:
        client = CoordinatorClient(listen, timeout_s=5)
        job_id = wait_for(lambda: _submit(client, JOB), 60, "the coordinator to accept the job", interval=0.3)
        store = StateStore(str(fed.tmp / "state" / "coordinator.sqlite"))
        wait_for(lambda: held.holding == {"w0", "w1"}, 60, "both workers to hold round 2's task")
        process.send_signal(signal.SIGKILL)
        process.wait(10)
        assert store.job(job_id).status == "running" and store.job(job_id).rounds_done == 1
        process = spawn_coordinator(fed, listen, log)  # same state folder: it resumes the open round 2
        held.release.set()
        wait_for(lambda: store.job(job_id).status in ("completed", "failed"), 90, "the job to end", interval=0.2)
        assert store.job(job_id).status == "completed", store.job(job_id).error
    finally:
        process.terminate()
        process.wait(10)
    assert [r.status for r in store.rounds(job_id)] == ["closed"] * 3
    assert "resuming round 2" in log.read_text()
    assert training.count == {"w0": 3, "w1": 3}  # the resumed round was not trained again
    from fedbroker.coordinator.checkpoints import load_checkpoint

    assert_same_model(load_checkpoint(store.last_checkpoint(job_id).checkpoint)[0], uninterrupted)


def _submit(client: CoordinatorClient, job_dict: dict[str, Any]) -> str | None:
    import grpc

    try:
        return client.submit(json.dumps(job_dict))
    except grpc.RpcError:
        return None


class Death(BaseException):
    """The coordinator process dying at this point: nothing of it runs on (not even a job-failed record)."""


@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_coordinator_dying_after_the_service_closed_a_round_records_that_close_on_restart(
        federation: Federation, training: Training, uninterrupted: dict[str, np.ndarray],
        monkeypatch: pytest.MonkeyPatch) -> None:
    fed = federation
    run_two_workers(fed)
    real = fedbroker.coordinator.sync_rounds.save_checkpoint

    def dies_in_round_2(directory: str, job_id: str, round_number: int, *args: Any) -> str:
        if round_number == 2:
            raise Death("the coordinator dies after the service closed round 2, before recording it")
        return real(directory, job_id, round_number, *args)

    monkeypatch.setattr(fedbroker.coordinator.sync_rounds, "save_checkpoint", dies_in_round_2)
    job_id = fed.submit(JOB)
    thread = fed.coordinator._threads[job_id]
    thread.join(60)
    assert not thread.is_alive()
    assert fed.store.round(job_id, 2).status == "open" and fed.book.status(job_id, 2) == (["w0", "w1"], False)
    monkeypatch.setattr(fedbroker.coordinator.sync_rounds, "save_checkpoint", real)
    fed.stop_coordinator()
    fed.start_coordinator()  # resumes: the service answers round 2's close again, and the job goes on
    fed.wait_job(job_id, 60)
    assert [r.aggregated for r in fed.store.rounds(job_id)] == [2, 2, 2]
    assert training.count == {"w0": 3, "w1": 3}
    assert_same_model(fed.checkpoint(job_id), uninterrupted)
