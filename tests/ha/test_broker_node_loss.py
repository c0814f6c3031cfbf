"""kill -9 of the RabbitMQ node that leads the queues, mid-round, on a private three-node cluster with quorum
queues: nothing is lost and nothing counted twice, and the time the failover took is measured and reported
(never asserted: the machine's load decides it). Two cases share one cluster (its start is this module's cost):

* the bus alone, at volume: the real bus objects both sides use (`AmqpBus`: the coordinator's batch publish of a
  round's tasks, the workers' task consumers and their reports on the control queue, the coordinator's control
  consumer), with stub handlers that do what the real ones do about a redelivery (a worker handed a task it
  already answered sends the same update again; the coordinator counts an update once per task);
* the real processes: `fedbroker coordinator`, `fedbroker aggregator` and three DP `fedbroker worker`s, each on
  its own broker user (as the kits deploy them) with `broker.url` listing the three nodes and `broker.queue_type:
  quorum`; one site holds its round-1 task while the others' updates are accepted, the node leading most of the
  namespace's queues is killed, the site let go. The job finishes, each round aggregates each site's update
  once, and the ε the coordinator recorded for each site is what the site's own ledger spent.

The second case needs three live nodes, so it first starts again the node the first one killed (while its
processes start: a quorum queue declared meanwhile still counts the revived node among its members).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import pytest

from fedbroker.bus import AmqpBus, Delivery
from fedbroker.coordinator.service import CoordinatorClient
from fedbroker.worker.ledger import PrivacyLedger
from tests.faults.harness import job
from tests.integration.processes import Deployment
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


# ----- the same kill with the real processes --------------------------------------------------------------------

SITES = ["w1", "w2", "w3"]
HELD = "w1"          # holds its task of round 1 (tests/ha/held_worker.py) until the kill
# where each connects first, as a place in the order (a node alive through the case before, the other, the
# revived one): the coordinator and the held site on the node that will die, the other two sites not
FIRST = {"coordinator": 0, "w1": 0, "w2": 1, "w3": 2}
JOB_ROUNDS = 2
LOCAL_EPOCHS = 1


def _spread(url: str, cluster: PrivateCluster, first: int) -> str:
    """A participant's broker.url over the whole cluster: its own user's `url` (on any node) moved to node
    `first`, the other nodes after it as bare host:port (which log in as that same user)."""
    ports = [node.amqp_port for node in cluster.nodes]
    order = ports[first:] + ports[:first]
    login, rest = url.rsplit("@", 1)
    vhost = rest.split("/", 1)[1]
    return ",".join([f"{login}@127.0.0.1:{order[0]}/{vhost}", *(f"127.0.0.1:{port}" for port in order[1:])])


@contextlib.contextmanager
def _deployment(cluster: PrivateCluster, tmp_path: Path) -> Iterator[tuple[Deployment, Future[None]]]:
    """A deployment on the cluster and the revival of the node the case before killed (this case needs three, to
    lose one), which runs while the processes start: a quorum queue declared meanwhile has the revived node as
    a member all the same. One broker user per participant (as a kit provisions them; the users are the
    cluster's, imported once through a live node), every broker.url listing the three nodes. The processes are
    killed at the end (the case is over)."""
    survivors = [i for i, node in enumerate(cluster.nodes) if not node.killed]
    order = survivors + [i for i in range(len(cluster.nodes)) if i not in survivors]
    d = Deployment(cluster.nodes[order[0]].url, tmp_path, name="brokerloss", worker_ids=SITES)
    d.spawn("aggregator", "aggregator", {"aggregator.listen": d.aggregator, "aggregator.spool_dir": d.tmp / "spool"})
    with ThreadPoolExecutor(1) as pool:
        revival = pool.submit(cluster.revive)
        try:
            users = cluster.nodes[order[0]].provision(namespace=d.namespace, participants=["coordinator", *SITES])
            d.urls = {who: _spread(url, cluster, order[FIRST[who]]) for who, url in users.items()}
            yield d, revival
        finally:
            wait([revival])
            for process in d.processes.values():
                if process.poll() is None:
                    process.kill()
            d.close(remove_topology=False)  # the cluster goes with the module; its queues with it


def _start(d: Deployment) -> None:
    """The coordinator and three DP sites (the aggregation service runs already), every bus on quorum queues;
    the held site waits for the file `release` before training round 1."""
    quorum = {"broker.queue_type": "quorum"}
    d.spawn("coordinator", "coordinator", {**quorum, "coordinator.listen": d.coordinator,
                                           "coordinator.state_dir": d.tmp / "state"})
    for index, site in enumerate(SITES):
        settings: dict[str, Any] = {
            **quorum, "worker.id": site, "worker.partition.num_clients": len(SITES),
            "worker.partition.client_index": index, "worker.device": "cpu", "worker.torch_threads": 1,
            "worker.ledger_path": d.tmp / f"{site}-ledger.json", "worker.heartbeat_s": 1,
            "worker.dp.enabled": "true", "worker.dp.epsilon_budget": 100}
        if site == HELD:
            d.spawn(site, "worker", settings, entry=("-m", "tests.ha.held_worker"), extra_env={
                "FEDBROKER_TEST_HOLD_RELEASE": str(d.tmp / "release"), "FEDBROKER_TEST_HOLD_ROUND": "1"})
        else:
            d.spawn(site, "worker", settings)


def _replicated(cluster: PrivateCluster, namespace: str) -> dict[str, tuple[str, list[str]]]:
    """The namespace's quorum queues once each has its three members online (else {})."""
    queues = {name: q for name, q in cluster.quorum_queues().items() if name.startswith(f"{namespace}.")}
    return queues if queues and all(len(online) == len(cluster.nodes) for _, online in queues.values()) else {}


def _statuses(d: Deployment, job_id: str, number: int) -> dict[str, str]:
    reply = d.coordinator_status(job_id)
    return {} if reply is None else {p.worker_id: p.status for p in reply.participants if p.round == number}


def _watch_failover(d: Deployment, job_id: str, killed_wall: float) -> dict[str, float]:
    """Seconds from the kill to each first sign of progress, read off the coordinator's Status: a site's
    heartbeat heard again (the control queue's new leader, the buses reconnected), all three heard, the held
    site's update recorded (after its training), round 1 closed. Measured, never asserted."""
    seen: dict[str, float] = {}
    end = time.monotonic() + DEADLINE_S
    while len(seen) < 4 and time.monotonic() < end:
        d.alive("coordinator", *SITES)
        reply = d.coordinator_status(job_id)
        now = time.time()
        if reply is not None:
            heard = [now - w.last_seen_seconds_ago for w in reply.workers if w.worker_id in SITES]
            after = [t - killed_wall for t in heard if t > killed_wall]
            if after:
                seen.setdefault("kill_to_first_heartbeat_s", min(after))
            if len(after) == len(SITES):
                seen.setdefault("kill_to_every_site_heard_s", max(after))
            if any(p.round == 1 and p.worker_id == HELD and p.status in ("uploaded", "aggregated")
                   for p in reply.participants):
                seen.setdefault("kill_to_held_update_recorded_s", now - killed_wall)
            if any(r.round == 1 and r.status == "closed" for r in reply.rounds):
                seen.setdefault("kill_to_round_closed_s", now - killed_wall)
        time.sleep(0.1)
    return {key: round(value, 2) for key, value in seen.items()}


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_real_processes_finish_their_job_when_the_leader_of_their_queues_is_killed_mid_round(
        cluster: PrivateCluster, tmp_path: Path, record_property: Any) -> None:
    began = time.monotonic()
    with _deployment(cluster, tmp_path) as (d, revival):
        _start(d)
        d.wait_for(lambda: d.registered(len(SITES)), 2 * DEADLINE_S, "the sites to register")
        registered_s = time.monotonic() - began
        spec = d.tmp / "job.json"
        spec.write_text(json.dumps(job(training={"rounds": JOB_ROUNDS, "local_epochs": LOCAL_EPOCHS},
                                       schedule={"min_workers": len(SITES)})))
        with CoordinatorClient(d.coordinator, timeout_s=DEADLINE_S) as client:  # as the CLI submits, in-process
            job_id = client.submit(spec.read_text())
        free = sorted(set(SITES) - {HELD})
        # mid-round by construction: the free sites' round-1 updates accepted, the held site holding its task
        d.wait_for(lambda: all(_statuses(d, job_id, 1).get(s) == "uploaded" for s in free)
                   and (d.tmp / f"holding-{HELD}").exists(), DEADLINE_S, "round 1 half in, one site holding")
        mid_round_s = time.monotonic() - began
        revival.result()  # the node the case before killed is back: three, to lose one
        queues = d.wait_for(lambda: _replicated(cluster, d.namespace), DEADLINE_S, "every queue on three nodes")
        leaders, control = [leader for leader, _ in queues.values()], queues[f"{d.namespace}.coordinator"][0]
        # the node leading most of the namespace's queues (the control queue's leader among equals)
        victim = cluster.node_named(max(set(leaders), key=lambda name: (leaders.count(name), name == control)))
        led = sorted(name.removeprefix(f"{d.namespace}.") for name, (leader, _) in queues.items()
                     if leader == victim.name)
        killed_wall = time.time()
        victim.kill()
        (d.tmp / "release").touch()
        measured = _watch_failover(d, job_id, killed_wall)
        d.wait_for(lambda: d.job_ended(job_id), 2 * DEADLINE_S, "the job to end", watching=["coordinator", *SITES])
        _check_books(d, job_id)
        reconnects = {name: (d.tmp / f"{name}.log").read_text(errors="replace").count(" reconnected to ")
                      for name in ("coordinator", *SITES)}
        redelivered = "already has our update" in (d.tmp / f"{HELD}.log").read_text(errors="replace")
        report = {"case": "real processes, queue leader kill -9 mid-round", **measured, "killed_led": led,
                  "bus_reconnects": reconnects, "held_task_redelivered_and_acked_untrained": redelivered,
                  "rounds": JOB_ROUNDS, "start_to_registered_s": round(registered_s, 1),
                  "start_to_mid_round_s": round(mid_round_s, 1)}
        for key, value in report.items():
            record_property(key, value)
        (tmp_path / "failover.json").write_text(json.dumps(report, indent=1))
        print(f"\nbroker node loss, real processes: {json.dumps(report)}")


def _check_books(d: Deployment, job_id: str) -> None:
    """Every round closed once with each site's update aggregated exactly once, and each site's ε spent once per
    round and recorded as its own ledger holds it (nothing under-recorded)."""
    reply = d.coordinator_status(job_id)
    assert reply is not None and reply.jobs[0].status == "completed", (reply and reply.jobs[0].error, d.logs())
    rounds = sorted(reply.rounds, key=lambda r: r.round)
    assert [r.round for r in rounds] == list(range(1, JOB_ROUNDS + 1)), rounds
    assert all(r.status == "closed" and r.participants == r.aggregated == len(SITES) for r in rounds), \
        f"an update lost or counted twice: {[(r.round, r.participants, r.aggregated) for r in rounds]}"
    versions = [r.model_version for r in rounds]
    assert versions == list(range(versions[0], versions[0] + JOB_ROUNDS)), f"a round closed twice: versions {versions}"
    for number in range(1, JOB_ROUNDS + 1):
        rows = sorted(p.worker_id for p in reply.participants if p.round == number and p.status == "aggregated")
        assert rows == SITES, (number, list(reply.participants))
    for site in SITES:
        ledger = PrivacyLedger(str(d.tmp / f"{site}-ledger.json"), worker_id=site)
        history = ledger.history(job_id)  # (noise, sampling rate, steps), steps summed over equal rates
        steps_per_round = round(LOCAL_EPOCHS / history[0][1])
        assert sum(steps for _, _, steps in history) == JOB_ROUNDS * steps_per_round, (site, history)
        recorded = max(p.epsilon for p in reply.participants if p.worker_id == site)
        assert ledger.epsilon(job_id) > 0, f"{site} spent no ε: DP was off"
        assert recorded == pytest.approx(ledger.epsilon(job_id), rel=1e-9), (site, recorded)
