"""The aggregation service's job events, as the coordinator's round loops wait on them.

One server stream per coordinator (`AggregationEvents.Watch`): every accepted upload, opened or closed
round and published version arrives as a job snapshot the moment it happens, so a round closes as soon
as its quorum is in instead of at the next poll. The stream is an accelerator, never the truth: a loop
that waits here always looks at the service's RoundStatus (or BufferStatus) when it wakes, and it wakes
at the latest after its safety poll interval (seconds) or at its deadline, so a lost event or a broken
stream costs seconds, never a stalled round. A broken stream is reopened with a backoff.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Protocol

from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.retry import Backoff

log = logging.getLogger(__name__)

_RECONNECT = Backoff(initial_s=0.2, max_s=5.0)


class EventSource(Protocol):
    """What the watcher needs of the aggregation service's client (`AggregatorClient.watch`)."""

    def watch(self) -> Iterator[pb.JobChanges]:
        """The service's job events until the stream breaks; cancellable like any grpc server stream."""
        ...


class JobWatcher:
    """Keeps the newest snapshot of every job and wakes the loop waiting on it."""

    def __init__(self, aggregator: EventSource) -> None:
        """`aggregator`: its `watch()` opens the stream."""
        self.aggregator = aggregator
        self._lock = threading.Lock()
        self._latest: dict[str, pb.JobSnapshot] = {}
        self._wakes: dict[str, threading.Event] = {}
        self._stop = threading.Event()
        self._call: Iterator[pb.JobChanges] | None = None
        self._thread = threading.Thread(target=self._run, name="aggregator-events", daemon=True)
        self.connected = threading.Event()

    def start(self) -> None:
        """Open the stream in a thread of its own, and keep it open."""
        self._thread.start()

    def stop(self) -> None:
        """End the stream (a grpc server stream is also a call: `cancel()` ends it) and its thread."""
        self._stop.set()
        cancel = getattr(self._call, "cancel", None)
        if cancel is not None:
            cancel()
        if self._thread.ident is not None:  # a coordinator stopped without being started has no stream
            self._thread.join(timeout=10)

    def latest(self, job_id: str) -> pb.JobSnapshot | None:
        """The newest snapshot of the job the stream brought (None: none since the stream last broke)."""
        with self._lock:
            return self._latest.get(job_id)

    def poke(self, job_id: str) -> None:
        """Wake the job's loop for a reason the service does not see (a worker's refusal on the control queue)."""
        self._wake(job_id).set()

    def wait(self, job_id: str, timeout: float) -> bool:
        """Until the job changes (True) or `timeout` passes (False); a change that came before counts once."""
        wake = self._wake(job_id)
        woke = wake.wait(max(0.0, timeout))
        wake.clear()
        return woke

    def _wake(self, job_id: str) -> threading.Event:
        with self._lock:
            return self._wakes.setdefault(job_id, threading.Event())

    def _run(self) -> None:
        failures = 0
        broke = False
        while not self._stop.is_set():
            try:
                self._call = self.aggregator.watch()
                for message in self._call:
                    self.connected.set()
                    failures = 0
                    if broke:  # the service may have restarted without its state: every waiting loop asks it now
                        broke = False
                        with self._lock:
                            self._latest.clear()  # what the broken stream said may be gone with the service
                            wakes = list(self._wakes.values())
                        for wake in wakes:
                            wake.set()
                    for snapshot in message.jobs:
                        with self._lock:
                            self._latest[snapshot.job_id] = snapshot
                        self._wake(snapshot.job_id).set()
                    if self._stop.is_set():
                        return
            except Exception as exc:  # the stream broke (service restarting, network): reopen it
                if self._stop.is_set():
                    return
                log.debug("aggregation events stream ended (%s); reopening", exc)
            broke = True
            self.connected.clear()
            self._stop.wait(_RECONNECT.delay(failures))
            failures += 1
