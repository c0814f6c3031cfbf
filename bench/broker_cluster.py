"""Benchmark 15: publishing a round's tasks to a three-node RabbitMQ cluster with quorum queues against one
classic node, in the same run.

Both brokers are private ones this benchmark starts and stops (tests/rabbitmq_cluster.py, tests/rabbitmq_node.py:
loopback ports, their own folders; never the machine's broker). On each, one `AmqpBus` declares N worker queues
(classic on the single node; quorum, replicated on all three nodes, on the cluster) and publishes a round of N
persistent tasks with `publish_tasks`, as the coordinator does: on the classic node one transaction, on the
cluster one fresh confirm channel with the whole batch outstanding (a transaction is not safe on quorum queues
across a node loss: fedbroker/bus/amqp_quorum.py). A round returns once the broker has taken every task (written
to disk; on the cluster, by a majority of the nodes).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.harness import Goal, Section, Stat, repeat

BODY = b"t" * 256  # a RoundTask envelope's order of size
DEFAULT_URL = os.environ.get("FEDBROKER_BENCH_AMQP_URL",
                             os.environ.get("FEDBROKER_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2F"))
GOAL_RATIO = 0.5


def _rate(url: str, queue_type: str, count: int, repeats: int, *, clean_up: bool = False) -> tuple[Stat, float]:
    """(seconds per round of `count` tasks, seconds to declare the `count` worker queues) on one broker;
    `clean_up`: delete the namespace's queues afterwards (a broker the benchmark did not start)."""
    from fedbroker.bus import AmqpBus
    from fedbroker.bus.amqp_topology import delete_topology

    ids = [f"w{i:04d}" for i in range(count)]
    namespace = f"bench{time.time_ns() % 10**9}"
    try:
        with AmqpBus(url, namespace=namespace, queue_type=queue_type, publish_timeout_s=300) as bus:
            started = time.perf_counter()
            for wid in ids:
                bus.declare_worker(wid)
            declared = time.perf_counter() - started
            tasks = [(wid, BODY) for wid in ids]

            def round_() -> None:
                assert bus.publish_tasks(tasks) == []

            return Stat.of(repeat(round_, repeats=repeats, warmup=1), "s"), declared
    finally:
        if clean_up:
            delete_topology(url, namespace, ids)


def _quick(section: Section, started: float) -> Section:
    """`--quick`: no private brokers (four node starts cost about a minute and a half): the machine's broker,
    one node, classic against quorum queues, 100 tasks, its queues deleted afterwards. It checks the
    benchmark's path, not the cluster's rate, which `make bench` measures."""
    url = DEFAULT_URL
    for where, queue_type in (("machine's node, classic queues (quick)", "classic"),
                              ("machine's node, quorum queues (quick: no cluster)", "quorum")):
        stat, declared = _rate(url, queue_type, 100, 1, clean_up=True)
        section.rows.append({"broker": where, "N tasks": 100, "round (s)": stat,
                             "tasks / s": stat.inverse(100, "tasks/s"), "declaring N queues (s)": round(declared, 2)})
    section.notes.append("quick run: one node, no cluster; `make bench` starts the three-node cluster")
    section.seconds = time.perf_counter() - started
    return section


def _brokers(root: Path) -> tuple[Any, Any]:
    from tests.rabbitmq_cluster import start_private_cluster
    from tests.rabbitmq_node import start_private_rabbitmq

    single = start_private_rabbitmq(root / "single")
    try:
        cluster = start_private_cluster(root / "cluster")
    except BaseException:
        single.stop()
        raise
    return single, cluster


def run(*, quick: bool) -> Section:
    started = time.perf_counter()
    count = 100 if quick else 1000
    repeats = 1 if quick else 3
    section = Section(
        "broker_cluster", "15. A round's tasks on a 3-node quorum cluster vs one classic node",
        f"Seconds to publish a round of N persistent tasks ({len(BODY)} bytes each) with `AmqpBus.publish_tasks`, "
        "until the broker has taken all of them; private brokers on loopback, started by the benchmark.",
    )
    if quick:
        return _quick(section, started)
    with tempfile.TemporaryDirectory(prefix="bench-broker-") as folder:
        try:
            single, cluster = _brokers(Path(folder))
        except BaseException as exc:  # pytest's skip/fail outcomes when RabbitMQ's scripts are missing
            if isinstance(exc, KeyboardInterrupt):
                raise
            section.notes.append(f"private brokers could not start: {type(exc).__name__}: {exc}")
            section.seconds = time.perf_counter() - started
            return section
        try:
            classic, classic_declare = _rate(single.url, "classic", count, repeats)
            quorum, quorum_declare = _rate(cluster.url, "quorum", count, repeats)
        finally:
            cluster.stop()
            single.stop()
    for where, stat, declared in (("1 node, classic queues (transaction)", classic, classic_declare),
                                  ("3 nodes, quorum queues (confirms outstanding)", quorum, quorum_declare)):
        section.rows.append({"broker": where, "N tasks": count, "round (s)": stat,
                             "tasks / s": stat.inverse(count, "tasks/s"), "declaring N queues (s)": round(declared, 2)})
    ratio = classic.median / quorum.median
    section.goals.append(Goal(f"cluster / single node publish rate, N={count}", round(ratio, 2),
                              f">= {GOAL_RATIO}x", ratio >= GOAL_RATIO,
                              f"{count / quorum.median:.0f} vs {count / classic.median:.0f} tasks/s (medians)"))
    section.seconds = time.perf_counter() - started
    return section


if __name__ == "__main__":
    import json
    import sys

    result = run(quick="--quick" in sys.argv)
    print(json.dumps(result.to_json(), indent=1))
