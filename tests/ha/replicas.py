"""Two aggregation replicas for the chaos cases: one spool folder (the shared volume), one lease database (a SQLite
file both processes reach), a coordinator that lists both (`aggregator.targets`), and DP workers, some of which
hold a round's task (tests/ha/held_worker.py) until the test releases them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tests.integration.processes import Deployment
from tests.rabbitmq_node import free_ports


@contextlib.contextmanager
def killed_at_the_end(rabbitmq_url: str, tmp_path: Path, *, name: str, workers: list[str]) -> Iterator[Deployment]:
    """A deployment whose processes are all killed at the end: a chaos case's processes end as its victim did
    (kill -9), with no orderly shutdown to wait for."""
    d = Deployment(rabbitmq_url, tmp_path, name=name, worker_ids=workers)
    try:
        yield d
    finally:
        for process in d.processes.values():
            if process.poll() is None:
                process.kill()
        d.close()


def start_replicas(d: Deployment, workers: list[str], *, held: Iterable[str], lease_ttl_s: float,
                   hold_round: int = 1) -> dict[str, str]:
    """Both replicas (`agg-a`, `agg-b`), the coordinator and the workers (those in `held` hold their task of round
    `hold_round` until the file `release` appears in the test's folder); the replicas' names by address."""
    replicas = {name: f"127.0.0.1:{port}" for name, port in zip(("agg-a", "agg-b"), free_ports(2))}
    targets = ",".join(replicas.values())
    shared = {"aggregator.spool_dir": d.tmp / "spool", "aggregator.database_url": f"sqlite:///{d.tmp / 'leases.sqlite'}",
              "aggregator.lease_ttl_s": lease_ttl_s, "aggregator.targets": targets}
    for name, address in replicas.items():
        d.spawn(name, "aggregator", {**shared, "aggregator.listen": address, "aggregator.advertise": address})
    d.spawn("coordinator", "coordinator", {"coordinator.listen": d.coordinator, "coordinator.state_dir": d.tmp / "state",
                                           "aggregator.targets": targets, "coordinator.safety_poll_s": 0.5})
    holding = set(held)
    for index, worker in enumerate(workers):
        settings: dict[str, Any] = {
            "worker.id": worker, "worker.partition.num_clients": len(workers), "worker.partition.client_index": index,
            "worker.device": "cpu", "worker.torch_threads": 1, "worker.ledger_path": d.tmp / f"{worker}-ledger.json",
            "worker.heartbeat_s": 1, "worker.dp.enabled": "true", "worker.dp.epsilon_budget": 100}
        if worker in holding:
            d.spawn(worker, "worker", settings, entry=("-m", "tests.ha.held_worker"), extra_env={
                "FEDBROKER_TEST_HOLD_RELEASE": str(d.tmp / "release"), "FEDBROKER_TEST_HOLD_ROUND": str(hold_round)})
        else:
            d.spawn(worker, "worker", settings)
    return {address: name for name, address in replicas.items()}
