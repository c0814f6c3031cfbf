"""Workers that die, lose their connection, straggle, fail on every try, or restart between rounds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from opacus.accountants import RDPAccountant

from fedbroker.bus import envelope
from fedbroker.config import DPPolicy
from fedbroker.job.spec import TrainingConfig
from fedbroker.privacy import dp_sample_rate, planned_steps
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker.agent import WorkerAgent
from fedbroker.worker.ledger import PrivacyLedger
from tests.faults.harness import JOB, Federation, Training, job, sample, wait_for
from tests.rabbitmq_node import PrivateRabbitMQ

pytestmark = [pytest.mark.integration]

DP = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=1000.0)


def accountant_epsilon(num_samples: int, rounds: int, epochs: int, policy: DPPolicy = DP) -> float:
    config = TrainingConfig(local_epochs=epochs, batch_size=JOB["training"]["batch_size"], lr=JOB["training"]["lr"])
    accountant = RDPAccountant()
    steps = rounds * planned_steps(num_samples, config)
    accountant.history = [(policy.noise_multiplier, dp_sample_rate(num_samples, config), steps)]
    return float(accountant.get_epsilon(policy.delta))


def record_closes(fed: Federation) -> list[Any]:
    """Every CloseResult the aggregation service produces from now on."""
    closes: list[Any] = []
    close = fed.book.close

    def recording(job_id: str, round_number: int) -> Any:
        result = close(job_id, round_number)
        closes.append(result)
        return result

    fed.book.close = recording  # type: ignore[method-assign]
    return closes


# `fedbroker worker` whose training never gets past its first step: it touches the file named by its argument
# there and waits, to be killed mid-training by construction, however fast or slow the machine (it has
# released nothing, so it has spent no ε).
HELD_WORKER = """
import sys, threading
from pathlib import Path
import fedbroker.worker.agent as agent
from fedbroker.app.cli import main
real = agent.train_local
def held(*args, progress, **kwargs):
    def first_step(step, total):
        progress(step, total)
        Path(sys.argv[1]).touch()
        threading.Event().wait()
    return real(*args, progress=first_step, **kwargs)
