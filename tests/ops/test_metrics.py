"""The services move their metrics: rejections by reason, bytes, gRPC latency by method and code, aggregation
time by algorithm, per-worker ε; and metrics survive several workers in one process."""

from __future__ import annotations

import socket
import time
import urllib.request
import uuid
from typing import Any

import numpy as np
import pytest
from prometheus_client import REGISTRY

from fedbroker.aggregators import metrics as agg_metrics
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.algorithms.catalogue import aggregation_settings
from fedbroker.bus import open_bus
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig, load_config
from fedbroker.errors import ConfigError
from fedbroker.job.spec import AggregationConfig, parse_model
from fedbroker.metrics import start_ephemeral_exporter, start_exporter
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.plumbing import RemoteError
from fedbroker.worker.agent import WorkerAgent
from tests.installed import install

SPEC = parse_model({"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]})
AGG = {"alignment": "none", "weighting": "fedavg", "selection": "all"}


def value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def weights(v: float, out: int = 2) -> dict[str, np.ndarray]:
    return {"0.weight": np.full((out, 4), v, np.float32), "0.bias": np.full(out, v, np.float32)}


@pytest.fixture
def aggregator():
    server, port = serve(RoundBook())
    client = AggregatorClient(f"127.0.0.1:{port}", timeout_s=5)
    yield client
    client.close()
    server.stop(grace=0)


@pytest.mark.integration
def test_uploads_are_counted_accepted_once_and_rejected_by_reason(aggregator):
    job = f"m-{uuid.uuid4().hex[:6]}"
    aggregator.put_global(job, 1, SPEC.to_json(), weights(0.0))
    install(aggregator, job, AGG)
    aggregator.open_round(job, 1, ["w1", "w2"], deadline_unix=4e9, seed=0)
    before = {name: value(name) for name in ("fedbroker_aggregator_uploads_accepted_total",
                                               "fedbroker_aggregator_uploads_duplicate_total")}
    shape = value("fedbroker_aggregator_uploads_rejected_total", reason="wrong_shape")
    stranger = value("fedbroker_aggregator_uploads_rejected_total", reason="unknown_worker")
    received = value("fedbroker_aggregator_received_bytes_total", rpc="UploadWhole")  # 40 bytes: one message

    aggregator.upload(job_id=job, round=1, worker_id="w1", num_samples=5, tensors=weights(1.0))
    aggregator.upload(job_id=job, round=1, worker_id="w1", num_samples=5, tensors=weights(1.0))  # a retry
    with pytest.raises(RemoteError, match="shape"):
        aggregator.upload(job_id=job, round=1, worker_id="w2", num_samples=5, tensors=weights(1.0, out=3))
    with pytest.raises(RemoteError):
        aggregator.upload(job_id=job, round=1, worker_id="mallory", num_samples=5, tensors=weights(1.0))

    assert value("fedbroker_aggregator_uploads_accepted_total") == before["fedbroker_aggregator_uploads_accepted_total"] + 1
    assert value("fedbroker_aggregator_uploads_duplicate_total") == before["fedbroker_aggregator_uploads_duplicate_total"] + 1
    assert value("fedbroker_aggregator_uploads_rejected_total", reason="wrong_shape") == shape + 1
    assert value("fedbroker_aggregator_uploads_rejected_total", reason="unknown_worker") == stranger + 1
    assert value("fedbroker_aggregator_received_bytes_total", rpc="UploadWhole") == received + 40


@pytest.mark.integration
def test_a_late_upload_counts_as_late_and_as_rejected(aggregator):
    job = f"m-{uuid.uuid4().hex[:6]}"
    aggregator.put_global(job, 1, SPEC.to_json(), weights(0.0))
    install(aggregator, job, AGG)
    aggregator.open_round(job, 1, ["w1"], deadline_unix=1.0, seed=0)  # long past
    late = value("fedbroker_aggregator_late_uploads_total")
    with pytest.raises(RemoteError):
        aggregator.upload(job_id=job, round=1, worker_id="w1", num_samples=5, tensors=weights(1.0))
    assert value("fedbroker_aggregator_late_uploads_total") == late + 1


@pytest.mark.integration
def test_close_and_grpc_calls_are_timed_by_algorithm_method_and_code(aggregator):
    job = f"m-{uuid.uuid4().hex[:6]}"
    labels = {"alignment": "none", "weighting": "fedavg", "selection": "all"}
    closes = value("fedbroker_aggregator_aggregation_seconds_count", **labels)
    service = "fedbroker.v1.Aggregation"
    ok = value("fedbroker_grpc_server_handling_seconds_count", grpc_service=service, grpc_method="CloseRound",
               grpc_code="OK")
    missing = value("fedbroker_grpc_server_handling_seconds_count", grpc_service=service,
                    grpc_method="DownloadGlobalModel", grpc_code="NOT_FOUND")
    sent = value("fedbroker_aggregator_sent_bytes_total", rpc="DownloadGlobalModel")

    aggregator.put_global(job, 1, SPEC.to_json(), weights(0.0))
    install(aggregator, job, AGG)
    aggregator.open_round(job, 1, ["w1"], deadline_unix=4e9, seed=0)
    aggregator.upload(job_id=job, round=1, worker_id="w1", num_samples=5, tensors=weights(1.0))
    aggregator.close_round(job, 1)
    aggregator.download(job, 2)
    with pytest.raises(RemoteError):
        aggregator.download("no-such-job", 1)

    assert value("fedbroker_aggregator_aggregation_seconds_count", **labels) == closes + 1
    assert value("fedbroker_grpc_server_handling_seconds_count", grpc_service=service, grpc_method="CloseRound",
                 grpc_code="OK") == ok + 1
    assert value("fedbroker_grpc_server_handling_seconds_count", grpc_service=service,
                 grpc_method="DownloadGlobalModel", grpc_code="NOT_FOUND") == missing + 1
    assert value("fedbroker_aggregator_sent_bytes_total", rpc="DownloadGlobalModel") == sent + 40


def test_close_stats_become_the_alignment_cost_and_the_selection_fitness():
    fallbacks = value("fedbroker_aggregator_selection_fallbacks_total", selection="ga")
    ga_calls = value("fedbroker_aggregator_selection_seconds_count", selection="ga")
    ga_seconds = value("fedbroker_aggregator_selection_seconds_sum", selection="ga")
    agg_metrics.record_close({"alignment": "feddna", "weighting": "dwfed", "selection": "ga"}, 0.2, 3,
                             {"alignment_total_matched_distance": 12.5, "selection_fitness": 0.75,
                              "selection_fallback": 1.0, "selection_seconds": 1.5})
    assert value("fedbroker_aggregator_selection_seconds_count", selection="ga") == ga_calls + 1
    assert value("fedbroker_aggregator_selection_seconds_sum", selection="ga") == pytest.approx(ga_seconds + 1.5)
    assert value("fedbroker_aggregator_alignment_matched_distance", alignment="feddna") == 12.5
    assert value("fedbroker_aggregator_selection_fitness", selection="ga") == 0.75
    assert value("fedbroker_aggregator_selection_fallbacks_total", selection="ga") == fallbacks + 1
    assert value("fedbroker_aggregator_aggregation_seconds_count", alignment="feddna", weighting="dwfed",
                 selection="ga") >= 1


def test_algorithm_labels_default_like_the_job_spec():
    assert agg_metrics.algorithm_labels(aggregation_settings(AggregationConfig())) == {
        "alignment": "none", "weighting": "fedavg", "selection": "all", "robust": "none"}
    assert agg_metrics.algorithm_labels(aggregation_settings(AggregationConfig(alignment="pfnm")))["alignment"] == "pfnm"


def test_two_worker_agents_in_one_process_export_their_own_series(tmp_path):
    """The in-process demo runs several agents in one process: no duplicate registration, one series each."""
    namespace = f"metrics-{uuid.uuid4().hex[:8]}"
    agents = []
    for i, budget in enumerate((8.0, 4.0)):
        bus = open_bus(None, namespace=namespace)
        agent = WorkerAgent(WorkerConfig(
            id=f"m{i}", partition=PartitionSection(num_clients=2, client_index=i),
            dp=DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=budget),
            ledger_path=str(tmp_path / f"m{i}.json"), device="cpu", heartbeat_s=60), bus)
        agent.start()
        bus.start()
        agents.append(agent)
    try:
        assert value("fedbroker_worker_epsilon_budget", worker_id="m0") == 8.0
        assert value("fedbroker_worker_epsilon_budget_remaining", worker_id="m1") == 4.0
        assert value("fedbroker_worker_epsilon_spent", worker_id="m1") == 0.0
        assert value("fedbroker_broker_connected", client="m0") == value("fedbroker_broker_connected", client="m1") == 1
    finally:
        for agent in agents:
            agent.stop()
            agent.bus.close()
    assert REGISTRY.get_sample_value("fedbroker_broker_connected", {"client": "m0"}) is None  # forgotten on stop


def test_a_malformed_task_is_counted_and_dead_lettered(tmp_path):
    namespace = f"metrics-{uuid.uuid4().hex[:8]}"
    bus = open_bus(None, namespace=namespace)
    agent = WorkerAgent(WorkerConfig(id="mal", ledger_path=str(tmp_path / "l.json"), device="cpu",
                                     heartbeat_s=60, dp=DPPolicy(enabled=False)), bus)
    agent.start()
    bus.start()
    try:
        before = value("fedbroker_worker_tasks_total", worker_id="mal", outcome="malformed")
        received = value("fedbroker_worker_tasks_received_total", worker_id="mal")
        bus.publish_task("mal", b"not a protobuf envelope")
        for _ in range(100):
            if value("fedbroker_worker_tasks_total", worker_id="mal", outcome="malformed") > before:
                break
            time.sleep(0.05)
        assert value("fedbroker_worker_tasks_total", worker_id="mal", outcome="malformed") == before + 1
        assert value("fedbroker_worker_tasks_received_total", worker_id="mal") == received + 1
    finally:
        agent.stop()
        bus.close()


def test_metrics_ports_are_config_fields_with_the_exporter_off_by_default():
    config = load_config(environ={})
    assert config.aggregator.metrics_port == config.coordinator.metrics_port == config.worker.metrics_port == 0
    config = load_config(environ={"FEDBROKER__WORKER__METRICS_PORT": "9400",
                                  "FEDBROKER__COORDINATOR__METRICS_PORT": "9401"})
    assert config.worker.metrics_port == 9400 and config.coordinator.metrics_port == 9401
    with pytest.raises(ConfigError, match=r"aggregator\.metrics_port"):
        load_config(environ={"FEDBROKER__AGGREGATOR__METRICS_PORT": "lots"})


@pytest.mark.integration
def test_the_exporter_serves_the_registry_once_per_port():
    assert start_exporter(0) == 0  # disabled
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert start_exporter(port, addr="127.0.0.1") == port
    assert start_exporter(port, addr="127.0.0.1") == port  # the demo's coordinator and workers share it
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "fedbroker_aggregator_uploads_rejected_total" in body and "_created" not in body
    ephemeral, stop = start_ephemeral_exporter()
    try:
        assert "fedbroker_broker_connected" in urllib.request.urlopen(
            f"http://127.0.0.1:{ephemeral}/metrics", timeout=5).read().decode()
    finally:
        stop()


def test_launch_refuses_an_impossible_metrics_port():
    from fedbroker.app.launch import start_aggregator

    config = load_config(environ={"FEDBROKER__AGGREGATOR__METRICS_PORT": "70000"})
    with pytest.raises(ConfigError, match=r"aggregator\.metrics_port"):
        start_aggregator(config)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_every_process_binds_its_exporter_to_its_metrics_addr():
    """The port bound 0.0.0.0 whatever the config said: a host's /metrics was open to the network."""
    from fedbroker import metrics as kernel_metrics
    from fedbroker.app.launch import start_aggregator

    assert load_config(environ={}).worker.metrics_addr == "0.0.0.0"   # the container default is unchanged
    port = _free_port()
    config = load_config(environ={"FEDBROKER__AGGREGATOR__METRICS_PORT": str(port),
                                  "FEDBROKER__AGGREGATOR__METRICS_ADDR": "127.0.0.1",
                                  "FEDBROKER__AGGREGATOR__LISTEN": "127.0.0.1:0"})
    server, _ = start_aggregator(config)
    try:
        exporter = kernel_metrics._exporters[("127.0.0.1", port)]
        assert exporter.server_address[0] == "127.0.0.1"
        assert ("0.0.0.0", port) not in kernel_metrics._exporters
        assert "fedbroker_" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    finally:
        server.stop(grace=0)
    with pytest.raises(ConfigError, match=r"metrics_addr: cannot serve /metrics on 192\.0\.2\.1"):
        start_exporter(_free_port(), addr="192.0.2.1")   # an address not on this machine (TEST-NET-1)


# ----- series that exist before their first increase (issue 12, item 13) -----------------------------------


def sample(name: str, **labels: str) -> float | None:
    """The sample's value, or None when the series does not exist (unlike `value`, which reads 0)."""
    return REGISTRY.get_sample_value(name, labels)


def collected(name: str) -> dict[tuple[str, ...], float]:
    """The samples of one family the bound coordinator's collector exports, keyed by label values."""
    from fedbroker.coordinator.metrics import REGISTRY_COLLECTOR

    return {tuple(s.labels.values()): s.value for family in REGISTRY_COLLECTOR.collect() for s in family.samples
            if s.name == name}


@pytest.fixture
def idle_coordinator(tmp_path):
    """A coordinator on the in-process bus whose jobs wait for workers (none come), so no round ever runs."""
    from fedbroker.coordinator.scheduler import Coordinator
    from fedbroker.coordinator.store import StateStore

    bus = open_bus(None, namespace=f"metrics-{uuid.uuid4().hex[:8]}")
    store = StateStore(str(tmp_path / "coordinator.sqlite"))
    coordinator = Coordinator(bus=bus, store=store, aggregator=AggregatorClient("127.0.0.1:9", timeout_s=1),
                              aggregator_target="127.0.0.1:9", checkpoint_dir=str(tmp_path / "checkpoints"),
                              poll_interval_s=0.05, heartbeat_timeout_s=60)
    coordinator.start()
    bus.start()
    yield coordinator
    coordinator.stop()
    bus.close()
    store.close()


def waiting_job(category: str) -> Any:
    from fedbroker.job.spec import parse_job

    return parse_job({"name": "waits", "category": category,
                      "model": {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]},
                      "schedule": {"min_workers": 1, "wait_for_workers_s": 600}})


