"""Coordinators on a shared PostgreSQL for the chaos cases: coordinator processes started as a kit starts them
(`fedbroker coordinator`, settings in FEDBROKER__ variables) on the machine's RabbitMQ under a namespace of their
own, the aggregation service and the workers in this process, and what the cases read back: the lease, the
store, the workers' own ledgers.

Every coordinator names the same `database_url` and the same `state_dir` (their checkpoints: a shared volume in
a cluster). Rounds are paced by their uploads, never a clock: deadlines are far away (NEVER_S).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, func, select
from sqlalchemy.exc import ProgrammingError

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.app.failover import FailoverClient
from fedbroker.bus import delete_topology, open_bus
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig
from fedbroker.coordinator import tables as t
from fedbroker.coordinator.standby import leader_address
from fedbroker.coordinator.store import StateStore
from fedbroker.ha.lease import LEASES
from fedbroker.job.status import FINISHED
from fedbroker.worker.agent import WorkerAgent
from fedbroker.worker.ledger import PrivacyLedger
from tests.faults.harness import HoldsRound, job
from tests.rabbitmq_node import free_ports
from tests.source_roots import PYTHONPATH

LEASE_TTL_S = 3.0
JOB = job(training={"rounds": 3, "local_epochs": 1, "batch_size": 64, "lr": 0.2}, schedule={"min_workers": 2})


def until(condition: Callable[[], Any], *, what: str, within_s: float, logs: Path) -> Any:
    """Wait on a condition (never on a clock reading), failing with every process's log."""
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {within_s:g}s waiting for {what}\n{tail(logs)}")


def tail(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in sorted(logs.glob("*.log")))


