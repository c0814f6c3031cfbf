"""A federation to break: the aggregation service (with a spool), the coordinator and workers in this process
(each with its own pika connections to the real RabbitMQ), parts that can be stopped and restarted, and
helpers that disturb the broker and always put it back."""

from __future__ import annotations

import copy
import os
import shlex
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

import fedbroker.worker.agent
from fedbroker.aggregation_client import AggregatorClient
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.bus import Topology, delete_topology, open_bus
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.spec import parse_job
from fedbroker.worker.agent import WorkerAgent

# Quick reconnects so an outage costs the test seconds, not the production backoff's half minute.
BUS_OPTIONS: dict[str, Any] = {"reconnect_initial_s": 0.2, "reconnect_max_s": 2.0, "publish_timeout_s": 60.0}

JOB: dict[str, Any] = {
    "name": "faults",
    "category": "digits",
    "seed": 7,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 32}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 32, "out_features": 10}]},
    "training": {"rounds": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.2},
    "schedule": {"min_workers": 2, "wait_for_workers_s": 30, "round_timeout_s": 60},
}


def job(**sections: dict[str, Any]) -> dict[str, Any]:
    """JOB with some fields of its sections replaced, e.g. job(schedule={"min_clients": 2})."""
    out = copy.deepcopy(JOB)
    for name, values in sections.items():
        if isinstance(values, dict) and isinstance(out.get(name), dict):
            out[name].update(values)
        else:
            out[name] = values
    return out


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    value = predicate()
    assert value, f"timed out after {timeout:g}s waiting for {what}"
    return value


# ----- slowing a worker down, counting its trainings -----------------------------------------------


class Training:
    """Wraps fedbroker.worker.agent.train_local: counts trainings per worker and slows a worker's steps on demand.

    Agents run their tasks on the bus's handler thread `bus-handler-tasks.<worker id>`, which is how a
    training is attributed to its worker.
    """

    def __init__(self) -> None:
        self.real = fedbroker.worker.agent.train_local
        self.step_delay: dict[str, float] = {}
        self.fail: dict[str, BaseException] = {}
        self.count: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self, *args: Any, progress: Callable[[int, int], None] | None = None, **kwargs: Any) -> Any:
        name = threading.current_thread().name
        worker_id = name.split("bus-handler-tasks.", 1)[1] if "bus-handler-tasks." in name else "?"
        with self._lock:
            self.count[worker_id] = self.count.get(worker_id, 0) + 1
        if worker_id in self.fail:
            raise self.fail[worker_id]
        delay = self.step_delay.get(worker_id, 0.0)

        def slow(step: int, total: int) -> None:
            if delay:
                time.sleep(delay)
            if progress is not None:
                progress(step, total)

        return self.real(*args, progress=slow, **kwargs)


class HoldsRound(WorkerAgent):
    """Holds its task of round `held_round` (delivery unacked, nothing trained) until `release` is set, and
    adds its id to `holding` meanwhile: a fault injected while every worker holds falls mid-job by
    construction, not by timing. A redelivered copy after the release runs at once. `HoldsRound.at(n)` makes
    a subclass with its own event and set, one per test."""

    held_round = 0
    release = threading.Event()
    holding: ClassVar[set[str]] = set()

    @classmethod
    def at(cls, round_number: int) -> type[HoldsRound]:
        attributes = {"held_round": round_number, "release": threading.Event(), "holding": set()}
        return type(f"HoldsRound{round_number}", (cls,), attributes)

    def on_task(self, delivery: Any) -> None:
        from fedbroker import envelope

        try:
            round_number = envelope.decode(delivery.body, expect=("round_task",)).round_task.round
        except envelope.MalformedMessage:
            round_number = -1
        if round_number == self.held_round and not self.release.is_set():
            self.holding.add(self.config.id)
            self.release.wait(120)
        super().on_task(delivery)


# ----- the federation ------------------------------------------------------------------------------