def test_a_jobs_round_counters_exist_at_zero_from_when_it_starts(idle_coordinator):
    """`increase()` sees a counter's first increment only if the series was scraped at 0 before it: a job's
    counters exist from its start, before its first round is counted."""
    job_id = idle_coordinator.submit(waiting_job("digits"))
    for name in ("fedbroker_coordinator_rounds_failed_total", "fedbroker_coordinator_rounds_started_total",
                 "fedbroker_coordinator_rounds_completed_total", "fedbroker_coordinator_stragglers_total"):
        deadline = time.time() + 30
        while sample(name, job_id=job_id) is None and time.time() < deadline:
            time.sleep(0.05)
        assert sample(name, job_id=job_id) == 0.0, name
    for status in ("refused", "failed", "uploaded"):
        assert sample("fedbroker_coordinator_task_outcomes_total", status=status) is not None, status
    assert sample("fedbroker_coordinator_control_messages_rejected_total", reason="malformed_message") is not None
    assert sample("fedbroker_coordinator_jobs_rejected_total", reason="invalid_config") is not None


def test_a_workers_counters_exist_at_zero_from_when_it_starts(tmp_path):
    bus = open_bus(None, namespace=f"metrics-{uuid.uuid4().hex[:8]}")
    worker_id = f"z{uuid.uuid4().hex[:6]}"
    agent = WorkerAgent(WorkerConfig(id=worker_id, ledger_path=str(tmp_path / "l.json"), device="cpu",
                                     heartbeat_s=60, dp=DPPolicy(enabled=False)), bus)
    agent.start()
    bus.start()
    try:
        for outcome in ("uploaded", "already_uploaded", "refused", "failed", "requeued", "malformed"):
            assert sample("fedbroker_worker_tasks_total", worker_id=worker_id, outcome=outcome) == 0.0, outcome
        for name in ("fedbroker_worker_tasks_received_total", "fedbroker_worker_tasks_redelivered_total",
                     "fedbroker_worker_tasks_acked_total", "fedbroker_worker_trained_samples_total",
                     "fedbroker_worker_sent_bytes_total", "fedbroker_worker_received_bytes_total",
                     "fedbroker_worker_training_seconds_count"):
            assert sample(name, worker_id=worker_id) == 0.0, name
    finally:
        agent.stop()
        bus.close()