agent.train_local = held
sys.exit(main(["worker"]))
"""


def spawn_worker(fed: Federation, worker_id: str, *, index: int, count: int, log: Path,
                 held: Path | None = None) -> subprocess.Popen[bytes]:
    """`fedbroker worker` in its own process, DP on, configured as the demo configures its workers; `held`:
    it stops in its first training step and touches that file (HELD_WORKER)."""
    settings = {
        "broker.url": fed.url_for(worker_id), "broker.namespace": fed.namespace, "worker.id": worker_id,
        "worker.coordinator_broker_user": fed.coordinator_user,
        "worker.partition.num_clients": count, "worker.partition.client_index": index,
        "worker.ledger_path": str(fed.tmp / f"{worker_id}-ledger.json"), "worker.device": "cpu",
        "worker.heartbeat_s": 0.2, "worker.dp.enabled": True, "worker.dp.noise_multiplier": DP.noise_multiplier,
        "worker.dp.max_grad_norm": DP.max_grad_norm, "worker.dp.delta": DP.delta,
        "worker.dp.epsilon_budget": DP.epsilon_budget, "log_level": "INFO",
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
    for key, value in settings.items():
        env["FEDBROKER__" + key.upper().replace(".", "__")] = str(value)
    fed.worker_ids.add(worker_id)
    command = ["-c", HELD_WORKER, str(held)] if held else ["-m", "fedbroker", "worker"]
    return subprocess.Popen([sys.executable, *command], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


@pytest.mark.timeout(900)
def test_worker_killed_mid_training_gets_its_task_again_and_its_update_counts_once(
        each_federation: Federation) -> None:
    """The victim is killed in its first training step (HELD_WORKER), restarted as a plain worker, and gets
    its task again. The round waits for it whatever the machine's speed (the job's deadlines are far beyond
    any run: JOB), and the test ends on the job's end; the waits below only bound a hang.

    With per-participant broker users (`provisioned`), the restarted worker retries the task the broker
    redelivers to it under its own user, which may not write amq.default: before, that retry was refused, the
    connection closed and the task redelivered, about four times a second for ever (issue 30, break 1)."""
    fed = each_federation
    closes = record_closes(fed)
    fed.add_worker("steady", index=0, count=2)
    log, held = fed.tmp / "victim.log", fed.tmp / "victim-held"
    victim = spawn_worker(fed, "victim", index=1, count=2, log=log, held=held)
    try:
        job_id = fed.submit(job(training={"rounds": 2}))
        wait_for(held.exists, 300, "the victim to be held in its first training step of round 1", interval=0.2)
        assert fed.store.round(job_id, 1).status == "open"
        victim.send_signal(signal.SIGKILL)
        victim.wait(60)
        accepted, _ = fed.book.status(job_id, 1)
        assert "victim" not in accepted  # it died before uploading
        victim = spawn_worker(fed, "victim", index=1, count=2, log=log)  # same id, same ledger
        wait_for(lambda: "ACCESS_REFUSED" in log.read_text() or fed.store.job(job_id).status not in ("pending", "running"),
                 600,
                 "the job to end (or the restarted victim to be refused by the broker)", interval=0.2)
        assert "ACCESS_REFUSED" not in log.read_text(), log.read_text()[-3000:]
        fed.wait_job(job_id, 600)
    finally:
        victim.kill()
        victim.wait(60)
    rounds = fed.store.rounds(job_id)
    assert [r.aggregated for r in rounds] == [2, 2]
    # Counted once: one accepted update per worker, weighted by its share of the samples.
    samples = {p.worker_id: p.num_samples for p in fed.store.participants(job_id, 1)}
    for result in closes:
        assert sorted(u.worker_id for u in result.updates) == ["steady", "victim"]
        weights = {u.worker_id: u.weight for u in result.updates}
        assert weights["victim"] == pytest.approx(samples["victim"] / sum(samples.values()), rel=1e-12)
    # The killed attempt released nothing, so it cost nothing; the retried round was trained (and spent) once.
    ledger = PrivacyLedger(str(fed.tmp / "victim-ledger.json"))
    epochs = JOB["training"]["local_epochs"]
    assert ledger.epsilon(job_id) == pytest.approx(accountant_epsilon(samples["victim"], 2, epochs), rel=1e-9)
    text = log.read_text()
    assert text.count("worker victim uploaded round 1") == 1, text[-3000:]
    # the redelivered task was retried once, through the tasks exchange, and the connection never dropped
    assert "ACCESS_REFUSED" not in text and "reconnected" not in text, text[-3000:]
    assert text.count("will be retried (failed deliveries: 1)") == 1, text[-3000:]
    assert fed.dead_letters() == []


class CutAfterUpload(WorkerAgent):
    """Loses its connection to the broker (`node`, the test's private one) once: right after the service's
    receipt, before the ack."""

    node: PrivateRabbitMQ
    cut = False
    deliveries: list[tuple[int, int, bool]]

    def on_task(self, delivery: Any) -> None:
        env = envelope.decode(delivery.body, expect=("round_task", "evaluation_task"))
        if env.HasField("round_task"):  # round tasks only (not federated evaluation's)
            self.deliveries.append((env.round_task.round, delivery.attempts, delivery.redelivered))
        super().on_task(delivery)

    def run_task(self, task: pb.RoundTask) -> pb.UploadReceipt | None:
        receipt = super().run_task(task)
        if receipt is not None and not self.cut:
            self.cut = True
            self.node.close_connection(self.bus.connection_names[1])  # its ack is lost: the broker redelivers the task
        return receipt


@pytest.mark.timeout(90)
def test_task_redelivered_after_its_upload_was_accepted_is_acked_without_training(
        each_broker_federation: Federation, broker: PrivateRabbitMQ, training: Training) -> None:
    fed = each_broker_federation
    closes = record_closes(fed)
    CutAfterUpload.deliveries, CutAfterUpload.node = [], broker
    cut = fed.add_worker("cut", index=0, count=2, agent_class=CutAfterUpload)
    fed.add_worker("other", index=1, count=2)
    already = sample("fedbroker_worker_tasks_total", {"worker_id": "cut", "outcome": "already_uploaded"})
    job_id = fed.submit(job(training={"rounds": 2}))
    fed.wait_job(job_id, 60)
    assert isinstance(cut, CutAfterUpload) and cut.cut
    first, *rest = cut.deliveries
    assert first == (1, 1, False)
    assert (1, 2, True) in rest  # round 1's task came back after the cut ...
    assert training.count["cut"] == 2  # ... and was acked without a second training: one per round
    assert sample("fedbroker_worker_tasks_total", {"worker_id": "cut", "outcome": "already_uploaded"}) == already + 1
    assert [sorted(u.worker_id for u in c.updates) for c in closes] == [["cut", "other"]] * 2
    wait_for(lambda: cut.bus.reconnects >= 1, 30, "the cut consumer link to count its reconnect")
    assert fed.dead_letters() == []


class SlowUplink(WorkerAgent):
    """Trains in time but its upload only reaches the service after its round closed at the deadline: by then
    the coordinator has counted it a straggler, whatever the machine's load (a fixed delay past the deadline
    would race the coordinator's count)."""

    def _upload(self, client: Any, task: pb.RoundTask, result: Any) -> pb.UploadReceipt:
        wait_for(lambda: not client.status(task.job_id, task.round)[1], 60, "the round to close", interval=0.1)
        return super()._upload(client, task, result)


@pytest.mark.timeout(90)
def test_straggler_is_refused_as_late_and_the_round_closes_at_its_deadline_with_min_clients(
        federation: Federation) -> None:
    """The deadline is the test's subject, so it is a real one: 10 s, for two workers that train and upload in
    well under a second (seconds on a loaded machine)."""
    fed = federation
    fed.add_worker("a", index=0, count=3)
    fed.add_worker("b", index=1, count=3)
    fed.add_worker("slow", index=2, count=3, agent_class=SlowUplink)
    late = sample("fedbroker_aggregator_uploads_rejected_total", {"reason": "late"})
    late_total = sample("fedbroker_aggregator_late_uploads_total")
    timeout = 10.0
    job_id = fed.submit(job(training={"rounds": 1},
                            schedule={"min_workers": 3, "min_clients": 2, "round_timeout_s": timeout}))
    fed.wait_job(job_id, 60)
    (rnd,) = fed.store.rounds(job_id)
    assert rnd.aggregated == 2 and rnd.seconds >= timeout  # waited for the deadline, then closed with 2
    assert sample("fedbroker_coordinator_stragglers_total", {"job_id": job_id}) == 1
    row = wait_for(lambda: next((p for p in fed.store.participants(job_id, 1)
                                 if p.worker_id == "slow" and p.status == "failed"), None), 15,
                   "the straggler to report its refused upload")
    assert "late update refused" in row.reason
    assert sample("fedbroker_aggregator_uploads_rejected_total", {"reason": "late"}) == late + 1
    assert sample("fedbroker_aggregator_late_uploads_total") == late_total + 1
    assert {p.worker_id: p.status for p in fed.store.participants(job_id, 1)} == {
        "a": "aggregated", "b": "aggregated", "slow": "failed"}


@pytest.mark.timeout(60)
def test_task_that_fails_every_time_is_dead_lettered_after_max_attempts_and_an_unreadable_one_at_once(
        each_federation: Federation, training: Training) -> None:
    """Its retries go through the tasks exchange, which a provisioned site may write (amq.default it may not)."""
    fed = each_federation
    training.fail["poisoned"] = RuntimeError("injected: training crashes on this worker")
    fed.add_worker("good", index=0, count=2)
    poisoned = fed.add_worker("poisoned", index=1, count=2, max_attempts=3)
    job_id = fed.submit(job(training={"rounds": 1}, schedule={"min_clients": 1}))
    fed.wait_job(job_id, 30)
    rows = {p.worker_id: p for p in fed.store.participants(job_id, 1)}
    assert rows["good"].status == "aggregated"
    assert rows["poisoned"].status == "failed" and "gave up after 3 attempts" in rows["poisoned"].reason
    (dead,) = wait_for(fed.dead_letters, 10, "the task in the dead-letter queue")
    task = envelope.decode(dead[0], expect=("round_task",)).round_task
    assert (task.job_id, task.round) == (job_id, 1)
    time.sleep(0.5)
    assert training.count["poisoned"] == 3  # three deliveries, then never again

    # A task the worker cannot even read is poison at once: dead-lettered on its first delivery, no training.
    bad = pb.RoundTask(job_id=job_id, round=2, category="digits", training_json=json.dumps({"no_such_field": 1}),
                       aggregator_target=fed.target)
    fed.bus.publish_task("poisoned", envelope.encode(round_task=bad))
    (dead,) = wait_for(fed.dead_letters, 10, "the unreadable task in the dead-letter queue")
    assert envelope.decode(dead[0], expect=("round_task",)).round_task.round == 2
    assert training.count["poisoned"] == 3
    assert poisoned.bus.reconnects == 0


class StopsAfterFirstUpload(WorkerAgent):
    """Goes down right after its round-1 upload is accepted, before acking the task (a crash between rounds)."""

    def run_task(self, task: pb.RoundTask) -> pb.UploadReceipt | None:
        receipt = super().run_task(task)
        if task.round == 1 and receipt is not None:
            threading.Thread(target=self.bus.close).start()
            wait_for(lambda: not self.bus._consumer.link.connected.is_set(), 10, "the worker's connection to close")
        return receipt


@pytest.mark.timeout(90)
def test_restarted_worker_remembers_the_epsilon_it_spent(federation: Federation, training: Training) -> None:
    fed = federation
    first = fed.add_worker("owner", index=0, count=2, dp=DP, agent_class=StopsAfterFirstUpload)
    fed.add_worker("other", index=1, count=2)
    num_samples = len(first.y)
    epochs = JOB["training"]["local_epochs"]
    job_id = fed.submit(job(training={"rounds": 2}))
    wait_for(lambda: first.bus._closed and not first.bus._consumer.link.connected.is_set(), 30,
             "the worker to go down after round 1")
    one_round = accountant_epsilon(num_samples, 1, epochs)
    on_disk = PrivacyLedger(str(fed.tmp / "owner-ledger.json"))
    assert on_disk.epsilon(job_id) == pytest.approx(one_round, rel=1e-9)
    fed.stop_worker("owner")
    second = fed.add_worker("owner", index=0, count=2, dp=DP)  # a new process: a new ledger read from disk
    assert second.ledger.epsilon(job_id) == pytest.approx(one_round, rel=1e-9)
    fed.wait_job(job_id, 60)
    two_rounds = accountant_epsilon(num_samples, 2, epochs)
    assert second.ledger.epsilon(job_id) == pytest.approx(two_rounds, rel=1e-9)
    recorded = {p.round: p.epsilon for p in fed.store.participants(job_id) if p.worker_id == "owner"}
    assert recorded[1] == pytest.approx(one_round, rel=1e-9) and recorded[2] == pytest.approx(two_rounds, rel=1e-9)
    assert training.count["owner"] == 2  # round 1's redelivered task was acked without a second training
    wait_for(lambda: next(w for w in fed.store.workers() if w.worker_id == "owner").epsilon_spent
             == pytest.approx(two_rounds, rel=1e-9), 5, "the worker's heartbeat to report what it spent")
