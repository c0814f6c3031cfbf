"""A standby coordinator's gRPC port: every call of the coordinator's service is answered UNAVAILABLE, reason
`standby`, naming the leader where this process knows it, so a client (the CLI's `coordinator.targets`) tries
the next address at once instead of waiting on a process that will not act. gRPC health and every other service
pass through; so does everything once this process leads.

An interceptor, so the servicer never learns of the election: `StandbyGate` for a `grpc.server`,
`AsyncStandbyGate` for a `grpc.aio.server`. It sits after authentication: a caller without a valid token learns
nothing, not even which process leads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from fedbroker.errors import Unavailable
from fedbroker.printable import printable
from fedbroker.rpc.plumbing import REASON_KEY

LEADER_KEY = "fedbroker-leader"   # trailing metadata of a `standby` refusal: where the leader serves, when known
SERVICE_PREFIX = "/fedbroker.v1.Coordinator/"


class Standby(Unavailable):
    """This coordinator stands by: another one leads (or none yet); ask the next of coordinator.targets."""

    reason = "standby"


def refusal(leader: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The details and trailing metadata of a standby's answer."""
    named = f"the leader is {printable(leader)}" if leader else "no coordinator leads yet (a takeover is under way)"
    details = (f"standby: this coordinator stands by and serves no call; {named}: ask it, or the next address "
               f"of coordinator.targets")
    return details, ((REASON_KEY, Standby.reason), *(((LEADER_KEY, leader),) if leader else ()))


def _gated(method: str, leading: Callable[[], bool]) -> bool:
    return method.startswith(SERVICE_PREFIX) and not leading()


def _same_shape(handler: grpc.RpcMethodHandler[Any, Any],
                behaviour: Callable[..., Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler with `handler`'s streaming shape and codecs whose behaviour is `behaviour`."""
    codecs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behaviour, **codecs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behaviour, **codecs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, **codecs)
    return grpc.unary_unary_rpc_method_handler(behaviour, **codecs)


class StandbyGate(grpc.ServerInterceptor):
    """`leading()`: whether this process leads now; `leader()`: where the leader serves ("" unknown)."""

    def __init__(self, leading: Callable[[], bool], leader: Callable[[], str]) -> None:
        self.leading = leading
        self.leader = leader

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        """The method's handler, or while this process stands by one of its shape that refuses the call."""
        handler = continuation(handler_call_details)
        if handler is None or not _gated(handler_call_details.method, self.leading):
            return handler

        def refuse(request: object, context: grpc.ServicerContext) -> None:
            details, trailers = refusal(self.leader())
            context.set_trailing_metadata(trailers)
            context.abort(grpc.StatusCode.UNAVAILABLE, details)

        return _same_shape(handler, refuse)


class AsyncStandbyGate(grpc.aio.ServerInterceptor):
    """The same gate for an asyncio server."""

    def __init__(self, leading: Callable[[], bool], leader: Callable[[], str]) -> None:
        self.leading = leading
        self.leader = leader

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
            handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        """As StandbyGate's."""
        handler = await continuation(handler_call_details)
        if handler is None or not _gated(handler_call_details.method, self.leading):
            return handler

        async def refuse(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            details, trailers = refusal(self.leader())
            context.set_trailing_metadata(trailers)
            await context.abort(grpc.StatusCode.UNAVAILABLE, details)

        return _same_shape(handler, refuse)