def test_a_worker_exports_the_projected_cost_of_its_next_round_and_refuses_what_it_cannot_afford(tmp_path):
    """The alert "cannot afford the next round" compares this gauge with the budget remaining."""
    from fedbroker.errors import BudgetExceeded
    from fedbroker.job.spec import TrainingConfig

    worker_id = f"c{uuid.uuid4().hex[:6]}"
    agent = WorkerAgent(WorkerConfig(
        id=worker_id, partition=PartitionSection(num_clients=2, client_index=0),
        dp=DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=1000.0),
        ledger_path=str(tmp_path / "l.json"), device="cpu", heartbeat_s=60), open_bus(None, namespace="unused"))
    config = TrainingConfig(local_epochs=1, batch_size=32)
    assert sample("fedbroker_worker_epsilon_next_round_cost", worker_id=worker_id) is None  # no round projected yet
    agent.budget.check_budget("job-a", config)
    cost = sample("fedbroker_worker_epsilon_next_round_cost", worker_id=worker_id)
    assert cost is not None and 0 < cost < 1000.0

    agent.budget.dp = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=cost * 0.5)
    agent.budget.export()
    with pytest.raises(BudgetExceeded):
        agent.budget.check_budget("job-a", config)
    assert sample("fedbroker_worker_epsilon_next_round_cost", worker_id=worker_id) == pytest.approx(cost)
    assert cost > sample("fedbroker_worker_epsilon_budget_remaining", worker_id=worker_id)  # what the alert compares