class Federation:
    def __init__(self, url: str, tmp: Path, *, spool: bool = True, start_coordinator: bool = True,
                 **coordinator_options: Any) -> None:
        self.url = url
        self.tmp = tmp
        self.namespace = f"fbfault-{uuid.uuid4().hex[:8]}"
        self.spool_dir = tmp / "spool" if spool else None
        self.book = RoundBook(spool_dir=self.spool_dir)
        self.server, self.port = serve(self.book)
        self.target = f"127.0.0.1:{self.port}"
        self.store = StateStore(str(tmp / "coordinator.sqlite"))
        self.coordinator: Coordinator | None = None
        self.bus: Any = None
        self.workers: dict[str, WorkerAgent] = {}
        self.worker_ids: set[str] = set()
        self._closed = False
        if start_coordinator:
            self.start_coordinator(**coordinator_options)

    def bus_for(self, **options: Any) -> Any:
        return open_bus(self.url, namespace=self.namespace, **{**BUS_OPTIONS, **options})

    def start_coordinator(self, **options: Any) -> Coordinator:
        self.bus = self.bus_for()
        self.coordinator = Coordinator(
            bus=self.bus, store=self.store, aggregator=AggregatorClient(self.target), aggregator_target=self.target,
            checkpoint_dir=str(self.tmp / "checkpoints"), poll_interval_s=0.05, **options,
        )
        self.coordinator.start()
        self.bus.start()
        return self.coordinator

    def stop_coordinator(self) -> None:
        if self.coordinator is not None:
            self.coordinator.stop()
            self.bus.close()
            self.coordinator = None

    def worker_config(self, worker_id: str, *, index: int, count: int, dp: DPPolicy | None = None) -> WorkerConfig:
        return WorkerConfig(id=worker_id, partition=PartitionSection(num_clients=count, client_index=index),
                            dp=dp or DPPolicy(enabled=False), ledger_path=str(self.tmp / f"{worker_id}-ledger.json"), device="cpu",
                            heartbeat_s=0.5)

    def add_worker(self, worker_id: str, *, index: int, count: int, dp: DPPolicy | None = None,
                   agent_class: type[WorkerAgent] = WorkerAgent, **bus_options: Any) -> WorkerAgent:
        bus = self.bus_for(client_name=f"{self.namespace}.{worker_id}", **bus_options)
        agent = agent_class(self.worker_config(worker_id, index=index, count=count, dp=dp), bus)
        agent.retry_initial_s = 0.2
        agent.start()
        bus.start()
        self.workers[worker_id] = agent
        self.worker_ids.add(worker_id)
        return agent

    def stop_worker(self, worker_id: str) -> None:
        agent = self.workers.pop(worker_id)
        agent.stop()
        agent.bus.close()

    def stop_aggregator(self) -> None:
        """Stop serving, then stop the book: its handler threads may outlive the server (gRPC only cancels
        their calls), and from now on they can write nothing to the spool the next service opens."""
        self.server.stop(grace=0).wait()
        self.book.stop()

    def start_aggregator(self, *, spool: bool = True) -> None:
        """A new service on the same port: on the same spool (a restart), or with nothing (state lost)."""
        self.book = RoundBook(spool_dir=self.spool_dir if spool else None)
        self.server, port = serve(self.book, address=f"127.0.0.1:{self.port}")
        assert port == self.port

    def submit(self, job_dict: dict[str, Any]) -> str:
        assert self.coordinator is not None
        return self.coordinator.submit(parse_job(job_dict))

    def wait_job(self, job_id: str, timeout: float) -> Any:
        row = wait_for(lambda: (r := self.store.job(job_id)) is not None and r.status in ("completed", "failed")
                       and r, timeout, f"job {job_id} to finish", interval=0.1)
        assert row.status == "completed", row.error
        return row

    def checkpoint(self, job_id: str) -> dict[str, np.ndarray]:
        from fedbroker.coordinator.checkpoints import load_checkpoint

        return load_checkpoint(self.store.last_checkpoint(job_id).checkpoint)[0]

    def dead_letters(self) -> list[tuple[bytes, dict[str, Any]]]:
        import pika

        out: list[tuple[bytes, dict[str, Any]]] = []
        connection = pika.BlockingConnection(pika.URLParameters(self.url))
        try:
            channel = connection.channel()
            while True:
                method, props, body = channel.basic_get(Topology(self.namespace).dead_queue, auto_ack=True)
                if method is None:
                    return out
                out.append((body, dict(props.headers or {})))
        finally:
            connection.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.stop_coordinator()
        for worker_id in list(self.workers):
            self.stop_worker(worker_id)
        self.server.stop(grace=0).wait()
        self.book.stop()
        try:
            delete_topology(self.url, self.namespace, sorted(self.worker_ids))
        except Exception:  # a broker test that failed may leave it unreachable; the fixture restores it first
            pass


