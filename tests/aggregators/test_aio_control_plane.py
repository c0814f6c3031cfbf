"""The aggregation service on asyncio gRPC: a blocking call runs off the event loop, so it stalls no other
call; workers' heartbeats are paced by the service, refused when early, bound to the caller's identity; and
a silent stream is ended while heartbeats go on (deploy/SECURITY.md, "HA: control plane on asyncio gRPC")."""

from __future__ import annotations

import random
import threading
from collections import Counter
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedbroker.aggregators.presence import EARLY, Early, HeartbeatPacing, Pacer
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import SERVICE_NAME, serve
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.rpc.callguard import CallLimits
from tests.aggregators.small_service import open_round_one, reason_of, silent, wait_for, weights
from tests.security.conftest import token_table

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]



class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def secured():
    table, tokens = token_table({"coordinator": "coordinator", "w1": "worker", "w2": "worker"})
    book = RoundBook()
    server, port = serve(book, tokens=table, limits=CallLimits(threads=8, max_streams=4, stream_idle_timeout_s=1.5),
                         heartbeat=HeartbeatPacing(interval_s=30.0, max_per_s=100))
    target = f"127.0.0.1:{port}"
    channel = grpc.insecure_channel(target)
    yield {"book": book, "tokens": tokens, "channel": channel, "target": target}
    channel.close()
    server.stop(grace=0).wait(30)


def beat(channel: grpc.Channel, token: str, worker_id: str) -> pb.KeepAliveReply:
    reply: pb.KeepAliveReply = pb_grpc.WorkerPresenceStub(channel).KeepAlive(
        pb.KeepAliveRequest(worker_id=worker_id, state="idle"), timeout=10,
        metadata=(("authorization", f"Bearer {token}"),))
    return reply


def test_a_blocking_close_does_not_stall_other_calls():
    """A close that blocks (aggregating, fsyncing) holds an executor thread, never the event loop: while it
    is held, a status call, a task's start, a heartbeat and a health check are answered."""
    book = RoundBook()
    entered, release = threading.Event(), threading.Event()
    close = book.close

    def blocking_close(job_id: str, round_number: int) -> Any:
        entered.set()
        assert release.wait(60), "the test never released the close"
        return close(job_id, round_number)

    book.close = blocking_close  # type: ignore[method-assign]
    server, port = serve(book)
    target = f"127.0.0.1:{port}"
    client = AggregatorClient(target, timeout_s=10)
    channel = grpc.insecure_channel(target)
    try:
        open_round_one(client)
        client.upload(job_id="job", round=1, worker_id="w1", num_samples=3, tensors=weights(1.0))
        closing = pb_grpc.AggregationStub(channel).CloseRound.future(pb.CloseRoundRequest(job_id="job", round=1),
                                                                     timeout=60)
        assert entered.wait(30), "the close never started"
        assert client.status("job", 1) == (["w1"], True)
        assert client.start_task("job", 1, "w2", 1).open
        assert pb_grpc.WorkerPresenceStub(channel).KeepAlive(pb.KeepAliveRequest(worker_id="w2"),
                                                             timeout=10).next_in_ms > 0
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                                         timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        assert not closing.done()
        release.set()
        assert list(closing.result(timeout=60).aggregated) == ["w1"]
    finally:
        release.set()
        client.close()
        channel.close()
        server.stop(grace=0).wait(30)


def test_a_herd_of_heartbeats_leaves_spread_over_the_interval_at_the_paced_rate():
    """10,000 workers that beat at the same instant are told to come back spread out: no second gets more
    than `max_per_s` of them, none sooner than the jittered interval, and the herd's spread grows past the
    interval only as far as the rate requires."""
    clock = FakeClock()
    pacing = HeartbeatPacing(interval_s=30.0, jitter=0.2, max_per_s=250)
    pacer = Pacer(pacing, clock=clock, rng=random.Random(7))
    waits = [pacer.beat(f"w{i:05d}") for i in range(10_000)]
    per_second = Counter(int(clock.now + w) for w in waits)
    assert max(per_second.values()) <= 250
    assert min(waits) >= 30.0 * 0.8
    assert max(waits) <= 10_000 / 250 + 30.0 * 0.8 + 1   # 40 s of slots from the earliest due time at most
    assert len(per_second) >= 40
    assert pacer.present() == 10_000


def test_an_early_heartbeat_is_refused_and_takes_no_slot(secured):
    """A site flooding heartbeats: each beat before its due time is refused (RESOURCE_EXHAUSTED,
    `heartbeat_early`, with when to come back) and schedules nothing; another worker is answered meanwhile."""
    channel, tokens = secured["channel"], secured["tokens"]
    first = beat(channel, tokens["w1"], "w1")
    assert 30_000 * 0.8 <= first.next_in_ms <= 30_000 * 1.2 + 1000
    for _ in range(50):
        with pytest.raises(grpc.RpcError) as info:
            beat(channel, tokens["w1"], "w1")
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and reason_of(info.value) == EARLY
        retry_after = float(dict(info.value.trailing_metadata())["fedbroker-retry-after-ms"])
        assert 0 < retry_after <= first.next_in_ms
    other = beat(channel, tokens["w2"], "w2")
    assert other.workers_present == 2
    clock = FakeClock()
    pacer = Pacer(HeartbeatPacing(interval_s=10.0, jitter=0.0, max_per_s=1), clock=clock)
    assert pacer.beat("w1") == 10.0
    for _ in range(20):
        with pytest.raises(Early):
            pacer.beat("w1")
    assert pacer.beat("w2") == 11.0   # the flood took no slots: w2 has the second after w1's, not the 21st


def test_a_forged_worker_id_is_refused_and_never_becomes_present(secured):
    """A worker's token heartbeats only as itself: another worker id is PERMISSION_DENIED and records nothing."""
    channel, tokens = secured["channel"], secured["tokens"]
    with pytest.raises(grpc.RpcError) as info:
        beat(channel, tokens["w1"], "w2")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and reason_of(info.value) == "permission_denied"
    with pytest.raises(grpc.RpcError) as info:
        beat(channel, "not-a-token", "w1")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert beat(channel, tokens["w2"], "w2").workers_present == 1   # only w2 itself


def test_a_slow_loris_stream_is_ended_while_heartbeats_go_on(secured):
    """A stream that sends nothing holds one transfer slot until `stream_idle_timeout_s`, then is ended
    (DEADLINE_EXCEEDED, `idle_stream`); heartbeats and control calls are answered throughout."""
    channel, tokens, target = secured["channel"], secured["tokens"], secured["target"]
    coordinator = AggregatorClient(target, timeout_s=10, security=ClientSecurity(token=tokens["coordinator"]))
    release = threading.Event()
    try:
        open_round_one(coordinator)
        loris = pb_grpc.AggregationStub(channel).UploadUpdate.future(
            silent(release), metadata=(("authorization", f"Bearer {tokens['w1']}"),), timeout=60)
        assert beat(channel, tokens["w2"], "w2").next_in_ms > 0
        assert coordinator.status("job", 1) == ([], True)
        error = wait_for(lambda: loris.done() and loris.exception(), "the silent stream to be ended")
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and error.details().startswith("idle_stream:")
        w1 = AggregatorClient(target, timeout_s=10, security=ClientSecurity(token=tokens["w1"]))
        assert 30 * 0.8 <= w1.keep_alive("w1") <= 30 * 1.2 + 1   # the client's heartbeat: when to come back
        w1.close()
    finally:
        release.set()
        coordinator.close()