def test_the_coordinator_exports_active_workers_and_waiting_jobs_per_category(idle_coordinator):
    """A job waiting on a category that no worker serves shows as 0 active workers of that category, even
    while workers of another category are active."""
    store = idle_coordinator.store
    store.upsert_worker(worker_id="d1", categories=["digits"], histogram=[1, 2], dp=DPPolicy(enabled=False),
                        epsilon_spent=0.0, device="cpu", num_samples=3)
    idle_coordinator.submit(waiting_job("xray"))
    idle_coordinator.submit(waiting_job("xray"))
    deadline = time.time() + 30
    while collected("fedbroker_coordinator_category_jobs").get(("xray", "pending")) != 2 and time.time() < deadline:
        time.sleep(0.05)
    assert collected("fedbroker_coordinator_category_workers_active") == {("digits",): 1.0, ("xray",): 0.0}
    jobs = collected("fedbroker_coordinator_category_jobs")
    assert jobs[("xray", "pending")] == 2.0 and jobs[("xray", "running")] == 0.0
    assert jobs[("digits", "pending")] == jobs[("digits", "running")] == 0.0
    assert collected("fedbroker_coordinator_workers_active") == {(): 1.0}


def test_the_coordinator_exports_the_dead_letter_queues_depth(idle_coordinator):
    assert collected("fedbroker_coordinator_dead_letter_messages") == {(): 0.0}
    idle_coordinator.bus.publish_control(b"not an envelope")  # the coordinator dead-letters it
    deadline = time.time() + 30
    while collected("fedbroker_coordinator_dead_letter_messages") != {(): 1.0} and time.time() < deadline:
        time.sleep(0.05)
    assert collected("fedbroker_coordinator_dead_letter_messages") == {(): 1.0}


@pytest.mark.integration
def test_the_amqp_bus_reads_the_dead_letter_queues_depth_without_changing_it(rabbitmq_url):
    from fedbroker.bus import delete_topology

    namespace = f"metrics-{uuid.uuid4().hex[:8]}"
    bus = open_bus(rabbitmq_url, namespace=namespace)
    try:
        bus.consume_control(lambda delivery: delivery.nack(requeue=False))
        bus.start()
        assert bus.dead_letter_count() == 0
        bus.publish_control(b"poison")
        bus.publish_control(b"poison")
        deadline = time.time() + 30
        while bus.dead_letter_count() < 2 and time.time() < deadline:
            time.sleep(0.1)
        assert bus.dead_letter_count() == 2
        assert bus.dead_letter_count() == 2  # reading it consumed nothing
    finally:
        bus.close()
        delete_topology(rabbitmq_url, namespace, [])
