"""The aggregation service's replicas as one client sees them: a list of targets, one current.

A job is served by the replica that owns it (`aggregators.ownership`). A call goes to the current replica; a
`not_owner` refusal names the owner's advertised address in its trailers, and the call goes there at once, but
only when that address is one of this client's own targets: a forged redirect (from anything that is not a
replica the client was configured with) is never followed, it only moves the client to its next target. Any
other UNAVAILABLE (a dead replica, one whose lease lapsed) moves the client to its next target before the
caller's retry (`rpc.call_with_retry`), so a failover costs the retries' usual backoff, no more.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.rpc.auth import ClientSecurity
from fedbroker.rpc.plumbing import CHANNEL_OPTIONS, _trailer, reason_of

log = logging.getLogger(__name__)
T = TypeVar("T")

NOT_OWNER = "not_owner"
OWNER_KEY = "fedbroker-owner"  # the trailer a `not_owner` refusal names its owner in (aggregators.ownership)


def split_targets(target: str) -> list[str]:
    """`host:port` or several separated by commas (the replicas, `aggregator.targets`), in order, once each."""
    targets = list(dict.fromkeys(t.strip() for t in target.split(",") if t.strip()))
    if not targets:
        raise ValueError(f"no aggregation service address in {target!r}")
    return targets


def _path(method: str) -> str:
    service = pb.DESCRIPTOR.services_by_name["Aggregation"]
    return f"/{service.full_name}/{service.methods_by_name[method].name}"


@dataclass
class Stubs:
    """One replica's channel and the stubs on it."""

    channel: grpc.Channel
    stub: pb_grpc.AggregationStub
    async_stub: pb_grpc.AsyncAggregationStub
    events_stub: pb_grpc.AggregationEventsStub
    presence_stub: pb_grpc.WorkerPresenceStub
    put_global: grpc.StreamUnaryMultiCallable[bytes, pb.UploadReceipt]
    upload: grpc.StreamUnaryMultiCallable[bytes, pb.UploadReceipt]
    download: grpc.UnaryStreamMultiCallable[pb.GlobalModelRequest, bytes]

    @classmethod
    def on(cls, channel: grpc.Channel) -> Stubs:
        """The stubs on `channel`; the streaming methods take and give serialized messages (see `codec`)."""
        # the streaming methods with serialized messages in and out (no request serializer / deserializer)
        return cls(channel, pb_grpc.AggregationStub(channel), pb_grpc.AsyncAggregationStub(channel),
                   pb_grpc.AggregationEventsStub(channel), pb_grpc.WorkerPresenceStub(channel),
                   channel.stream_unary(_path("PutGlobalModel"), response_deserializer=pb.UploadReceipt.FromString),
                   channel.stream_unary(_path("UploadUpdate"), response_deserializer=pb.UploadReceipt.FromString),
                   channel.unary_stream(_path("DownloadGlobalModel"),
                                        request_serializer=pb.GlobalModelRequest.SerializeToString))


class Replicas:
    """The targets, a channel to each, and the one calls go to now (thread-safe)."""

    def __init__(self, targets: Sequence[str], security: ClientSecurity | None) -> None:
        self.targets = list(targets)
        self._security = security or ClientSecurity()
        self.metadata = self._security.metadata()
        # every channel now (gRPC connects lazily): a target the token may not go to is refused here, at once
        self._stubs = {target: Stubs.on(self._security.channel(target, CHANNEL_OPTIONS)) for target in self.targets}
        self._index = 0
        self._lock = threading.Lock()

    def current(self) -> Stubs:
        """The current replica's stubs."""
        with self._lock:
            return self._stubs[self.targets[self._index]]

    def routed(self, fn: Callable[[], T]) -> Callable[[], T]:
        """`fn` (a call on the current replica's stubs), following a `not_owner` redirect to a listed owner at
        once; any other UNAVAILABLE moves to the next target and is raised for the caller's retry."""
        def call() -> T:
            for _ in range(len(self.targets)):
                with self._lock:
                    index = self._index
                try:
                    return fn()
                except grpc.RpcError as error:
                    if len(self.targets) == 1 or error.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    if reason_of(error) == NOT_OWNER and self._follow(_trailer(error, OWNER_KEY) or "", index):
                        continue
                    self._advance(index)
                    raise
            return fn()  # redirected as often as there are replicas (ownership moving): one last try

        return call

    def _follow(self, owner: str, failed: int) -> bool:
        """Go to the owner a `not_owner` refusal named, if it is one of our targets (a forged one is not)."""
        if owner not in self.targets:
            log.warning("aggregation service: a not_owner refusal named %r, which is not one of this client's "
                        "targets %s: not followed", owner, self.targets)
            return False
        with self._lock:
            if self._index == failed:
                self._index = self.targets.index(owner)
        return True

    def _advance(self, failed: int) -> None:
        with self._lock:
            if self._index == failed:  # not yet moved by a concurrent call
                self._index = (failed + 1) % len(self.targets)
                log.info("aggregation service: %s unavailable, trying %s", self.targets[failed],
                         self.targets[self._index])

    def close(self) -> None:
        """Close every channel opened."""
        with self._lock:
            stubs, self._stubs = list(self._stubs.values()), {}
        for s in stubs:
            s.channel.close()
