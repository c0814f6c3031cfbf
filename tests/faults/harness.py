"""A federation to break: the aggregation service (with a spool), the coordinator and workers in this process
(each with its own pika connections to a real RabbitMQ), parts that can be stopped and restarted, and
helpers that disturb a private broker node and always put it back.

A federation runs as `guest`, or as a provisioned one does (`users=`, a private node): every participant logs in
as its own broker user with exactly the permissions `fedbroker provision` gives it, each worker trains only
the coordinator's user's tasks (`worker.coordinator_broker_user`), and the coordinator takes a worker's control
messages only from that worker's own user (`coordinator.worker_broker_users`, followed as the kit's coordinator
follows its config: a participant provisioned later is bound from then on)."""

from __future__ import annotations

import copy
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

import fedbroker.worker.agent
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.bus import Topology, delete_topology, open_bus
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.job.spec import parse_job
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.worker.agent import WorkerAgent
from tests.rabbitmq_node import PrivateRabbitMQ

# Quick reconnects so an outage costs the test seconds, not the production backoff's half minute.
BUS_OPTIONS: dict[str, Any] = {"reconnect_initial_s": 0.2, "reconnect_max_s": 2.0, "publish_timeout_s": 60.0}

# A round deadline and a wait for workers that no test run reaches, however loaded the machine: a test's rounds
# end on their uploads and the test on the event it waits for, never on the clock (a test about deadlines sets
# its own). Below the broker's default consumer_timeout less the coordinator's margin (1740 s), so a coordinator
# told that timeout still accepts the job.
NEVER_S = 1200.0

JOB: dict[str, Any] = {
    "name": "faults",
    "category": "digits",
    "seed": 7,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 32}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 32, "out_features": 10}]},
    "training": {"rounds": 3, "local_epochs": 1, "batch_size": 32, "lr": 0.2},
    "schedule": {"min_workers": 2, "wait_for_workers_s": NEVER_S, "round_timeout_s": NEVER_S},
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
        from fedbroker.bus import envelope

        try:
            round_number = envelope.decode(delivery.body, expect=("round_task",)).round_task.round
        except envelope.MalformedMessage:
            round_number = -1
        if round_number == self.held_round and not self.release.is_set():
            self.holding.add(self.config.id)
            self.release.wait(120)
        super().on_task(delivery)


# ----- the federation ------------------------------------------------------------------------------

# Every bus fault that matters most runs twice: as guest, and as a provisioned kit runs (one broker user per
# participant, with provisioning's permissions; on the session's private node, since the machine's broker gets no
# users of the tests'). The issue: the guest-only runs never saw that a participant may not write amq.default.
BUS_USERS = ("guest", "provisioned")



class Federation:
    def __init__(self, url: str, tmp: Path, *, users: PrivateRabbitMQ | None = None, spool: bool = True,
                 start_coordinator: bool = True, **coordinator_options: Any) -> None:
        self.url = url  # the administrator's (guest): the test's own look at the broker, never a participant's
        self.tmp = tmp
        self.namespace = f"fbfault-{uuid.uuid4().hex[:8]}"
        self.users = users  # the node that holds each participant's own broker user; None: everyone is guest
        self.urls: dict[str, str] = {}
        self.broker_users: dict[str, list[str]] = {}  # provisioned: each site's user → [its worker id], as a kit's
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

    @property
    def mode(self) -> str:
        return "guest" if self.users is None else "provisioned"

    def url_for(self, who: str) -> str:
        """The URL participant `who` logs in with: its own broker user (provisioned on first use), or guest's."""
        if self.users is None:
            return self.url
        if who not in self.urls:
            self.urls.update(self.users.provision(namespace=self.namespace, participants=[who]))
            if who != "coordinator":   # a new mapping, never changed in place: the coordinator sees the new one
                self.broker_users = {**self.broker_users, f"{self.namespace}-{who}": [who]}
        return self.urls[who]

    def bus_for(self, who: str = "coordinator", **options: Any) -> Any:
        return open_bus(self.url_for(who), namespace=self.namespace, **{**BUS_OPTIONS, **options})

    def start_coordinator(self, **options: Any) -> Coordinator:
        """The coordinator; provisioned, bound to the sites' broker users as a kit's coordinator.yaml binds them
        (`worker_broker_users`, which it follows) unless the test gives its own map."""
        if self.users is not None and "worker_broker_users" not in options:
            options.setdefault("follow_broker_users", lambda: self.broker_users)
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
                            heartbeat_s=0.5, coordinator_broker_user=self.coordinator_user)

    @property
    def coordinator_user(self) -> str:
        """The broker user whose tasks a worker trains ("" as guest: anyone's)."""
        return "" if self.users is None else f"{self.namespace}-coordinator"

    def add_worker(self, worker_id: str, *, index: int, count: int, dp: DPPolicy | None = None,
                   agent_class: type[WorkerAgent] = WorkerAgent, **bus_options: Any) -> WorkerAgent:
        bus = self.bus_for(worker_id, client_name=f"{self.namespace}.{worker_id}", **bus_options)
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
        except Exception:  # a broker test that failed may leave its node unreachable
            pass


