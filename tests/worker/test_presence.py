"""A worker's presence loop (worker/presence.py) against a stub service on a fake clock, no sleeps: it beats at the
due time the service answers and never earlier, reports the agent's state, clamps absurd answers, backs off an
outage, honours `heartbeat_early`'s retry-after, waits the longest after a refusal for good, and stops at once.
The forged and flooding beats the service refuses are pinned against the RPC in
tests/aggregators/test_aio_control_plane.py, and against real processes in tests/integration/test_presence_e2e.py."""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable

import grpc
import pytest

from fedbroker.worker import metrics
from fedbroker.worker.presence import BACKOFF, EARLY, MAX_WAIT_S, MIN_WAIT_S, PresenceLoop, clamp_wait


class Refusal(grpc.RpcError):
    """A failed call as gRPC raises it: a status code, details and the service's trailers."""

    def __init__(self, code: grpc.StatusCode, reason: str = "", retry_after_ms: float | None = None) -> None:
        super().__init__(code.name)
        self._code, self._trailers = code, []
        if reason:
            self._trailers.append(("fedbroker-reason", reason))
        if retry_after_ms is not None:
            self._trailers.append(("fedbroker-retry-after-ms", str(retry_after_ms)))

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"{self._code.name.lower()} (stub)"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._trailers)


class StubService:
    """Answers each beat from a script (a due time in seconds, or an exception to raise), on a fake clock that
    only the loop's waits move; a beat before the due time it last gave is recorded as early."""

    def __init__(self, script: list[float | Exception]) -> None:
        self.script = list(script)
        self.now = 0.0
        self.due = -math.inf
        self.beats: list[tuple[float, str, str]] = []   # (when, worker, state)
        self.early: list[float] = []

    def keep_alive(self, worker_id: str, state: str = "idle", *, timeout_s: float | None = None) -> float:
        assert timeout_s is not None and timeout_s > 0   # every beat has a deadline
        self.beats.append((self.now, worker_id, state))
        if self.now < self.due:
            self.early.append(self.now)
        answer = self.script.pop(0)
        if isinstance(answer, Exception):
            raise answer
        if math.isfinite(answer):
            self.due = self.now + answer
        return answer


def run(service: StubService, *, beats: int, state: Callable[[], str] = lambda: "idle",
        worker_id: str = "w-presence") -> list[float]:
    """The loop's waits over `beats` beats, each wait moving the fake clock (no thread, no sleep)."""
    waits: list[float] = []

    def wait(seconds: float) -> bool:
        waits.append(seconds)
        service.now += seconds
        return len(waits) >= beats   # True: stop

    PresenceLoop(worker_id, channel=lambda: service, state=state, wait=wait, rng=random.Random(7)).run()
    return waits


def count(worker_id: str, outcome: str) -> float:
    return metrics.PRESENCE_BEATS.labels(worker_id, outcome)._value.get()


def test_the_loop_beats_at_the_due_time_the_service_answers_never_earlier_with_the_agents_state():
    service = StubService([27.5, 31.0, 24.25, 36.0])
    states = iter(["idle", "training", "uploading", "idle"])
    waits = run(service, beats=4, state=lambda: next(states), worker_id="w-paced")
    assert waits == [27.5, 31.0, 24.25, 36.0]
    assert [when for when, _, _ in service.beats] == [0.0, 27.5, 58.5, 82.75]
    assert [(w, s) for _, w, s in service.beats] == [("w-paced", "idle"), ("w-paced", "training"),
                                                      ("w-paced", "uploading"), ("w-paced", "idle")]
    assert service.early == []
    assert count("w-paced", "accepted") == 4 and count("w-paced", "failed") == 0


@pytest.mark.parametrize(("answer", "kept"), [(0.0, MIN_WAIT_S), (-30.0, MIN_WAIT_S), (-math.inf, MIN_WAIT_S),
                                              (0.2, MIN_WAIT_S), (math.nan, MAX_WAIT_S), (math.inf, MAX_WAIT_S),
                                              (3 * 365 * 86400.0, MAX_WAIT_S), (45.0, 45.0)])
def test_an_absurd_due_time_is_clamped(answer, kept):
    """A service answering 0, a negative number, NaN or years neither makes the worker hammer it nor silences it."""
    assert clamp_wait(answer) == kept
    assert run(StubService([answer, 30.0]), beats=2) == [kept, 30.0]


