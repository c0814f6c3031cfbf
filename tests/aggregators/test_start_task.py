"""A task's two calls on the real gRPC service: `StartTask` (does the round still want this worker's update,
and the model to train, inline when small) and the one-message upload, with and without authentication."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.errors import Rejection
from fedbroker.job.spec import parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc import codec
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.rpc.plumbing import RemoteError
from tests.installed import install
from tests.security.conftest import token_table

pytestmark = pytest.mark.integration

SPEC = parse_model({"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]})
AGG = {"alignment": "none", "weighting": "fedavg", "selection": "all"}


def weights(v: float) -> dict[str, np.ndarray]:
    return {"0.weight": np.arange(8, dtype=np.float32).reshape(2, 4) + v, "0.bias": np.full(2, v, np.float32)}


@pytest.fixture
def service():
    table, tokens = token_table({"coordinator": "coordinator", "w1": "worker", "w2": "worker", "w3": "worker"})
    book = RoundBook()
    server, port = serve(book, tokens=table)
    target = f"127.0.0.1:{port}"
    clients = {name: AggregatorClient(target, timeout_s=5, attempts=1, security=ClientSecurity(token=token))
               for name, token in tokens.items()}
    clients["coordinator"].put_global("j", 1, SPEC.to_json(), weights(0.5))
    install(clients["coordinator"], "j", AGG)
    clients["coordinator"].open_round("j", 1, ["w1", "w2"], 4e9, seed=0)
    channel = grpc.insecure_channel(target)
    yield book, clients, pb_grpc.AggregationStub(channel), tokens
    channel.close()
    for client in clients.values():
        client.close()
    server.stop(grace=0)


def test_a_task_starts_with_the_model_inline_then_sees_its_update_in_then_the_round_closed(service):
    _book, c, _stub, _tokens = service
    start = c["w1"].start_task("j", 1, "w1", 1)
    assert (start.accepted, start.open) == (False, True)
    assert start.model is not None
    version, spec_json, tensors = start.model
    assert version == 1 and spec_json == SPEC.to_json()
    for name, array in weights(0.5).items():
        np.testing.assert_array_equal(tensors[name], array)

    receipt = c["w1"].upload(job_id="j", round=1, worker_id="w1", num_samples=3, tensors=weights(1.0))
    assert not receipt.duplicate and receipt.sha256 == codec.tensors_sha256(weights(1.0))
    again = c["w1"].start_task("j", 1, "w1", 1)  # a redelivered task: the update is in, nothing to train
    assert (again.accepted, again.open, again.model) == (True, True, None)
    assert c["w1"].upload(job_id="j", round=1, worker_id="w1", num_samples=3, tensors=weights(1.0)).duplicate

    c["w2"].upload(job_id="j", round=1, worker_id="w2", num_samples=1, tensors=weights(5.0))
    c["coordinator"].close_round("j", 1)
    closed = c["w2"].start_task("j", 1, "w2", 1)
    assert (closed.accepted, closed.open, closed.model) == (True, False, None)
    _, _, merged = c["coordinator"].download("j")  # the one-message uploads aggregated like streamed ones
    np.testing.assert_allclose(merged["0.bias"], (3 * 1.0 + 1 * 5.0) / 4)


def test_a_worker_with_a_kept_update_asks_only_the_status(service):
    _book, c, _stub, _tokens = service
    start = c["w2"].start_task("j", 1, "w2", 1, model=False)
    assert (start.accepted, start.open, start.model) == (False, True, None)


def test_a_model_too_large_for_one_message_comes_as_a_header_and_is_streamed(service, monkeypatch):
    _book, c, stub, tokens = service
    reply = stub.StartTask(pb.StartTaskRequest(job_id="j", round=1, worker_id="w1", version=1, inline_bytes=16),
                           metadata=(("authorization", f"Bearer {tokens['w1']}"),), timeout=5)
    assert reply.open and not reply.accepted and reply.header.version == 1
    assert reply.data == b"" and reply.sha256 == ""  # 40 bytes do not fit 16: the worker streams them
    monkeypatch.setattr(codec, "INLINE_BYTES", 16)  # client and service in this process: every model is "large"
    start = c["w1"].start_task("j", 1, "w1", 1)
    assert start.model is not None
    np.testing.assert_array_equal(start.model[2]["0.weight"], weights(0.5)["0.weight"])
    receipt = c["w1"].upload(job_id="j", round=1, worker_id="w1", num_samples=1, tensors=weights(2.0))  # streamed
    assert receipt.bytes_received == 40 and not receipt.duplicate


def test_a_worker_starts_only_its_own_tasks_and_an_unknown_job_or_round_is_named(service):
    _book, c, stub, _tokens = service
    with pytest.raises(RemoteError) as info:
        c["w1"].start_task("j", 1, "w2", 1)
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "worker 'w1' may start only its own tasks, not one of worker 'w2'" in str(info.value)
    with pytest.raises(grpc.RpcError) as anonymous:
        stub.StartTask(pb.StartTaskRequest(job_id="j", round=1, worker_id="w1", version=1), timeout=5)
    assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(RemoteError) as unknown:
        c["w1"].start_task("nope", 1, "w1", 1)
    assert unknown.value.code == grpc.StatusCode.NOT_FOUND and "unknown job 'nope'" in str(unknown.value)
    # a round past the open one cannot come from the coordinator that opened it (rounds open here in order, each
    # before its tasks go out): a task from a state given up since (a restore). Not open: dropped, never retried
    assert not c["w1"].start_task("j", 2, "w1", 1).open
    c["coordinator"].put_global("k", 1, SPEC.to_json(), weights(0.5))
    with pytest.raises(RemoteError) as later:  # a job with no round yet: not open *yet*, retried by a worker
        c["w1"].start_task("k", 1, "w1", 1)
    assert later.value.reason == Rejection.UNKNOWN_ROUND
    with pytest.raises(RemoteError) as outsider:  # refused before training: its upload would be, its ε spent
        c["w3"].start_task("j", 1, "w3", 1)
    assert outsider.value.reason == Rejection.UNKNOWN_WORKER
    assert "worker 'w3' is not a participant of round 1" in str(outsider.value)
    with pytest.raises(RemoteError) as version:
        c["w1"].start_task("j", 1, "w1", 7)
    assert version.value.code == grpc.StatusCode.NOT_FOUND and "no global model version 7" in str(version.value)


def test_in_async_mode_a_task_number_is_open_while_outstanding_and_in_once_accepted():
    book = RoundBook()
    server, port = serve(book)
    client = AggregatorClient(f"127.0.0.1:{port}", timeout_s=5, attempts=1)
    try:
        client.put_global("a", 1, SPEC.to_json(), weights(0.0))
        install(client, "a", AGG)
        client.open_buffer("a", buffer_size=2, max_staleness=4, staleness="constant",
                           staleness_params={}, server_lr=1.0, seed=0, num_samples={"w1": 10, "w2": 10})
        tasks = {t.worker_id: t.task for t in client.issue_tasks("a", ["w1", "w2"])}
        start = client.start_task("a", tasks["w1"], "w1", 1)
        assert (start.accepted, start.open) == (False, True) and start.model is not None
        assert not client.start_task("a", tasks["w2"], "w1", 1).open  # another worker's task is not ours
        client.upload(job_id="a", round=tasks["w1"], worker_id="w1", num_samples=4, tensors=weights(1.0))
        done = client.start_task("a", tasks["w1"], "w1", 1)
        assert (done.accepted, done.open, done.model) == (True, False, None)
    finally:
        client.close()
        server.stop(grace=0)



def test_the_inline_model_is_hashed_once_for_every_worker_of_the_round(service, monkeypatch):
    _book, c, _stub, _tokens = service
    hashed = []
    real = codec.tensors_sha256
    monkeypatch.setattr(codec, "tensors_sha256", lambda tensors: hashed.append(1) or real(tensors))
    for _ in range(3):
        for worker in ("w1", "w2"):
            start = c[worker].start_task("j", 1, worker, 1)
            assert start.model is not None and start.model[0] == 1
    assert len(hashed) == 1  # the service's digest cache, shared with streamed downloads


def test_a_service_whose_port_another_listener_holds_refuses_to_start_instead_of_sharing_it() -> None:
    """gRPC binds with SO_REUSEPORT by default: a second listener on a taken port (an old service still running
    after a restore, another process that drew the port) started silently, and the kernel split new connections
    between the two, so a worker could be answered by the wrong process for as long as its connection lived.
    The service's port is its own: a taken one stops it at start, saying so; a freed one is bound again."""
    from concurrent import futures

    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # gRPC's defaults: SO_REUSEPORT on
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        with pytest.raises(OSError, match=rf"could not bind .* to 127\.0\.0\.1:{port}: is another process"):
            serve(RoundBook(), address=f"127.0.0.1:{port}")
    finally:
        other.stop(grace=0).wait()
    server, bound = serve(RoundBook(), address=f"127.0.0.1:{port}")  # the port free again: ours
    try:
        assert bound == port
    finally:
        server.stop(grace=0).wait()
