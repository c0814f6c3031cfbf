"""A site's own warnings and errors, forwarded to the coordinator so its operator sees them (`fedbroker sites
logs`) without a login on the site's machine; `worker.forward_logs: false` turns it off.

Only what a log line is travels: its level (WARNING and above), logger name, text (cut to MAX_MESSAGE_CHARS) and
time, never a traceback, never data. They go over the worker's own control channel, which the broker binds to the
site's broker user. At most `burst` records at once and `per_minute` after that: the rest are dropped here and
counted, and the next record sent says how many (`dropped_before`). Records wait in a bounded queue for a thread
of their own, so logging never blocks on the broker (a record logged while publishing one, by the bus itself, is
not forwarded: no loop). A forwarder installed `held` keeps what is logged before the worker registered (the
coordinator files records only for a registered site) until `start_sending` (not `release`: logging.Handler has one).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from fedbroker.bus import envelope
from fedbroker.proto import fedbroker_pb2 as pb

MAX_MESSAGE_CHARS = 400
MAX_LOGGER_CHARS = 100
QUEUE_LIMIT = 100           # records waiting to be sent; more are dropped (and counted)
BURST = 10                  # records sent at once ...
PER_MINUTE = 10.0           # ... and after that, this many a minute


class LogForwarder(logging.Handler):
    """A logging handler that publishes WARNING+ records as `SiteLog` control messages through `publish`."""

    def __init__(self, worker_id: str, publish: Callable[[bytes], None], *, burst: int = BURST,
                 per_minute: float = PER_MINUTE, clock: Callable[[], float] = time.monotonic,
                 held: bool = False) -> None:
        super().__init__(level=logging.WARNING)
        self.worker_id = worker_id
        self._publish = publish
        self._burst, self._per_s, self._clock = float(burst), per_minute / 60.0, clock
        self._tokens, self._at = float(burst), clock()
        self._queue: collections.deque[pb.SiteLog] = collections.deque()
        self._cond = threading.Condition()
        self._dropped = 0
        self._inflight = False
        self._sending = threading.local()  # set on the sender thread while it publishes
        self._stop = False
        self._held = held
        self._thread = threading.Thread(target=self._run, name=f"log-forward-{worker_id}", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Records dropped since the last one sent (rate limit, full queue)."""
        with self._cond:
            return self._dropped

    def emit(self, record: logging.LogRecord) -> None:
        """Queue the record if the rate allows (never blocks, never raises)."""
        if getattr(self._sending, "active", False):
            return  # logged by the publish itself (a bus that cannot reach the broker): would loop
        try:
            message = record.getMessage()
        except Exception:  # a record whose arguments do not fit its format: its bare format string
            message = str(record.msg)
        log = pb.SiteLog(worker_id=self.worker_id, time_unix=record.created, level=_level(record.levelno),
                         logger=record.name[:MAX_LOGGER_CHARS], message=_cut(message))
        with self._cond:
            if self._stop or not self._take() or len(self._queue) >= QUEUE_LIMIT:
                self._dropped += 1
                return
            log.dropped_before, self._dropped = self._dropped, 0
            self._queue.append(log)
            self._cond.notify()

    def _take(self) -> bool:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._per_s)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and (self._held or not self._queue):
                    self._cond.wait()
                if self._stop and not self._queue:
                    return
                log = self._queue.popleft()
                self._inflight = True
            self._sending.active = True
            try:
                self._publish(envelope.encode(site_log=log))
            except Exception:  # the broker out of reach: the record is lost, the site's own log still has it
                with self._cond:
                    self._dropped += 1
            finally:
                self._sending.active = False
                with self._cond:
                    self._inflight = False

    def start_sending(self) -> None:
        """Start sending (a forwarder installed `held`, once its worker has registered)."""
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued record was handed to the bus (or `timeout` passed); whether it was."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._cond:
                if not self._queue and not self._inflight:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        """Send what is queued (for a few seconds at most), then stop the thread."""
        self.drain(timeout=5.0)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)
        super().close()


def _level(levelno: int) -> str:
    return "CRITICAL" if levelno >= logging.CRITICAL else "ERROR" if levelno >= logging.ERROR else "WARNING"


def _cut(text: str) -> str:
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


def install(worker_id: str, publish: Callable[[bytes], None]) -> LogForwarder:
    """A forwarder on the root logger, so every WARNING+ of this worker process is forwarded, held until the worker
    has registered (WorkerAgent.start calls `start_sending`); `remove` it at stop."""
    handler = LogForwarder(worker_id, publish, held=True)
    logging.getLogger().addHandler(handler)
    return handler


def remove(handler: LogForwarder) -> None:
    """Take the forwarder off the root logger and stop it."""
    logging.getLogger().removeHandler(handler)
    handler.close()
