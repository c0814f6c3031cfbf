"""The services move their metrics: rejections by reason, bytes, gRPC latency by method and code, aggregation
time by algorithm, per-worker ε; and metrics survive several workers in one process."""

from __future__ import annotations

import socket
import time
import urllib.request
import uuid

import numpy as np
import pytest
from prometheus_client import REGISTRY

from fedbroker.aggregators import metrics as agg_metrics
from fedbroker.aggregators.client import AggregatorClient
from fedbroker.aggregators.rounds import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.bus import open_bus
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig, load_config
from fedbroker.errors import ConfigError
from fedbroker.metrics import start_ephemeral_exporter, start_exporter
from fedbroker.rpc import RemoteError
from fedbroker.spec import parse_model
from fedbroker.worker.agent import WorkerAgent

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
    aggregator.open_round(job, 1, ["w1", "w2"], deadline_unix=4e9, aggregation=AGG, seed=0)
    before = {name: value(name) for name in ("fedbroker_aggregator_uploads_accepted_total",
                                               "fedbroker_aggregator_uploads_duplicate_total")}
    shape = value("fedbroker_aggregator_uploads_rejected_total", reason="wrong_shape")
    stranger = value("fedbroker_aggregator_uploads_rejected_total", reason="unknown_worker")
    received = value("fedbroker_aggregator_received_bytes_total", rpc="UploadUpdate")

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
    assert value("fedbroker_aggregator_received_bytes_total", rpc="UploadUpdate") == received + 40


@pytest.mark.integration
def test_a_late_upload_counts_as_late_and_as_rejected(aggregator):
    job = f"m-{uuid.uuid4().hex[:6]}"
    aggregator.put_global(job, 1, SPEC.to_json(), weights(0.0))
    aggregator.open_round(job, 1, ["w1"], deadline_unix=1.0, aggregation=AGG, seed=0)  # long past
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
    aggregator.open_round(job, 1, ["w1"], deadline_unix=4e9, aggregation=AGG, seed=0)
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
    agg_metrics.record_close({"alignment": "feddna", "weighting": "dwfed", "selection": "ga"}, 0.2, 3,
                             {"alignment_total_matched_distance": 12.5, "selection_fitness": 0.75,
                              "selection_fallback": 1.0})
    assert value("fedbroker_aggregator_alignment_matched_distance", alignment="feddna") == 12.5
    assert value("fedbroker_aggregator_selection_fitness", selection="ga") == 0.75
    assert value("fedbroker_aggregator_selection_fallbacks_total", selection="ga") == fallbacks + 1
    assert value("fedbroker_aggregator_aggregation_seconds_count", alignment="feddna", weighting="dwfed",
                 selection="ga") >= 1


def test_algorithm_labels_default_like_the_job_spec():
    assert agg_metrics.algorithm_labels({}) == {"alignment": "none", "weighting": "fedavg", "selection": "all"}
    assert agg_metrics.algorithm_labels({"alignment": "pfnm"})["alignment"] == "pfnm"


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
