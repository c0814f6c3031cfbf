"""RabbitMQ restarted mid-job, and RabbitMQ's consumer_timeout shorter than a worker's training.

These tests change a broker (its application is stopped and started; its consumer_timeout is lowered for a
few seconds), so they run on the session's private node, never the machine's: every change is undone when the
test ends, pass or fail (the session's later tests share the node), and the node is waited for until it answers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedbroker.bus import envelope
from fedbroker.errors import ConfigError
from fedbroker.worker.agent import WorkerAgent
from tests.faults.harness import (
    Federation,
    HoldsRound,
    Training,
    broker_env,
    changed_broker_env,
    job,
    sample,
    wait_for,
)
from tests.rabbitmq_node import PrivateRabbitMQ

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(150)
def test_job_completes_across_a_broker_restart_and_no_task_is_lost(
        each_broker_federation: Federation, broker: PrivateRabbitMQ, training: Training) -> None:
    """RabbitMQ restarts while both workers hold round 3's task (unacked, untrained): the outage falls mid-job by
    construction. What matters: the job completes, every round has both updates (no task lost), nobody
    trained a round twice (the copy the broker redelivers after the outage is acked without training), and
    nothing was dead-lettered. How many times a link reconnected, or when, depends on scheduling: not asserted.
    As guest and with per-participant broker users: the redelivered copies are retried under the sites' own."""
    fed = each_broker_federation
    held = HoldsRound.at(3)
    workers = [fed.add_worker(w, index=i, count=2, agent_class=held) for i, w in enumerate(("w0", "w1"))]
    already = {w: sample("fedbroker_worker_tasks_total", {"worker_id": w, "outcome": "already_uploaded"})
               for w in ("w0", "w1")}
    rounds = 4
    job_id = fed.submit(job(training={"rounds": rounds}))
    wait_for(lambda: held.holding == {"w0", "w1"}, 60, "both workers to hold round 3's task")
    assert fed.store.job(job_id).rounds_done == 2
    broker.ctl("stop_app")
    try:
        time.sleep(3)
    finally:
        broker.ctl("start_app")
        held.release.set()
    wait_for(broker.answers, 60, "RabbitMQ to answer again", interval=0.5)
    fed.wait_job(job_id, 120)
    assert [r.aggregated for r in fed.store.rounds(job_id)] == [2] * rounds
    assert training.count == {"w0": rounds, "w1": rounds}  # the task redelivered after the outage is not retrained
    assert all(sample("fedbroker_worker_tasks_total", {"worker_id": w, "outcome": "already_uploaded"})
               == already[w] + 1 for w in ("w0", "w1"))  # ... it was acked as already done
    assert fed.dead_letters() == []
    # Every link comes back by itself, whenever its backoff lets it (waited for, not counted at a moment).
    wait_for(lambda: fed.bus.reconnects >= 2 and all(w.bus.reconnects >= 2 for w in workers), 60,
             "both links of every bus to reconnect")


# ----- consumer_timeout ----------------------------------------------------------------------------

# Short enough for a test, long enough that a round deadline below it (less the coordinator's 20 % margin)
# leaves the fast worker seconds to train and upload on a loaded machine.
CONSUMER_TIMEOUT_MS = 10_000


@pytest.fixture
def short_consumer_timeout(broker: PrivateRabbitMQ) -> Iterator[None]:
    """RabbitMQ 3.10 has one broker-wide consumer_timeout (no per-queue x-consumer-timeout before 3.12): lower
    it, and the channel tick that enforces it (60 s by default), for channels opened during the test."""
    yield from changed_broker_env(broker, {"consumer_timeout": CONSUMER_TIMEOUT_MS, "channel_tick_interval": 500})


def read_consumer_timeout_s(node: PrivateRabbitMQ) -> float:
    printed = broker_env(node, "consumer_timeout")  # what a deployment's broker.consumer_timeout_s must say
    assert printed.startswith("{ok,"), printed
    return int(printed[4:-1]) / 1000


@pytest.fixture
def timed_federation(short_consumer_timeout: None, broker: PrivateRabbitMQ, tmp_path: Path) -> Iterator[Federation]:
    fed = Federation(broker.url, tmp_path, start_coordinator=False)
    try:
        yield fed
    finally:
        fed.close()


class Recorder(WorkerAgent):
    deliveries: list[tuple[int, int]]

    def on_task(self, delivery: Any) -> None:
        env = envelope.decode(delivery.body, expect=("round_task", "evaluation_task"))
        if env.HasField("round_task"):  # round tasks only (not federated evaluation's)
            self.deliveries.append((env.round_task.round, delivery.attempts))
        super().on_task(delivery)