class Federation:
    """The aggregation service here; coordinators and workers as processes (`spawn_*`), killed by pid at `close`."""

    def __init__(self, amqp_url: str, database_url: str, tmp: Path, *, workers: int = 2) -> None:
        self.amqp_url, self.database_url, self.tmp = amqp_url, database_url, tmp
        self.namespace = f"fbha-{uuid.uuid4().hex[:8]}"
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.book = RoundBook()
        self.server, port = serve(self.book)
        self.aggregator = f"127.0.0.1:{port}"
        self.worker_ids = [f"w{i}" for i in range(workers)]
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.addresses: dict[str, str] = {}   # coordinator name → its gRPC address
        self.workers: dict[str, WorkerAgent] = {}
        self.held = HoldsRound.at(2)
        self.engine = create_engine(database_url, pool_pre_ping=True)

    def _spawn(self, name: str, verb: str, settings: dict[str, Any]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
        env["PYTHONPATH"] = PYTHONPATH
        base = {"broker.url": self.amqp_url, "broker.namespace": self.namespace, "aggregator.target": self.aggregator,
                "log_level": "INFO"}
        env.update({"FEDBROKER__" + k.upper().replace(".", "__"): str(v) for k, v in {**base, **settings}.items()})
        log = (self.logs / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen([sys.executable, "-m", "fedbroker", verb], env=env, stdout=log,
                                                stderr=subprocess.STDOUT)

    def spawn_coordinator(self, name: str, *, lease_ttl_s: float = LEASE_TTL_S) -> None:
        (port,) = free_ports(1)
        self.addresses[name] = f"127.0.0.1:{port}"
        self._spawn(name, "coordinator", {
            "coordinator.listen": self.addresses[name], "coordinator.state_dir": str(self.tmp / "state"),
            "coordinator.database_url": self.database_url, "coordinator.lease_ttl_s": lease_ttl_s,
            "coordinator.heartbeat_timeout_s": 120})

    def start_workers(self) -> None:
        """The sites, in this process (each with its own broker connections): they reach a coordinator only over
        RabbitMQ, so which one leads is nothing to them; here they save two interpreters' start on a busy machine.
        Each holds its task of round 2 until `held.release` is set, so a fault lands mid-round by construction."""
        for index, worker_id in enumerate(self.worker_ids):
            bus = open_bus(self.amqp_url, namespace=self.namespace)
            agent = self.held(WorkerConfig(
                id=worker_id, partition=PartitionSection(num_clients=len(self.worker_ids), client_index=index),
                dp=DPPolicy(enabled=True, epsilon_budget=1000.0), ledger_path=str(self.ledger_path(worker_id)),
                device="cpu", heartbeat_s=1.0), bus)
            agent.start()
            bus.start()
            self.workers[worker_id] = agent

    def ledger_path(self, worker_id: str) -> Path:
        return self.tmp / f"{worker_id}-ledger.json"

    def client(self) -> FailoverClient:
        """The CLI's client over every coordinator, in the order they were started."""
        return FailoverClient(list(self.addresses.values()), timeout_s=120)  # a loaded machine's SubmitJob

    # ----- what the database holds -----

    def leader(self) -> str:
        """The name of the coordinator holding the lease ("" none, or a holder no process of ours is)."""
        try:
            with self.engine.connect() as conn:
                row = conn.execute(select(LEASES.c.holder).where(LEASES.c.name == "coordinator")).first()
        except ProgrammingError:  # no coordinator has made its tables yet
            return ""
        address = leader_address(row.holder) if row else ""
        return next((name for name, a in self.addresses.items() if a == address), "")

    def last_write(self, job_id: str) -> float:
        """The newest time the leader stamped on the job or a worker's heartbeat (0 before any)."""
        with self.engine.connect() as conn:
            job_row = conn.execute(select(t.jobs.c.updated).where(t.jobs.c.job_id == job_id)).scalar() or 0.0
            seen = conn.execute(select(func.max(t.workers.c.last_seen))).scalar() or 0.0
        return max(float(job_row), float(seen))

    def holding(self) -> bool:
        """Every site holds its task of round 2: the round is open (recorded before its tasks went out)."""
        return len(self.held.holding) == len(self.worker_ids)

    def job_ended(self, job_id: str) -> bool:
        with self.engine.connect() as conn:
            status = conn.execute(select(t.jobs.c.status).where(t.jobs.c.job_id == job_id)).scalar()
        return status in FINISHED

    def submit(self) -> str:
        with self.client() as c:
            return c.submit(json.dumps(JOB))

    # ----- the checks every case makes -----

    def check_books(self, job_id: str) -> dict[str, Any]:
        """Every round opened and closed once, each participant's ε recorded once and equal to its own ledger's."""
        store = StateStore.from_url(self.database_url)
        try:
            row = store.job(job_id)
            assert row is not None and row.status == "completed", f"job ended {row and row.status}: {row and row.error}"
            rounds = store.rounds(job_id)
            assert [r.round for r in rounds] == list(range(1, JOB["training"]["rounds"] + 1)), rounds
            assert all(r.status == "closed" for r in rounds), [r.status for r in rounds]
            assert all(r.aggregated == r.participants == len(self.worker_ids) for r in rounds), \
                f"an update lost or counted twice: {[(r.round, r.participants, r.aggregated) for r in rounds]}"
            versions = [r.model_version for r in rounds]
            assert versions == list(range(versions[0], versions[0] + len(rounds))), \
                f"a round closed twice (or a version was skipped): versions {versions}"
            participants = store.participants(job_id)
            keys = [(p.round, p.worker_id) for p in participants]
            assert len(keys) == len(set(keys)), "a participant recorded twice in one round"
            report: dict[str, Any] = {"rounds": len(rounds), "epsilon": {}}
            for worker_id in self.worker_ids:
                ledger = PrivacyLedger(str(self.ledger_path(worker_id)), worker_id=worker_id)
                spent = ledger.epsilon(job_id)
                mine = sorted((p.round, p.epsilon or 0.0) for p in participants if p.worker_id == worker_id)
                recorded = max((epsilon for _, epsilon in mine), default=0.0)
                assert spent > 0, f"{worker_id} spent no ε: DP was off"
                steps = [b - a for (_, a), (_, b) in itertools.pairwise(mine)]
                assert all(step > 0 for step in steps), f"{worker_id}: its ε did not grow each round: {mine}"
                assert abs(recorded - spent) <= 1e-9 * max(1.0, spent), \
                    f"{worker_id}: ε {recorded} recorded, {spent} on its own ledger (under- or over-recorded)"
                report["epsilon"][worker_id] = spent
            return report
        finally:
            store.close()

    def kill(self, name: str) -> None:
        process = self.processes[name]
        os.kill(process.pid, signal.SIGKILL)
        process.wait(30)

    def close(self) -> None:
        """Kill every process (the case is over: how they would stop is not what it tests)."""
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        for process in self.processes.values():
            process.wait(30)
        for agent in self.workers.values():
            agent.stop()
            agent.bus.close()
        self.server.stop(grace=0)
        self.engine.dispose()
        delete_topology(self.amqp_url, self.namespace, self.worker_ids)
