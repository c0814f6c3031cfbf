"""A `grpc.aio` server in a thread of its own, behind the interface the rest of the process already uses.

Why asyncio: a synchronous gRPC server runs every call on a pool thread and hands each message between
gRPC's poller thread and that pool; at a thousand workers per round that hand-off, not our code, was most
of the control plane's CPU, and a thread per open stream caps how many workers one service can hold. The
asyncio server runs the cheap calls on its event loop (no hand-off) and holds any number of idle
connections for the cost of their sockets.

Why its own thread and loop: the services live in synchronous processes (the CLI's `serve` commands, the
demo, tests that call `serve(...)` and later `.stop()`); `AioServer` starts the loop, binds, and hands back
an object with the synchronous server's `stop(grace)` (returning an event to `.wait()` on) and
`wait_for_termination()`.

The handlers are the servicers' own, wrapped first by the same synchronous interceptors as before (their
checks run as the call starts, in the same order) and then bridged (`fedbroker.rpc.aio_bridge`): the methods
named in `inline` on the loop, every other one in a bounded executor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedbroker.errors import AddressTaken
from fedbroker.rpc.aio_bridge import Bridge
from fedbroker.rpc.auth import ServerTLS
from fedbroker.rpc.live_auth import add_port
from fedbroker.rpc.plumbing import CHANNEL_OPTIONS

log = logging.getLogger(__name__)
Handlers = dict[str, "grpc.RpcMethodHandler[Any, Any]"]   # full method name ("/service/Method") → handler
START_TIMEOUT_S = 30.0


def collect(add: Callable[[Any, Any], None], servicer: Any) -> Handlers:
    """The method handlers a generated `add_..._to_server(servicer, server)` registers, by full method name."""
    table: Handlers = {}

    class _Collect:  # stands in for a server to read the generated registration
        def add_generic_rpc_handlers(self, handlers: Any) -> None:
            pass

        def add_registered_method_handlers(self, service: str, handlers: Handlers) -> None:
            table.update({f"/{service}/{name}": h for name, h in handlers.items()})

    add(servicer, _Collect())
    if not table:  # a generator that registers no method handlers: extend `_Collect`
        raise RuntimeError(f"{add.__name__} registered no method handlers")
    return table


class _HandlerCallDetails(grpc.HandlerCallDetails):
    def __init__(self, method: str, invocation_metadata: Any) -> None:
        self.method = method
        self.invocation_metadata = invocation_metadata


def _intercepted(interceptors: Sequence[grpc.ServerInterceptor], details: grpc.HandlerCallDetails,
                 handler: grpc.RpcMethodHandler[Any, Any] | None) -> grpc.RpcMethodHandler[Any, Any] | None:
    """`handler` wrapped by `interceptors` as a synchronous server would (the first one outermost)."""
    def at(index: int, d: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        if index == len(interceptors):
            return handler
        return interceptors[index].intercept_service(lambda nxt: at(index + 1, nxt), d)

    return at(0, details)


class _Routes(grpc.GenericRpcHandler):
    """Every method of the server: intercepted, then bridged (inline or in the executor)."""

    def __init__(self, table: Handlers, interceptors: Sequence[grpc.ServerInterceptor], bridge: Bridge,
                 inline: Collection[str]) -> None:
        self.table = table
        self.interceptors = interceptors
        self.bridge = bridge
        self.inline = inline

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler[Any, Any] | None:
        method = handler_call_details.method
        details = _HandlerCallDetails(method, handler_call_details.invocation_metadata)
        handler = _intercepted(self.interceptors, details, self.table.get(method))
        if handler is None:
            return None
        return self.bridge.handler(handler, inline=method.rpartition("/")[2] in self.inline)


class AioServer:
    """A started `grpc.aio` server on its own event loop thread (see the module docstring)."""

    def __init__(self, table: Handlers, *, address: str, tls: ServerTLS | None, service: str,
                 interceptors: Sequence[grpc.ServerInterceptor] = (), inline: Collection[str] = frozenset(),
                 threads: int = 16) -> None:
        """Bind `address` and serve `table` (+ gRPC health, SERVING for "" and `service`); `threads` bounds
        the executor of the blocking calls. AddressTaken when the address cannot be bound."""
        self.service = service
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=threads,
                                                              thread_name_prefix=f"{service}-blocking")
        self.health = health.HealthServicer()
        table = {**table, **collect(health_pb2_grpc.add_HealthServicer_to_server, self.health)}
        self._routes = _Routes(table, interceptors, Bridge(self.executor), {"Check", *inline})
        self.loop = asyncio.new_event_loop()
        self._stopped = threading.Event()
        self._ready: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._server: grpc.aio.Server | None = None
        self._thread = threading.Thread(target=self._run, args=(address, tls), name=f"{service}-aio", daemon=True)
        self._thread.start()
        self.port = self._ready.result(timeout=START_TIMEOUT_S)

    def _run(self, address: str, tls: ServerTLS | None) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start(address, tls))
        except BaseException as exc:
            self._ready.set_exception(exc)
            self.loop.close()
            self.executor.shutdown(wait=False)
            self._stopped.set()
            return
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
            self.executor.shutdown(wait=False, cancel_futures=True)
            self._stopped.set()

    async def _start(self, address: str, tls: ServerTLS | None) -> None:
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        server.add_generic_rpc_handlers((self._routes,))
        try:
            port = add_port(server, address, tls)  # type: ignore[arg-type]  # same method on the aio server
        except RuntimeError:  # newer gRPC raises where older ones returned 0
            port = 0
        if port == 0:
            raise AddressTaken(f"could not bind the {self.service} service to {address}: is another process "
                               f"listening there?", address=address)
        await server.start()
        self._server = server
        for name in ("", self.service):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._ready.set_result(port)

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stop serving (calls in flight get `grace` seconds); the returned event is set once it has stopped."""
        if self._stopped.is_set() or self.loop.is_closed():
            return self._stopped

        async def stop() -> None:
            if self._server is not None:
                await self._server.stop(grace)
            self.loop.stop()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop)
        except RuntimeError:  # the loop closed meanwhile
            pass
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Block until the server has stopped (True) or `timeout` passed (False)."""
        return self._stopped.wait(timeout)
