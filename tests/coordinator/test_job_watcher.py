"""The coordinator's view of the aggregation service's job events (coordinator/events.py): when the stream
comes back after a break, every waiting job loop is woken, since the service may have restarted without its
state and will never send an event for a job it lost (the loop then asks, and reinstalls it)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from fedbroker.coordinator.events import JobWatcher
from fedbroker.proto import fedbroker_pb2 as pb


class Stream:
    """A server stream as grpc gives it: iterable, and cancellable (what JobWatcher.stop calls)."""

    def __init__(self, messages: Iterator[Any], done: threading.Event) -> None:
        self._messages, self._done = messages, done

    def __iter__(self) -> Iterator[Any]:
        return self._messages

    def cancel(self) -> None:
        self._done.set()


class Service:
    """watch(): first a stream with job j's snapshot that breaks when the test says, then (a restarted service
    with no jobs) a stream with one empty message that stays open until the test ends."""

    def __init__(self) -> None:
        self.calls = 0
        self.break_now = threading.Event()
        self.done = threading.Event()

    def watch(self) -> Stream:
        self.calls += 1
        return Stream(self._first() if self.calls == 1 else self._restarted(), self.done)

    def _first(self) -> Iterator[Any]:
        yield pb.JobChanges(jobs=[pb.JobSnapshot(job_id="j", round=1, open=True)])
        self.break_now.wait(30)
        raise ConnectionError("the service went away")

    def _restarted(self) -> Iterator[Any]:
        yield pb.JobChanges()
        self.done.wait(30)


def test_a_reopened_event_stream_wakes_every_waiting_job() -> None:
    service = Service()
    watcher = JobWatcher(service)
    assert not watcher.wait("j", 0)  # nothing yet
    watcher.start()
    try:
        assert watcher.wait("j", 10)  # j's snapshot
        service.break_now.set()
        # the stream broke and came back with nothing about j: j's loop is woken all the same
        assert watcher.wait("j", 10), "the loop waiting on j was not woken when the stream came back"
        assert service.calls == 2
        assert not watcher.wait("j", 0.2)  # and not again without a change
    finally:
        service.done.set()
        watcher.stop()
