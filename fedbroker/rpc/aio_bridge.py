"""Synchronous handler code on a `grpc.aio` server: the bridge between the two.

The servicers, and the interceptors that guard them (authentication, revocation, the call budget, metrics),
are written against gRPC's synchronous handler interface: `context.abort` raises, requests come as an
iterator, responses go out as one. `bridge` turns such a handler into a coroutine handler for the asyncio
server, two ways:

- **inline**, on the event loop: for the cheap calls (a round's status, a task's start, a small upload, a
  heartbeat) that never wait on a lock held for long, a disk or a peer. No thread hand-off: this is where
  the asyncio server saves its CPU;
- **in a bounded executor** (`loop.run_in_executor`): everything that may block — a close aggregating, a
  spool's fsync, a long poll, a streamed upload read message by message. The loop keeps serving meanwhile.

`SyncContext` is what the synchronous code sees as its context: `abort` records the status and raises
`Aborted`, which the bridge turns into `await context.abort(...)` on the loop; `end` (CallGuard's idle
watchdog, from its own thread) ends a call whose read or write is pending by cancelling that operation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, cast

import grpc
import grpc.aio

log = logging.getLogger(__name__)
_DONE = object()
_UNREAD = object()


class Aborted(Exception):
    """Raised by `SyncContext.abort`: the call ends with the status the context recorded."""


class StreamEnded(grpc.RpcError):
    """A request stream that can no longer be read (the call was ended, cancelled, or its client went away)."""


class SyncContext:
    """A synchronous servicer context over one `grpc.aio` call (see the module docstring).

    The call's metadata, peer and auth context are read once, on the loop; trailing metadata and the status
    are kept here and applied on the loop when the handler returns, so handler code may run on any thread.
    """

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any], loop: asyncio.AbstractEventLoop, *,
                 eager: bool = True) -> None:
        """`eager`: read the call's metadata, auth context and peer now, on the loop, for code on another
        thread; a call run inline reads them only if its code asks (most ask for the metadata alone)."""
        self.aio = context
        self.loop = loop
        self._metadata = context.invocation_metadata() if eager else _UNREAD
        self._auth_context = context.auth_context() if eager else _UNREAD
        self._peer = context.peer() if eager else _UNREAD
        self.trailing: tuple[tuple[str, str | bytes], ...] = ()
        self.status: tuple[grpc.StatusCode, str] | None = None
        self.ended: tuple[grpc.StatusCode, str] | None = None
        self.finished = False
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._cancel_pending: Callable[[], object] | None = None

    # ----- the synchronous context's interface -----

    def invocation_metadata(self) -> Any:
        """The call's metadata (read on the loop)."""
        if self._metadata is _UNREAD:
            self._metadata = self.aio.invocation_metadata()
        return self._metadata

    def auth_context(self) -> Any:
        """The call's auth context: its TLS peer's certificate, when it has one."""
        if self._auth_context is _UNREAD:
            self._auth_context = self.aio.auth_context()
        return self._auth_context

    def peer(self) -> str:
        """The caller's address."""
        if self._peer is _UNREAD:
            self._peer = self.aio.peer()
        return str(self._peer)

    def time_remaining(self) -> float | None:
        """Seconds until the call's deadline, or None."""
        return self.aio.time_remaining()

    def set_trailing_metadata(self, metadata: Any) -> None:
        """Kept, and sent with the call's status."""
        self.trailing = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        """The status the call ends with (applied on the loop)."""
        self.status = (code, self.status[1] if self.status else "")

    def set_details(self, details: str) -> None:
        """The status details the call ends with (applied on the loop)."""
        self.status = (self.status[0] if self.status else grpc.StatusCode.UNKNOWN, details)

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        """Record the status and raise `Aborted`: the bridge ends the call with it."""
        if self.status is None:
            self.status = (code, details)
        raise Aborted(details)

    def code(self) -> grpc.StatusCode | None:
        """The status the call ends with, once known."""
        status = self.ended or self.status
        return status[0] if status else None

    def is_active(self) -> bool:
        """False once the call ended (finished, ended by the service, or its client went away)."""
        return not self.finished and self.ended is None

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Run `callback` when the call ends, however it ends; False when it already has."""
        with self._lock:
            if self.finished:
                return False
            self._callbacks.append(callback)
        return True

    def cancel(self) -> None:
        """End the call as CANCELLED (from any thread)."""
        self.end(grpc.StatusCode.CANCELLED, "cancelled by the service")

    # ----- what the bridge and CallGuard use -----

    def end(self, code: grpc.StatusCode, details: str) -> None:
        """End the call from any thread with `code`: its pending read or write returns at once."""
        with self._lock:
            if self.ended is not None or self.finished:
                return
            self.ended = (code, details)
            cancel = self._cancel_pending
        if cancel is not None:
            self.loop.call_soon_threadsafe(cancel)

    def pending(self, cancel: Callable[[], object] | None) -> None:
        """The cancel of the read or write the call waits on now (None: none); `end` calls it."""
        with self._lock:
            self._cancel_pending = cancel

    def run_callbacks(self) -> None:
        """The call ended: run the done callbacks, once."""
        with self._lock:
            self.finished = True
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one failing callback must not keep the others (a slot's release) from running
                log.exception("a call's done callback failed")


def _requests(sync: SyncContext) -> Iterator[Any]:
    """The call's request stream for handler code on an executor thread: each read runs on the loop."""
    while True:
        if sync.ended is not None:
            raise StreamEnded(sync.ended[1])
        future = asyncio.run_coroutine_threadsafe(sync.aio.read(), sync.loop)
        sync.pending(future.cancel)
        try:
            message = future.result()
        except (concurrent.futures.CancelledError, asyncio.CancelledError, grpc.RpcError, grpc.aio.AbortError,
                RuntimeError) as exc:   # ended by the service, cancelled by the client, or a closed loop
            raise StreamEnded(sync.ended[1] if sync.ended else f"the request stream ended: {exc!r}") from None
        finally:
            sync.pending(None)
        if message is grpc.aio.EOF:
            return
        yield message