def test_an_outage_backs_off_exponentially_then_the_due_time_rules_again(caplog):
    unavailable = Refusal(grpc.StatusCode.UNAVAILABLE)
    service = StubService([unavailable, unavailable, ValueError("Cannot invoke RPC on closed channel!"),
                           Refusal(grpc.StatusCode.DEADLINE_EXCEEDED), unavailable, unavailable, unavailable,
                           unavailable, 30.0])
    with caplog.at_level(logging.DEBUG, logger="fedbroker.worker.presence"):
        waits = run(service, beats=9, worker_id="w-outage")
    for retry, wait in enumerate(waits[:8]):
        ceiling = BACKOFF.ceiling(retry)
        assert max(MIN_WAIT_S, ceiling / 2) <= wait <= ceiling, (retry, wait)
    assert waits[7] >= 30.0 and waits[8] == 30.0   # capped at BACKOFF.max_s (60), then paced again
    assert count("w-outage", "failed") == 8 and count("w-outage", "accepted") == 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4   # one line per kind of trouble (unavailable, closed channel, deadline, unavailable)
    assert any("accepted again" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)


def test_heartbeat_early_waits_the_retry_after_the_service_gives_clamped():
    """A restarted worker beats before the due time the service holds for it: it waits what the refusal says."""
    early = Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, EARLY, retry_after_ms=12_000)
    absurd = Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, EARLY, retry_after_ms=1e15)
    nothing = Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, EARLY)
    waits = run(StubService([early, absurd, nothing, 30.0]), beats=4, worker_id="w-early")
    assert waits[:2] == [12.0, MAX_WAIT_S]
    assert MIN_WAIT_S <= waits[2] <= BACKOFF.ceiling(0)   # no retry-after: a backoff, never a busy loop
    assert waits[3] == 30.0
    assert count("w-early", "early") == 3


def test_a_full_or_busy_service_waits_at_least_its_retry_after():
    full = Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, "presence_full", retry_after_ms=5_000)
    waits = run(StubService([full, full, full, full, full, full, 30.0]), beats=7)
    assert all(wait >= 5.0 for wait in waits[:6])
    assert waits[5] >= BACKOFF.ceiling(5) / 2   # the backoff still grows past the retry-after


@pytest.mark.parametrize("code", [grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.UNIMPLEMENTED])
def test_a_refusal_no_retry_changes_soon_waits_the_longest_and_logs_once(code, caplog):
    """Beating as another worker (a token naming someone else), no valid token, or a service without KeepAlive."""
    refused = Refusal(code, code.name.lower())
    with caplog.at_level(logging.DEBUG, logger="fedbroker.worker.presence"):
        waits = run(StubService([refused, refused, refused]), beats=3, worker_id=f"w-{code.name}")
    assert waits == [MAX_WAIT_S] * 3
    assert count(f"w-{code.name}", "refused") == 3
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1


def test_no_channel_yet_is_looked_for_again_after_a_backoff():
    waits: list[float] = []
    loop = PresenceLoop("w-none", channel=lambda: None, state=lambda: "idle",
                        wait=lambda s: waits.append(s) or len(waits) >= 3, rng=random.Random(1))
    loop.run()
    assert [MIN_WAIT_S <= w <= BACKOFF.ceiling(i) for i, w in enumerate(waits)] == [True] * 3


def test_stop_ends_the_loop_during_its_wait_and_during_a_call():
    """A worker's shutdown never waits out a heartbeat interval: `stop` wakes the wait; a call in flight is the
    channel's, which the agent closes first (here: released, it raises as a call on a closed channel does)."""
    calls, calling, release = [], threading.Event(), threading.Event()

    class Service:
        def keep_alive(self, worker_id: str, state: str = "idle", *, timeout_s: float | None = None) -> float:
            calls.append(worker_id)
            if worker_id == "w-stop":
                return MAX_WAIT_S
            calling.set()
            release.wait(60)
            raise ValueError("Cannot invoke RPC on closed channel!")

    waiting = PresenceLoop("w-stop", channel=Service, state=lambda: "idle")
    waiting.start()
    assert wait_until(lambda: calls == ["w-stop"]), "the first beat never came"
    waiting.stop(timeout_s=60)
    assert waiting._thread is not None and not waiting._thread.is_alive()   # woke from its 600 s wait at once
    assert calls == ["w-stop"]

    in_call = PresenceLoop("w-stop-in-call", channel=Service, state=lambda: "idle")
    in_call.start()
    assert calling.wait(60), "the beat never started"
    release.set()   # the agent closed the channel under the call
    in_call.stop(timeout_s=60)
    assert in_call._thread is not None and not in_call._thread.is_alive()


def wait_until(condition: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """A condition, polled: a hang guard, never a timing the test relies on."""
    done = threading.Event()
    for _ in range(int(timeout_s * 50)):
        if condition():
            return True
        done.wait(0.02)
    return condition()
