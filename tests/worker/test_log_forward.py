"""A worker forwards its own warnings and errors to the coordinator: WARNING and above only, text cut short and no
traceback, rate-limited with the count of what it dropped, never blocking the caller and never looping on what the
publish itself logs; and `worker.forward_logs: false` (or the demo's shared process) forwards nothing."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from fedbroker.bus import envelope
from fedbroker.config import load_config
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker.log_forward import MAX_MESSAGE_CHARS, LogForwarder, install, remove

pytestmark = pytest.mark.timeout(60)


class Sink:
    """A publish that keeps what it was given (optionally failing, or logging while it publishes)."""

    def __init__(self, *, log_inside: bool = False, fail: bool = False) -> None:
        self.sent: list[pb.SiteLog] = []
        self.log_inside, self.fail = log_inside, fail
        self.lock = threading.Lock()

    def __call__(self, body: bytes) -> None:
        if self.log_inside:
            logging.getLogger("fedbroker.bus").warning("publishing is slow")
        if self.fail:
            raise ConnectionError("broker away")
        with self.lock:
            self.sent.append(envelope.decode(body, expect=("site_log",)).site_log)


def record(level: int, message: str, *args: Any, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("secret value 42")
        except ValueError:
            import sys

            exc_info = sys.exc_info()
    return logging.LogRecord("fedbroker.worker.agent", level, __file__, 1, message, args, exc_info)


def test_only_warnings_and_above_go_cut_short_without_a_traceback() -> None:
    sink = Sink()
    forwarder = LogForwarder("w0", sink)
    try:
        for r in (record(logging.INFO, "routine"), record(logging.WARNING, "disk at %d%%", 91),
                  record(logging.ERROR, "x" * 5000), record(logging.CRITICAL, "boom", exc=True)):
            if r.levelno >= forwarder.level:
                forwarder.handle(r)
        assert forwarder.drain()
    finally:
        forwarder.close()
    assert [(s.level, s.worker_id, s.logger) for s in sink.sent] == [
        ("WARNING", "w0", "fedbroker.worker.agent"), ("ERROR", "w0", "fedbroker.worker.agent"),
        ("CRITICAL", "w0", "fedbroker.worker.agent")]
    assert sink.sent[0].message == "disk at 91%"
    assert len(sink.sent[1].message) == MAX_MESSAGE_CHARS and sink.sent[1].message.endswith("…")
    assert sink.sent[2].message == "boom" and "secret value" not in sink.sent[2].message  # no traceback travels


def test_a_burst_beyond_the_rate_is_dropped_and_the_next_record_says_how_many() -> None:
    clock = [0.0]
    sink = Sink()
    forwarder = LogForwarder("w0", sink, burst=3, per_minute=60.0, clock=lambda: clock[0])
    try:
        for i in range(10):
            forwarder.handle(record(logging.WARNING, f"warning {i}"))
        assert forwarder.drain() and forwarder.dropped == 7
        clock[0] += 1.0  # one more token
        forwarder.handle(record(logging.WARNING, "later"))
        assert forwarder.drain()
    finally:
        forwarder.close()
    assert [(s.message, s.dropped_before) for s in sink.sent] == [
        ("warning 0", 0), ("warning 1", 0), ("warning 2", 0), ("later", 7)]


def test_what_the_publish_logs_is_not_forwarded_and_a_failed_publish_is_counted() -> None:
    sink = Sink(log_inside=True)
    forwarder = install("w0", sink)  # on the root logger, as a worker process has it: held until it registered
    try:
        logging.getLogger("fedbroker.worker").warning("one real warning")
        assert not forwarder.drain(timeout=0.2) and sink.sent == []
        forwarder.start_sending()
        assert forwarder.drain()
    finally:
        remove(forwarder)
    assert [s.message for s in sink.sent] == ["one real warning"]  # not "publishing is slow", not a loop
    assert forwarder not in logging.getLogger().handlers

    failing = LogForwarder("w0", Sink(fail=True))
    try:
        failing.handle(record(logging.ERROR, "lost"))
        assert failing.drain() and failing.dropped == 1
    finally:
        failing.close()


def test_forward_logs_is_a_worker_setting_on_by_default() -> None:
    assert load_config(environ={}).worker.forward_logs is True
    assert load_config(environ={"FEDBROKER__WORKER__FORWARD_LOGS": "false"}).worker.forward_logs is False


def test_the_demos_in_process_workers_forward_nothing(tmp_path: Any) -> None:
    """A worker given the demo's bus shares its process with the coordinator: no forwarder goes on the root logger."""
    from fedbroker.app.launch import start_worker
    from fedbroker.bus import InProcessBus

    bus = InProcessBus(namespace="forward-test")
    config = load_config(environ={}, overrides={"worker.id": "w0", "worker.device": "cpu",
                                                 "worker.ledger_path": str(tmp_path / "ledger.json")})
    before = list(logging.getLogger().handlers)
    agent = start_worker(config, bus=bus)
    try:
        assert agent.log_forwarder is None and logging.getLogger().handlers == before
    finally:
        agent.stop()
        bus.close()