@pytest.mark.timeout(90)
def test_training_longer_than_the_consumer_timeout_ends_at_the_round_deadline_and_keeps_the_channel(
        timed_federation: Federation, broker: PrivateRabbitMQ, training: Training,
        caplog: pytest.LogCaptureFixture) -> None:
    fed = timed_federation
    caplog.set_level(logging.WARNING, logger="fedbroker.bus")
    fed.start_coordinator(broker_consumer_timeout_s=read_consumer_timeout_s(broker))
    assert fed.coordinator is not None and fed.coordinator.max_round_timeout_s == pytest.approx(8.0)
    with pytest.raises(ConfigError, match=r"schedule.round_timeout_s: must be at most 8 s") as info:
        fed.submit(job(schedule={"round_timeout_s": 9}))
    assert "consumer_timeout is 10 s" in str(info.value)

    Recorder.deliveries = []
    # 22 steps of 0.5 s: 11 s of training, past the 10 s consumer_timeout. It gives up at the first step after
    # the 7 s deadline: the 3 s left before the consumer_timeout are many steps however loaded the machine is,
    # and the fast worker has 7 s to train and upload its round.
    training.step_delay["slow"] = 0.5
    fed.add_worker("fast", index=0, count=2)
    slow = fed.add_worker("slow", index=1, count=2, agent_class=Recorder)
    job_id = fed.submit(job(training={"rounds": 2}, schedule={"round_timeout_s": 7.0}))
    fed.wait_job(job_id, 60)
    def slow_failed() -> list[Any]:
        return [p for p in fed.store.participants(job_id) if p.worker_id == "slow" and p.status == "failed"]

    # It gave up at each round's deadline (when the round closes, with the fast worker's update).
    rows = wait_for(lambda: len(slow_failed()) == 2 and slow_failed(), 30, "the slow worker to report both rounds")
    assert all("deadline passed during training" in p.reason for p in rows)
    assert [r.aggregated for r in fed.store.rounds(job_id)] == [1, 1]
    assert isinstance(slow, Recorder) and slow.deliveries == [(1, 1), (2, 1)]  # each task delivered once
    assert slow.bus.reconnects == 0 and "closed its channel" not in caplog.text
    assert fed.dead_letters() == []


@pytest.mark.timeout(90)
def test_delivery_held_past_the_consumer_timeout_is_redelivered_and_handled_once(
        timed_federation: Federation, training: Training, caplog: pytest.LogCaptureFixture) -> None:
    """The safety net, for a deployment that did not tell the coordinator its broker's consumer_timeout: the
    broker closes the slow worker's channel and requeues its task; the bus consumes again on a new channel,
    and the redelivered copy is acked without training once the first training's update is accepted."""
    fed = timed_federation
    caplog.set_level(logging.WARNING, logger="fedbroker.bus")
    fed.start_coordinator()  # knows no consumer_timeout: accepts the job's round far longer than it (NEVER_S)
    Recorder.deliveries = []
    training.step_delay["slow"] = 0.6  # about 13 s of training against a 10 s consumer_timeout
    fed.add_worker("fast", index=0, count=2)
    slow = fed.add_worker("slow", index=1, count=2, agent_class=Recorder)
    job_id = fed.submit(job(training={"rounds": 1}))
    fed.wait_job(job_id, 60)
    assert fed.store.rounds(job_id)[0].aggregated == 2
    assert "closed its channel" in caplog.text
    assert isinstance(slow, Recorder) and slow.deliveries[0] == (1, 1) and (1, 2) in slow.deliveries
    assert training.count["slow"] == 1  # trained once: the copy found the update accepted
    assert fed.dead_letters() == []


@pytest.mark.timeout(150)
def test_a_task_whose_update_was_accepted_is_never_dead_lettered_however_long_it_trained(
        timed_federation: Federation, training: Training, caplog: pytest.LogCaptureFixture) -> None:
    """The coordinator was told a longer consumer timeout than the broker applies (here: none, a 60 s round),
    and the slow worker trains for about six of the broker's 4 s timeouts. The broker closes its channel each
    time, and redelivers the copy that waits behind the training: that is no failed attempt (the handler never
    had it). Before, each one counted, and the task was dead-lettered 'after 5 deliveries' although its update
    was accepted; now the copy is acked as already uploaded, and nothing is dead-lettered."""
    fed = timed_federation
    caplog.set_level(logging.INFO, logger="fedbroker.bus")
    fed.start_coordinator()
    Recorder.deliveries = []
    training.step_delay["slow"] = 1.1  # 23 steps: about 25 s of training against a 4 s consumer_timeout
    fed.add_worker("fast", index=0, count=2)
    slow = fed.add_worker("slow", index=1, count=2, agent_class=Recorder)
    acked_copies = {"worker_id": "slow", "outcome": "already_uploaded"}
    before = sample("fedbroker_worker_tasks_total", acked_copies)
    job_id = fed.submit(job(training={"rounds": 1}, schedule={"round_timeout_s": 60}))
    fed.wait_job(job_id, 90)
    assert fed.store.rounds(job_id)[0].aggregated == 2
    assert training.count["slow"] == 1
    wait_for(lambda: sample("fedbroker_worker_tasks_total", acked_copies) >= before + 1, 30,
             "the redelivered copy to be acked as already uploaded")
    assert fed.dead_letters() == []  # before: dead-lettered "after 5 deliveries"
    assert "redelivered while it waited for its handler" in caplog.text
    assert isinstance(slow, Recorder) and max(attempts for _, attempts in slow.deliveries) <= 2
