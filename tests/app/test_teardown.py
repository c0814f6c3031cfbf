"""`fedbroker teardown`: a deployment's queues and exchanges go, by the names the bus declares, and nothing
else; a deployment still running is left alone. On the session's PRIVATE RabbitMQ node only: the machine's
broker is never touched."""

from __future__ import annotations

import uuid

import pytest
import yaml

from fedbroker.app.cli import main
from fedbroker.bus import AmqpBus
from fedbroker.config import DPPolicy
from fedbroker.coordinator.store import StateStore
from tests.rabbitmq_node import PrivateRabbitMQ

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def names(broker: PrivateRabbitMQ, what: str) -> set[str]:
    return set(broker.ctl(f"list_{what}", "name", "-q", "--no-table-headers").split())


def deployment(url: str, namespace: str, workers: list[str]) -> None:
    """What a deployment leaves on the broker: its topology, worker queues and a task waiting in one."""
    with AmqpBus(url, namespace=namespace) as bus:
        for w in workers:
            bus.declare_worker(w)
        bus.publish_task(workers[0], b"a task nobody trained")


def objects(namespace: str, workers: list[str]) -> tuple[set[str], set[str]]:
    queues = {f"{namespace}.coordinator", f"{namespace}.dead", *(f"{namespace}.worker.{w}" for w in workers)}
    exchanges = {f"{namespace}.{e}" for e in ("tasks", "control", "events", "dlx")}
    return queues, exchanges


def test_teardown_removes_the_namespaces_queues_and_exchanges_and_nothing_else(private_rabbitmq, tmp_path, capsys):
    broker, run = private_rabbitmq, uuid.uuid4().hex[:8]
    gone, kept = f"td-{run}", f"td-keep-{run}"
    deployment(broker.url, gone, ["w1", "w2"])
    deployment(broker.url, kept, ["w1"])
    queues, exchanges = objects(gone, ["w1", "w2"])
    assert queues <= names(broker, "queues") and exchanges <= names(broker, "exchanges")
    # w2 is known to the (stopped) coordinator's state only; w1 is named on the command line
    state = tmp_path / "state"
    store = StateStore.in_directory(str(state))
    store.upsert_worker(worker_id="w2", categories=["digits"], histogram=[1], dp=DPPolicy(enabled=False),
                        epsilon_spent=0.0, device="cpu", num_samples=1)
    store.close()

    code = main(["teardown", "--broker", broker.url, "--namespace", gone, "--worker", "w1", "--state-dir", str(state)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"removed queue {gone}.worker.w1 (1 message(s) dropped)" in out
    assert f"namespace {gone} on amqp://guest:***@" in out and "8 object(s) removed" in out  # 4 queues, 4 exchanges
    assert not (queues | exchanges) & (names(broker, "queues") | names(broker, "exchanges"))
    kept_queues, kept_exchanges = objects(kept, ["w1"])
    assert kept_queues <= names(broker, "queues") and kept_exchanges <= names(broker, "exchanges")

    # again: nothing of it is there, and saying so is no error
    assert main(["teardown", "--broker", broker.url, "--namespace", gone]) == 0
    assert "0 object(s) removed (nothing of it was there)" in capsys.readouterr().out


def test_a_running_deployment_is_left_alone_unless_forced(private_rabbitmq, capsys):
    broker, namespace = private_rabbitmq, f"td-live-{uuid.uuid4().hex[:8]}"
    worker = AmqpBus(broker.url, namespace=namespace)
    try:
        worker.consume_tasks("w1", lambda delivery: None)
        worker.start()
        assert worker.wait_ready(30)
        assert main(["teardown", "--broker", broker.url, "--namespace", namespace, "--worker", "w1"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"fedbroker teardown: broker: the deployment still runs: {namespace}.worker.w1 has 1 "
                              "consumer(s); stop its coordinator and workers first (or --force); nothing was removed")
        queues, exchanges = objects(namespace, ["w1"])
        assert queues <= names(broker, "queues") and exchanges <= names(broker, "exchanges")
    finally:
        worker.close()
    assert main(["teardown", "--broker", broker.url, "--namespace", namespace, "--worker", "w1"]) == 0
    assert not objects(namespace, ["w1"])[0] & names(broker, "queues")


def test_the_namespace_must_be_named_and_a_bad_name_is_refused_before_connecting(tmp_path, capsys):
    assert main(["teardown", "--broker", "amqp://guest:guest@127.0.0.1:1/"]) == 2
    assert "fedbroker teardown: config: --namespace: name the deployment's namespace" in capsys.readouterr().err
    assert main(["teardown", "--broker", "amqp://guest:guest@127.0.0.1:1/", "--namespace", "a b"]) == 2
    assert "fedbroker teardown: config: --namespace" in capsys.readouterr().err
    assert main(["teardown", "--broker", "amqp://guest:guest@127.0.0.1:1/", "--namespace", "x",
                 "--state-dir", str(tmp_path / "nope")]) == 2
    assert "--state-dir: " in capsys.readouterr().err and not (tmp_path / "nope").exists()


def test_teardown_with_a_config_removes_the_worker_queues_its_coordinator_knows(private_rabbitmq, tmp_path, capsys):
    """`--config` alone (the deployment's own file, as OPERATING.md says to run it): the queues of the workers its
    coordinator's state_dir registered, and of those its worker_broker_users bind, go too (they were left)."""
    broker, namespace = private_rabbitmq, f"td-cfg-{uuid.uuid4().hex[:8]}"
    deployment(broker.url, namespace, ["w1", "w2"])
    state = tmp_path / "state"
    store = StateStore.in_directory(str(state))
    store.upsert_worker(worker_id="w1", categories=["digits"], histogram=[1], dp=DPPolicy(enabled=False),
                        epsilon_spent=0.0, device="cpu", num_samples=1)
    store.close()
    config = tmp_path / "coordinator.yaml"
    config.write_text(yaml.safe_dump({"broker": {"url": broker.url, "namespace": namespace},
                                      "coordinator": {"state_dir": str(state),
                                                      "worker_broker_users": {"proj-w2": ["w2"]}}}))
    assert main(["teardown", "--config", str(config)]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert f"removed queue {namespace}.worker.w1 (1 message(s) dropped)" in out
    assert f"removed queue {namespace}.worker.w2" in out
    queues, exchanges = objects(namespace, ["w1", "w2"])
    assert not (queues | exchanges) & (names(broker, "queues") | names(broker, "exchanges"))