def _close(responses: Iterator[Any]) -> None:
    """Close a response generator; one still running in the executor (its call was cancelled meanwhile) is
    left to the garbage collector, which closes it once it returns (its slot is freed by a done callback)."""
    close = getattr(responses, "close", None)
    if close is None:
        return
    try:
        close()
    except ValueError:  # "generator already executing"
        log.debug("a cancelled call's response generator is still running; closed when it returns")


def _when_done(context: grpc.aio.ServicerContext[Any, Any], sync: SyncContext) -> None:
    """Run the synchronous code's done callbacks (a slot's release) when the call ends, however it ends."""
    context.add_done_callback(cast(Any, lambda _call: sync.run_callbacks()))


async def _finish(sync: SyncContext) -> None:
    """Apply what the synchronous code recorded: the trailing metadata, and a status that ends the call."""
    status = sync.ended or sync.status
    if sync.trailing:
        sync.aio.set_trailing_metadata(sync.trailing)
    if status is not None and status[0] != grpc.StatusCode.OK:
        await sync.aio.abort(status[0], status[1])


class Bridge:
    """Turns synchronous method handlers into `grpc.aio` ones, running them inline or in `executor`."""

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self.executor = executor

    def handler(self, handler: grpc.RpcMethodHandler[Any, Any], *, inline: bool) -> grpc.RpcMethodHandler[Any, Any]:
        """The `grpc.aio` handler of `handler`'s behaviour, inline on the loop or in the executor."""
        kwargs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary, inline, False), **kwargs)
        if handler.stream_unary:  # a stream is read message by message: never on the loop
            return grpc.stream_unary_rpc_method_handler(self._unary(handler.stream_unary, False, True), **kwargs)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream, inline, False), **kwargs)
        if handler.stream_stream:
            return grpc.stream_stream_rpc_method_handler(self._stream(handler.stream_stream, False, True), **kwargs)
        raise TypeError(f"a gRPC method handler with no behaviour: {handler!r}")

    async def _run(self, inline: bool, fn: Callable[..., Any], *args: Any) -> Any:
        if inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _unary(self, behaviour: Callable[[Any, Any], Any], inline: bool, streamed: bool) -> Callable[..., Any]:
        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            sync = SyncContext(context, asyncio.get_running_loop(), eager=not inline)
            if inline:   # runs to its end here, with no await between: its callbacks run right after it
                try:
                    try:
                        result = behaviour(request, sync)
                    except Aborted:
                        result = None
                finally:
                    sync.run_callbacks()
                await _finish(sync)
                return result
            _when_done(context, sync)
            result = None
            try:
                result = await self._run(False, behaviour, _requests(sync) if streamed else request, sync)
            except Aborted:
                pass
            await _finish(sync)
            return result

        return call

    def _stream(self, behaviour: Callable[[Any, Any], Any], inline: bool, streamed: bool) -> Callable[..., Any]:
        async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            loop = asyncio.get_running_loop()
            sync = SyncContext(context, loop)
            _when_done(context, sync)
            responses: Iterator[Any] | None = None
            try:
                responses = iter(await self._run(inline, behaviour, _requests(sync) if streamed else request, sync))
                while sync.ended is None:
                    item = await self._run(inline, next, responses, _DONE)
                    if item is _DONE:
                        break
                    write = asyncio.ensure_future(context.write(item))
                    sync.pending(write.cancel)
                    try:
                        await write
                    except asyncio.CancelledError:
                        if sync.ended is None:
                            raise   # the call itself was cancelled (its client went away)
                    finally:
                        sync.pending(None)
            except Aborted:
                pass
            finally:
                if responses is not None:
                    await self._run(inline, _close, responses)   # its finally blocks: a slot given back
            await _finish(sync)

        return call
