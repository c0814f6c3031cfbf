"""The aggregation service's thread budget (fedbroker.rpc.callguard) against a real gRPC server on port 0: one
worker token cannot freeze the service. Its silent streams beyond `max_streams_per_worker` are refused at
once, those it holds are ended after `stream_idle_timeout_s`, and meanwhile health checks, the coordinator's
control calls and another worker's upload go through."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import SERVICE_NAME, serve
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.spec import parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.rpc.callguard import CallLimits
from tests.aggregators.small_service import open_round_one, reason_of, silent, wait_for, weights
from tests.security.conftest import token_table

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

IDLE_S = 2.0


def streams_open() -> float:
    return REGISTRY.get_sample_value("fedbroker_grpc_server_streams", {"grpc_service": SERVICE_NAME}) or 0.0


def refused(method: str, reason: str) -> float:
    return REGISTRY.get_sample_value("fedbroker_grpc_server_calls_refused_total",
                                     {"grpc_service": SERVICE_NAME, "grpc_method": method, "reason": reason}) or 0.0


def uploads_rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("fedbroker_aggregator_uploads_rejected_total", {"reason": reason}) or 0.0


@pytest.fixture
def service():
    table, tokens = token_table({"coordinator": "coordinator", "w1": "worker", "w2": "worker"})
    book = RoundBook()
    server, port = serve(book, tokens=table, limits=CallLimits(threads=16, max_streams=8,
                                                                 stream_idle_timeout_s=IDLE_S))
    target = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(target)
    clients = {name: AggregatorClient(target, timeout_s=10, security=ClientSecurity(token=token))
               for name, token in tokens.items()}
    open_round_one(clients["coordinator"])
    release = threading.Event()
    yield {"tokens": tokens, "clients": clients, "channel": channel, "release": release, "target": target}
    release.set()
    for client in clients.values():
        client.close()
    channel.close()
    server.stop(grace=0)


def test_one_workers_silent_streams_cannot_starve_health_checks_control_calls_or_other_workers(service):
    tokens, clients, release = service["tokens"], service["clients"], service["release"]
    stub = pb_grpc.AggregationStub(service["channel"])
    baseline = streams_open()
    idle_before = refused("UploadUpdate", "idle_stream")
    rejected_before = uploads_rejected("idle_stream"), uploads_rejected("too_many_streams")
    calls = [stub.UploadUpdate.future(silent(release), metadata=(("authorization", f"Bearer {tokens['w1']}"),),
                                      timeout=60) for _ in range(24)]   # more than the service's 16 threads

    # every stream beyond the worker's two is refused at once, reading nothing
    def refusals() -> list[Any]:
        return [c for c in calls if c.done() and c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]

    wait_for(lambda: len(refusals()) >= 22, "22 of the 24 silent streams to be refused")
    for call in refusals():
        assert reason_of(call) == "too_many_streams"
        assert "max_streams_per_worker" in call.details()

    # meanwhile: a health check, the coordinator's control calls and another worker's upload, promptly
    health = health_pb2_grpc.HealthStub(service["channel"])
    assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
    assert clients["coordinator"].status("job", 1) == ([], True)
    receipt = clients["w2"].upload(job_id="job", round=1, worker_id="w2", num_samples=3, tensors=weights(2.0))
    assert not receipt.duplicate

    # the two streams it held waited on their client for the idle timeout: ended, their threads free
    wait_for(lambda: all(c.done() for c in calls), "the two held streams to be ended", timeout=IDLE_S + 30)
    held = [c for c in calls if c.code() != grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(held) == 2
    for call in held:
        assert call.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (call.code(), call.details())
        assert call.details().startswith("idle_stream:")
    wait_for(lambda: streams_open() == baseline, "the idle streams' slots to be given back")
    assert refused("UploadUpdate", "idle_stream") == idle_before + 2
    # each counted once (the handler counts an ended upload as it unwinds, a moment after the call ended)
    wait_for(lambda: uploads_rejected("idle_stream") >= rejected_before[0] + 2, "the idle uploads to be counted")
    time.sleep(0.2)
    assert (uploads_rejected("idle_stream"), uploads_rejected("too_many_streams")) == \
        (rejected_before[0] + 2, rejected_before[1] + 22)

    # and the worker itself may upload again
    receipt = clients["w1"].upload(job_id="job", round=1, worker_id="w1", num_samples=3, tensors=weights(4.0))
    assert not receipt.duplicate
    assert sorted(clients["coordinator"].close_round("job", 1).aggregated) == ["w1", "w2"]


def test_a_download_the_client_does_not_read_is_ended_after_the_idle_timeout(service):
    """A response stream blocks its thread in gRPC's flow control once the client stops reading: it is ended
    as an upload that sends nothing is."""
    clients = service["clients"]
    big = parse_model({"input_shape": [4096], "layers": [{"type": "Linear", "in_features": 4096,
                                                          "out_features": 1024}]})
    tensors = {"0.weight": np.zeros((1024, 4096), np.float32), "0.bias": np.zeros(1024, np.float32)}  # 16 MiB
    clients["coordinator"].put_global("big", 1, big.to_json(), tensors)
    # no BDP probing: the client's flow-control window stays small, so the unread model cannot all fit in it
    channel = grpc.insecure_channel(service["target"], options=[("grpc.http2.bdp_probe", 0)])
    stub = pb_grpc.AggregationStub(channel)
    baseline = streams_open()
    stream = stub.DownloadGlobalModel(pb.GlobalModelRequest(job_id="big"), timeout=60,
                                      metadata=(("authorization", f"Bearer {service['tokens']['w1']}"),))
    next(stream)   # the header; then the client reads no more
    wait_for(lambda: streams_open() == baseline, "the unread download to be ended", timeout=IDLE_S + 30)
    with pytest.raises(grpc.RpcError) as info:
        for _ in stream:
            pass
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    channel.close()
    _, _, got = clients["w1"].download("big")   # a reader gets the whole model
    assert got["0.weight"].shape == (1024, 4096)


@pytest.mark.parametrize("limits, field", [
    (dict(threads=10, health_threads=2, max_streams=8), "aggregator.max_streams"),
    (dict(max_streams=4, max_streams_per_worker=5), "aggregator.max_streams_per_worker"),
    (dict(health_threads=0), "aggregator.health_threads"),
    (dict(stream_idle_timeout_s=0), "aggregator.stream_idle_timeout_s"),
    (dict(stream_idle_timeout_s=float("nan")), "aggregator.stream_idle_timeout_s"),
])
def test_limits_that_leave_control_calls_or_health_checks_no_thread_are_a_config_error(limits, field):
    with pytest.raises(ConfigError) as info:
        CallLimits(**limits)
    fields = [e.field for e in info.value.errors] if isinstance(info.value, ConfigErrors) else [info.value.field]
    assert field in fields


def test_the_aggregator_process_takes_its_thread_budget_from_its_config():
    from fedbroker.app.launch import start_aggregator
    from fedbroker.config import load_config

    config = load_config(environ={"FEDBROKER__AGGREGATOR__MAX_STREAMS": "47"})
    with pytest.raises(ConfigError, match=r"aggregator\.max_streams: .* must be below threads \(48\)"):
        start_aggregator(config)


def test_the_coordinators_event_stream_takes_no_transfer_slot_from_the_workers():
    book = RoundBook()
    server, port = serve(book, limits=CallLimits(threads=6, health_threads=1, max_streams=1, max_streams_per_worker=1))
    client = AggregatorClient(f"127.0.0.1:{port}", timeout_s=10)
    try:
        open_round_one(client, ("w1",))
        events = client.watch()
        first = next(events)  # the stream is open, holding its thread
        assert [j.job_id for j in first.jobs] == ["job"]
        # the one transfer slot is still the workers': an upload goes through, and the stream hears of it
        assert not client.upload(job_id="job", round=1, worker_id="w1", num_samples=3, tensors=weights(1.0)).duplicate
        assert next(events).jobs[0].accepted == 1
        events.cancel()
    finally:
        client.close()
        server.stop(grace=0)


def test_a_busy_refusal_tells_each_caller_when_to_come_back_and_the_client_waits_that_long():
    """Past `max_streams` a transfer is refused at once (`server_busy`) with a retry-after that queues the
    refused callers up virtually (each one slot-turnover behind the last), so a herd comes back spread out;
    `AggregatorClient` waits that long, not an outage's backoff, and gets through once the slot is free."""
    table, tokens = token_table({"coordinator": "coordinator", "w1": "worker", "w2": "worker"})
    book = RoundBook()
    server, port = serve(book, tokens=table, limits=CallLimits(threads=4, health_threads=1, max_streams=1,
                                                               max_streams_per_worker=1))
    target = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(target)
    coordinator = AggregatorClient(target, timeout_s=10, security=ClientSecurity(token=tokens["coordinator"]))
    release = threading.Event()
    try:
        open_round_one(coordinator)
        stub = pb_grpc.AggregationStub(channel)
        w1 = (("authorization", f"Bearer {tokens['w1']}"),)
        # a transfer that lasts 1.5 s: what the service expects the next ones to take
        slow = threading.Event()
        threading.Timer(1.5, slow.set).start()
        with pytest.raises(grpc.RpcError):
            stub.UploadUpdate(silent(slow), metadata=w1, timeout=60)  # ends without a header: refused, timed
        held = stub.UploadUpdate.future(silent(release), metadata=w1, timeout=60)
        wait_for(lambda: streams_open() >= 1, "w1's silent upload to hold the one transfer slot")
        hints = []
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.DownloadGlobalModel(pb.GlobalModelRequest(job_id="job"), timeout=10,
                                              metadata=(("authorization", f"Bearer {tokens['w2']}"),)))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE and reason_of(info.value) == "server_busy"
            hints.append(float(dict(info.value.trailing_metadata())["fedbroker-retry-after-ms"]))
        # each refused caller is one slot-turnover (1.5 s / 1 slot) behind the last, never past RPC_BACKOFF's cap
        assert 1000 < hints[0] < hints[1] < hints[2] <= 5000, hints

        # a client told to come back retries after about that long (not 0.2 s) and gets in once w1's slot is free
        w2 = AggregatorClient(target, timeout_s=10, security=ClientSecurity(token=tokens["w2"])).until(time.time() + 30)
        threading.Timer(0.3, release.set).start()
        version, _, got = w2.download("job")
        assert version == 1 and got["0.weight"].shape == (2, 4)
        held.exception(timeout=30)
        w2.close()
    finally:
        release.set()
        coordinator.close()
        channel.close()
        server.stop(grace=0)