# ----- the broker ----------------------------------------------------------------------------------
# Only ever a private node (tests/rabbitmq_node.py): the machine's broker is never stopped or reconfigured.


def restore_broker(node: PrivateRabbitMQ, timeout: float = 120.0) -> None:
    """Start the node's RabbitMQ application if a test left it stopped; wait until it answers."""
    if node.answers():
        return
    node.ctl("start_app", timeout=timeout)
    wait_for(node.answers, timeout, "RabbitMQ to answer again", interval=0.5)


def broker_env(node: PrivateRabbitMQ, key: str) -> str:
    """A value of the rabbit application's environment as Erlang prints it, e.g. '{ok,1800000}'."""
    return node.ctl("eval", f"application:get_env(rabbit, {key}).")


def changed_broker_env(node: PrivateRabbitMQ, settings: dict[str, int]) -> Iterator[None]:
    """Set rabbit application variables for the duration of a test; always put the previous values back (the
    session's later tests share the node). One rabbitmqctl call each way: each costs seconds on a loaded machine."""
    new = ", ".join(f"{{{key}, {int(value)}}}" for key, value in settings.items())
    previous = node.ctl("eval", f"[begin Old = application:get_env(rabbit, K), application:set_env(rabbit, K, V), "
                                f"{{K, Old}} end || {{K, V}} <- [{new}]].")
    try:
        yield
    finally:  # `previous` prints as an Erlang list of {Key, {ok, Value} | undefined}
        node.ctl("eval", f"[case Old of undefined -> application:unset_env(rabbit, K); {{ok, V}} -> "
                         f"application:set_env(rabbit, K, V) end || {{K, Old}} <- {previous}].")


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


class HoldsNth(WorkerAgent):
    """Holds the n-th task it receives (unacked, untrained) until `release` is set; `holding` maps its worker
    to that task's number. Which number a worker's task gets depends on the order in which the coordinator
    hears the workers' heartbeats (one connection each: no order between them), so nothing assumes it.
    `HoldsNth.nth(n)` makes a subclass with its own event and dict, one per worker and test."""

    n = 1
    release = threading.Event()
    holding: ClassVar[dict[str, int]] = {}  # replaced per subclass by `nth`
    received = 0

    @classmethod
    def nth(cls, n: int) -> type[HoldsNth]:
        return type(f"Holds{n}", (cls,), {"n": n, "release": threading.Event(), "holding": {}, "received": 0})

    def on_task(self, delivery: Any) -> None:
        from fedbroker.bus import envelope

        cls = type(self)
        try:  # round tasks only: an evaluation task (federated evaluation) is not one of the tasks counted
            task = envelope.decode(delivery.body, expect=("round_task",)).round_task.round
        except envelope.MalformedMessage:
            super().on_task(delivery)
            return
        cls.received += 1
        if cls.received == self.n and not self.release.is_set():
            self.holding[self.config.id] = task
            self.release.wait(120)
        super().on_task(delivery)
