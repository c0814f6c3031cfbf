"""A TLS-terminating TCP forwarder for tests: amqps:// clients talk TLS to it on loopback, it talks plain AMQP
to the shared RabbitMQ, so AMQP over TLS is tested without touching the broker's configuration."""

from __future__ import annotations

import asyncio
import ssl
import threading
from pathlib import Path


class TlsProxy:
    def __init__(self, cert: Path, key: Path, *, upstream: tuple[str, int] = ("127.0.0.1", 5672),
                 port: int = 0) -> None:
        """`port`: where to listen on loopback (0: any free port)."""
        self.upstream = upstream
        self._port = port
        self.connections = 0
        self.handshake_failures = 0
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._context.load_cert_chain(str(cert), str(key))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tls-proxy", daemon=True)
        self._thread.start()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _start(self) -> asyncio.AbstractServer:
        return await asyncio.start_server(self._handle, "127.0.0.1", self._port, ssl=self._context,
                                          ssl_handshake_timeout=5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
            if task is not None:
                self._tasks.discard(task)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
            pass
        finally:
            try:
                writer.write_eof() if writer.can_write_eof() else writer.close()
            except (OSError, RuntimeError):
                pass

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
