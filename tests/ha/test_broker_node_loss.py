"""kill -9 of the RabbitMQ node that leads the task queues, mid-round, on a private three-node cluster with quorum
queues: every task reaches its worker and every update is counted once by the coordinator's side, and the time
the bus took to fail over is measured and reported (never asserted: the machine's load decides it).

The round runs through the real bus objects both sides use (`AmqpBus`: the coordinator's batch publish of a
round's tasks in one transaction, the workers' task consumers and their reports on the control queue, the
coordinator's control consumer), with stub handlers that do what the real ones do about a redelivery: a worker
handed a task it already answered sends the same update again (it kept it), and the coordinator counts an update
once per task (the aggregation service's accept is idempotent per worker and round).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fedbroker.bus import AmqpBus, Delivery
from tests.rabbitmq_cluster import PrivateCluster, start_private_cluster

WORKERS = 6
ROUNDS = 24
KILL_AFTER_ROUND = 8      # the kill comes while this round's tasks are held in their handlers
DEADLINE_S = 120.0       # a generous bound on any one wait: a loaded 2-core machine, never a timing assertion


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateCluster]:
    """One cluster for the module (its start is this module's cost), stopped by pid at the end."""
    started = start_private_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        yield started
    finally:
        started.stop()


def _rotated(cluster: PrivateCluster, first: int) -> str:
    """The cluster's broker.url starting at node `first` (where that client connects first)."""
    urls = cluster.urls
    return ",".join(urls[first:] + urls[:first])


def _bus(url: str, namespace: str, **options: Any) -> AmqpBus:
    return AmqpBus(url, namespace=namespace, queue_type="quorum", reconnect_initial_s=0.1, reconnect_max_s=1.0,
                   publish_timeout_s=DEADLINE_S, heartbeat_s=5, **options)


def _wait(condition: Any, what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:g}s for {what}"
        time.sleep(0.02)


class Tally:
    """The coordinator's side: updates counted once per task; duplicates seen (and not counted) kept apart."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counted: dict[str, int] = {}
        self.duplicates = 0
        self.first_after: dict[float, float] = {}  # a kill's time → when the first new update after it was counted

    def on_update(self, delivery: Delivery) -> None:
        task, _, value = delivery.body.decode().partition("=")
        with self.lock:
            if task in self.counted:
                self.duplicates += 1
            else:
                self.counted[task] = int(value)
                now = time.monotonic()
                for killed_at in self.first_after:
                    if self.first_after[killed_at] == 0.0 and now > killed_at:
                        self.first_after[killed_at] = now
        delivery.ack()


class StubWorkers:
    """Workers on one bus: each answers its task with an update (the task's number), keeps the update, and on a
    task it already answered sends the kept update again instead of computing a new one."""

    def __init__(self, bus: AmqpBus, ids: list[str], *, hold: str, release: threading.Event) -> None:
        self.bus = bus
        self.kept: dict[str, str] = {}
        self.handled = 0
        self.held = 0  # tasks of the held round in a handler now
        self.hold, self.release = hold, release  # tasks starting with `hold` wait for `release` (the kill)
        self.lock = threading.Lock()
        for wid in ids:
            bus.consume_tasks(wid, self.on_task)

    def on_task(self, delivery: Delivery) -> None:
        task = delivery.body.decode()
        with self.lock:
            update = self.kept.setdefault(task, f"{task}={sum(map(ord, task))}")
            self.handled += 1
            held = task.startswith(self.hold) and not self.release.is_set()
            self.held += held
        if held:  # the round the kill hits: its tasks delivered, unacked, in their handlers
            assert self.release.wait(DEADLINE_S)
        self.bus.publish_control(update.encode())
        delivery.ack()


def test_killing_the_task_queues_leader_mid_round_loses_and_double_counts_nothing(
        cluster: PrivateCluster, tmp_path: Path, record_property: Any) -> None:
    namespace = f"ha{time.time_ns() % 10**9}"
    wids = [f"w{i}" for i in range(WORKERS)]
    tally = Tally()
    coordinator = _bus(_rotated(cluster, 0), namespace)
    worker_buses = [_bus(_rotated(cluster, i % len(cluster.nodes)), namespace) for i in range(2)]
    try:
        for wid in wids:
            coordinator.declare_worker(wid)  # the task queues' leaders: the node the coordinator reached
        coordinator.consume_control(tally.on_update)
        coordinator.start()
        release = threading.Event()
        fleets = [StubWorkers(bus, wids[i::2], hold=f"r{KILL_AFTER_ROUND}.", release=release)
                  for i, bus in enumerate(worker_buses)]
        for bus in worker_buses:
            bus.start()
            assert bus.wait_ready(DEADLINE_S)
        leaders = cluster.leaders()
        task_leaders = [leaders[f"{namespace}.worker.{wid}"] for wid in wids]
        victim = cluster.node_named(max(set(task_leaders), key=task_leaders.count))
        expected: dict[str, int] = {}
        recovered_at = killed_at = 0.0
        for number in range(ROUNDS):
            bodies = [f"r{number}.{wid}" for wid in wids]
            expected.update({body: sum(map(ord, body)) for body in bodies})
            assert coordinator.publish_tasks([(wid, body.encode()) for wid, body in zip(wids, bodies)]) == []
            if number == KILL_AFTER_ROUND:  # mid-round by construction: every task of the round is in a handler
                _wait(lambda: sum(f.held for f in fleets) == WORKERS, "the round's tasks in their handlers")
                victim.kill()
                killed_at = time.monotonic()
                tally.first_after[killed_at] = 0.0
                release.set()
            _wait(lambda bodies=bodies: all(b in tally.counted for b in bodies), f"round {number}'s updates")
            if number == KILL_AFTER_ROUND:
                recovered_at = time.monotonic()  # the round the kill hit is complete
        _wait(lambda: sum(f.handled for f in fleets) >= len(expected), "every task handled")
        assert victim.killed and victim not in cluster.alive()
        assert tally.counted == expected  # 0 lost, each counted once, with the value its worker computed
        assert coordinator.dead_letter_count(timeout_s=DEADLINE_S) == 0
        first_update = tally.first_after[killed_at] - killed_at
        report = {"failover_first_update_s": round(first_update, 3),
                  "failover_round_complete_s": round(recovered_at - killed_at, 3),
                  "tasks": len(expected), "duplicate_updates_seen": tally.duplicates,
                  "task_deliveries": sum(f.handled for f in fleets), "reconnects": coordinator.reconnects
                  + sum(b.reconnects for b in worker_buses), "killed": victim.name}
        for key, value in report.items():
            record_property(key, value)
        (tmp_path / "failover.json").write_text(json.dumps(report, indent=1))
        print(f"\nbroker node loss: {json.dumps(report)}")
    finally:
        for bus in (coordinator, *worker_buses):
            bus.close()


def test_quorum_queues_count_deliveries_ignore_a_forged_count_and_keep_their_arguments(cluster: PrivateCluster) -> None:
    """The broker counts (a publisher's own x-delivery-count is overwritten), the handler sees each attempt, the
    delivery limit dead-letters after max_attempts deliveries, and a client that re-declares the queue with other
    arguments (a dishonest site: classic, or a delivery limit of its own) is refused."""
    import pika
    import pika.exceptions as pex

    namespace = f"hq{time.time_ns() % 10**9}"
    seen: list[tuple[int, bool]] = []
    alive = cluster.alive()  # the first test killed one
    bus = _bus(alive[0].url, namespace, max_attempts=2)
    try:
        def fail(delivery: Delivery) -> None:
            seen.append((delivery.attempts, delivery.redelivered))
            raise RuntimeError("a poison message")

        bus.consume_control(fail)
        bus.start()
        assert bus.wait_ready(DEADLINE_S)
        site = pika.BlockingConnection(pika.URLParameters(alive[-1].url))
        try:
            channel = site.channel()
            channel.confirm_delivery()
            channel.basic_publish(f"{namespace}.control", "coordinator", b"poison", pika.BasicProperties(
                delivery_mode=2, message_id="m1", headers={"x-delivery-count": 7}), mandatory=True)
            _wait(lambda: bus.dead_letter_count(timeout_s=DEADLINE_S) == 1, "the poison message dead-lettered")
            assert seen == [(1, False), (2, True)]  # two deliveries (max_attempts), the forged count ignored
            for changed in ({"x-queue-type": "classic"}, {"x-queue-type": "quorum", "x-delivery-limit": 1000}):
                with pytest.raises(pex.ChannelClosedByBroker) as refused:
                    site.channel().queue_declare(f"{namespace}.coordinator", durable=True, arguments=changed)
                assert refused.value.reply_code == 406  # PRECONDITION_FAILED: the queue keeps its arguments
            ours = bus._declarer.consumer_queue_arguments()
            assert site.channel().queue_declare(f"{namespace}.coordinator", durable=True, arguments=ours)
        finally:
            site.close()
    finally:
        bus.close()