# ----- the broker ----------------------------------------------------------------------------------


def rabbitmqctl() -> list[str]:
    command = shlex.split(os.environ.get("FEDBROKER_RABBITMQCTL", "rabbitmqctl"))
    if not shutil.which(command[0]):
        message = f"{command[0]} not found; set FEDBROKER_RABBITMQCTL (e.g. 'docker exec rabbitmq rabbitmqctl')"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return command


def ctl(*args: str, timeout: float = 60.0) -> str:
    done = subprocess.run([*rabbitmqctl(), *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"rabbitmqctl {' '.join(args)}: {done.stdout} {done.stderr}"
    return done.stdout.strip()


def broker_answers(url: str) -> bool:
    import pika

    params = pika.URLParameters(url)
    params.connection_attempts = 1
    params.socket_timeout = 2
    try:
        pika.BlockingConnection(params).close()
        return True
    except Exception:
        return False


def restore_broker(url: str, timeout: float = 120.0) -> None:
    """Start the RabbitMQ application if it is stopped (and the node if it is down); wait until it answers."""
    if broker_answers(url):
        return

    def node_up() -> bool:
        return subprocess.run([*rabbitmqctl(), "status"], capture_output=True, timeout=60).returncode == 0

    if not node_up():
        subprocess.run(["rabbitmq-server", "-detached"], capture_output=True, timeout=30)
        wait_for(node_up, timeout, "the RabbitMQ node to start", interval=1.0)
    subprocess.run([*rabbitmqctl(), "start_app"], capture_output=True, timeout=timeout)
    wait_for(lambda: broker_answers(url), timeout, "RabbitMQ to answer again", interval=0.5)


def broker_env(key: str) -> str:
    """A value of the rabbit application's environment as Erlang prints it, e.g. '{ok,1800000}'."""
    return ctl("eval", f"application:get_env(rabbit, {key}).")


def set_broker_env(key: str, printed: str) -> None:
    """Set a rabbit application variable from a value printed by `broker_env` ('undefined' unsets it)."""
    if printed == "undefined":
        ctl("eval", f"application:unset_env(rabbit, {key}).")
    else:
        assert printed.startswith("{ok,") and printed.endswith("}"), printed
        ctl("eval", f"application:set_env(rabbit, {key}, {printed[4:-1]}).")


def changed_broker_env(settings: dict[str, int]) -> Iterator[None]:
    """Set rabbit application variables for the duration of a test; always put the previous values back."""
    previous = {key: broker_env(key) for key in settings}
    try:
        for key, value in settings.items():
            ctl("eval", f"application:set_env(rabbit, {key}, {int(value)}).")
        yield
    finally:
        for key, printed in previous.items():
            set_broker_env(key, printed)


def close_connection(connection_name: str) -> None:
    """Have the broker close a client's connection (found by its connection_name), as a network cut would."""
    listing = ctl("list_connections", "pid", "client_properties", "-q", "--no-table-headers")
    marker = f'{{"connection_name","{connection_name}"}}'
    pids = [line.split("\t")[0] for line in listing.splitlines() if marker in line]
    assert pids, f"no connection named {connection_name} in:\n{listing}"
    for pid in pids:
        ctl("close_connection", pid, "fedbroker fault test: connection cut")


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels or {}) or 0.0
