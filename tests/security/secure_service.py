"""The aggregation service on a real loopback gRPC port with a client to it, for tests that run secure rounds
against it step by step (each worker's `SecureRun` in the test's own threads)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.rpc.aggregation_client import AggregatorClient


@contextmanager
def secure_service(tmp_path: Path, *, unmask_s: float) -> Iterator[tuple[RoundBook, AggregatorClient]]:
    """The service's round book (spool under `tmp_path`; a close waits `unmask_s` for the unmask shares) and a
    client on its port; all stopped on leaving."""
    book = RoundBook(spool_dir=tmp_path / "spool", secure_unmask_s=unmask_s)
    server, port = serve(book)
    client = AggregatorClient(f"127.0.0.1:{port}")
    try:
        yield book, client
    finally:
        client.close()
        server.stop(grace=0)
        book.stop()
