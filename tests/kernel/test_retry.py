"""The one retry helper: backoff shape, jitter bounds, which errors it retries, and when it gives up.

Time is fake (a clock that only `sleep` moves), so the tests are exact and take no wall time.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import grpc
import pytest

from fedbroker.errors import ConfigError
from fedbroker.retry import Backoff, retry_call
from fedbroker.rpc.plumbing import RemoteError, call_with_retry


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Flaky(Exception):
    pass


class Failing:
    """Raises `error(n)` on call n (from 1) until `succeed_on`, then returns "done"."""

    def __init__(self, succeed_on: int | None = None, error: Callable[[int], Exception] = Flaky) -> None:
        self.calls = 0
        self.succeed_on = succeed_on
        self.error = error

    def __call__(self) -> str:
        self.calls += 1
        if self.succeed_on is not None and self.calls >= self.succeed_on:
            return "done"
        raise self.error(self.calls)


def is_flaky(error: Exception) -> bool:
    return isinstance(error, Flaky)


def test_delays_grow_exponentially_and_stay_under_the_cap() -> None:
    backoff, time = Backoff(initial_s=1.0, max_s=8.0), FakeTime()
    with pytest.raises(Flaky):
        retry_call(Failing(), backoff=backoff, retryable=is_flaky, attempts=8, sleep=time.sleep, clock=time.clock,
                   rng=random.Random(1))
    ceilings = [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0]
    assert [backoff.ceiling(i) for i in range(7)] == ceilings
    assert len(time.sleeps) == 7
    for slept, ceiling in zip(time.sleeps, ceilings):
        assert ceiling / 2 <= slept <= ceiling <= backoff.max_s


def test_jitter_stays_within_half_and_whole_ceiling_for_a_seeded_rng() -> None:
    backoff = Backoff(initial_s=0.5, max_s=30.0)
    draws = [backoff.delay(3, rng=random.Random(42 + i)) for i in range(500)]
    assert all(2.0 <= d <= 4.0 for d in draws)  # ceiling 0.5 * 2**3 = 4
    assert min(draws) < 2.2 and max(draws) > 3.8  # it spreads over the whole band, not one point
    again = [backoff.delay(3, rng=random.Random(42 + i)) for i in range(500)]
    assert draws == again  # a seeded rng makes it repeatable


def test_a_wait_never_exceeds_at_most() -> None:
    backoff = Backoff(initial_s=1.0, max_s=30.0)
    rng = random.Random(3)
    assert all(1.5 <= backoff.delay(5, rng=rng, at_most=3.0) <= 3.0 for _ in range(200))
    assert backoff.delay(5, rng=rng, at_most=-1.0) == 0.0  # a deadline already passed: no wait at all


def test_a_huge_retry_count_stays_at_the_cap() -> None:
    assert Backoff(initial_s=0.1, max_s=5.0).ceiling(10_000) == 5.0


def test_a_non_retryable_error_propagates_at_once() -> None:
    fn, time = Failing(error=KeyError), FakeTime()
    with pytest.raises(KeyError):
        retry_call(fn, backoff=Backoff(initial_s=1.0, max_s=2.0), retryable=is_flaky, attempts=5,
                   sleep=time.sleep, clock=time.clock)
    assert fn.calls == 1 and time.sleeps == []


def test_the_deadline_stops_retrying_and_is_never_slept_past() -> None:
    fn, time = Failing(), FakeTime()
    with pytest.raises(Flaky) as info:
        retry_call(fn, backoff=Backoff(initial_s=1.0, max_s=100.0), retryable=is_flaky, deadline=20.0,
                   sleep=time.sleep, clock=time.clock, rng=random.Random(5))
    assert time.now <= 20.0 and sum(time.sleeps) == pytest.approx(time.now)
    assert len(time.sleeps) >= 2  # it did retry before the deadline
    assert info.value.args == (fn.calls,)  # the last error, after the last try


def test_the_last_error_is_raised_when_attempts_run_out() -> None:
    fn, time = Failing(), FakeTime()
    with pytest.raises(Flaky) as info:
        retry_call(fn, backoff=Backoff(initial_s=0.1, max_s=1.0), retryable=is_flaky, attempts=4,
                   sleep=time.sleep, clock=time.clock)
    assert fn.calls == 4 and len(time.sleeps) == 3
    assert info.value.args == (4,)


def test_a_call_that_recovers_returns_its_value_and_each_retry_is_announced() -> None:
    fn, time = Failing(succeed_on=3), FakeTime()
    told: list[tuple[int, int, float]] = []
    result = retry_call(fn, backoff=Backoff(initial_s=0.1, max_s=1.0), retryable=is_flaky, attempts=5,
                        on_retry=lambda error, retry, delay: told.append((error.args[0], retry, delay)),
                        sleep=time.sleep, clock=time.clock)
    assert result == "done" and fn.calls == 3
    assert [(error, retry) for error, retry, _ in told] == [(1, 1), (2, 2)]
    assert [delay for *_, delay in told] == time.sleeps


def test_one_attempt_calls_once() -> None:
    fn, time = Failing(), FakeTime()
    with pytest.raises(Flaky):
        retry_call(fn, backoff=Backoff(initial_s=0.1, max_s=1.0), retryable=is_flaky, attempts=1, sleep=time.sleep)
    assert fn.calls == 1 and time.sleeps == []


def test_a_retry_without_any_limit_is_refused() -> None:
    with pytest.raises(ConfigError, match="attempts"):
        retry_call(Failing(), backoff=Backoff(initial_s=0.1, max_s=1.0), retryable=is_flaky)
    with pytest.raises(ConfigError, match="attempts: must be an integer >= 1"):
        retry_call(Failing(), backoff=Backoff(initial_s=0.1, max_s=1.0), retryable=is_flaky, attempts=0)


@pytest.mark.parametrize(("options", "field"), [
    ({"initial_s": 0.0, "max_s": 1.0}, "initial_s"),
    ({"initial_s": float("inf"), "max_s": float("inf")}, "initial_s"),
    ({"initial_s": 2.0, "max_s": 1.0}, "max_s"),
    ({"initial_s": 1.0, "max_s": float("nan")}, "max_s"),
    ({"initial_s": 1.0, "max_s": 2.0, "multiplier": 0.5}, "multiplier"),
])
def test_a_backoff_names_the_setting_it_refuses(options: dict[str, float], field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field}: "):
        Backoff(**options)


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, reason: str | None = None, retry_after_ms: str | None = None) -> None:
        self._code, self._reason, self._retry_after = code, reason, retry_after_ms

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "it went wrong"

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:  # type: ignore[override]
        reason = (("fedbroker-reason", self._reason),) if self._reason else ()
        return reason + ((("fedbroker-retry-after-ms", self._retry_after),) if self._retry_after else ())


def test_an_rpc_refusal_becomes_a_remote_error_with_the_servers_reason_without_a_retry() -> None:
    fn = Failing(error=lambda _: FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "round_closed"))
    with pytest.raises(RemoteError) as info:
        call_with_retry(fn, what="upload", idempotent=True)
    assert fn.calls == 1
    assert info.value.reason == "round_closed" and info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert str(info.value) == "upload: FAILED_PRECONDITION: it went wrong"


def test_a_deadline_is_not_retried_where_repeating_is_unsafe_and_one_attempt_never_retries() -> None:
    fn = Failing(error=lambda _: FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED))
    with pytest.raises(RemoteError) as info:
        call_with_retry(fn, what="close round 1", idempotent=False)
    assert fn.calls == 1 and info.value.reason == "deadline_exceeded"
    unavailable = Failing(error=lambda _: FakeRpcError(grpc.StatusCode.UNAVAILABLE))
    with pytest.raises(RemoteError):
        call_with_retry(unavailable, what="status", idempotent=True, attempts=1)
    assert unavailable.calls == 1


def test_the_last_wait_before_a_deadline_is_shortened_for_a_last_try_at_the_deadline() -> None:
    fn, time = Failing(), FakeTime()
    with pytest.raises(Flaky):
        retry_call(fn, backoff=Backoff(initial_s=3.0, max_s=3.0), retryable=is_flaky, deadline=10.0,
                   sleep=time.sleep, clock=time.clock, rng=random.Random(0))
    assert time.now == pytest.approx(10.0)  # it gave up at the deadline, not up to one wait before it
    assert 0 < time.sleeps[-1] <= 3.0 and fn.calls == len(time.sleeps) + 1


def test_a_call_with_a_deadline_outlasts_the_attempt_budget_and_gives_up_exactly_at_the_deadline() -> None:
    """A worker's upload while the service is down (or its spool disk full): retried until the round's deadline,
    not RPC_ATTEMPTS times."""
    from fedbroker.rpc.plumbing import RPC_ATTEMPTS

    fn, time = Failing(error=lambda _: FakeRpcError(grpc.StatusCode.UNAVAILABLE, "spool_full")), FakeTime()
    time.now = 1000.0
    with pytest.raises(RemoteError) as info:
        call_with_retry(fn, what="upload", idempotent=True, deadline_unix=1045.0, clock=time.clock, sleep=time.sleep)
    assert fn.calls > RPC_ATTEMPTS and time.now == pytest.approx(1045.0)
    assert info.value.reason == "spool_full" and info.value.code == grpc.StatusCode.UNAVAILABLE
    back, time = Failing(succeed_on=20, error=lambda _: FakeRpcError(grpc.StatusCode.UNAVAILABLE)), FakeTime()
    assert call_with_retry(back, what="upload", idempotent=True, deadline_unix=600.0, clock=time.clock,
                           sleep=time.sleep) == "done"
    assert back.calls == 20 and time.now < 600.0
    final = Failing(error=lambda _: FakeRpcError(grpc.StatusCode.FAILED_PRECONDITION, "late"))
    with pytest.raises(RemoteError):
        call_with_retry(final, what="upload", idempotent=True, deadline_unix=600.0, clock=time.clock,
                        sleep=time.sleep)
    assert final.calls == 1


def test_a_busy_service_is_retried_within_milliseconds_and_an_outage_after_the_outage_backoff() -> None:
    """`server_busy` is load shedding (a transfer slot frees within a small model's transfer time), not an
    outage: its first waits are BUSY_BACKOFF's, growing to the same cap; a service that is down keeps
    RPC_BACKOFF's. The error of each retry decides its wait."""
    from fedbroker.rpc.plumbing import BUSY_BACKOFF, RPC_BACKOFF

    def run(reasons: list[str | None]) -> list[float]:
        time = FakeTime()
        fn = Failing(succeed_on=len(reasons) + 1,
                     error=lambda n: FakeRpcError(grpc.StatusCode.UNAVAILABLE, reasons[n - 1]))
        assert call_with_retry(fn, what="download", idempotent=True, deadline_unix=1e9, clock=time.clock,
                               sleep=time.sleep) == "done"
        return time.sleeps

    busy = run(["server_busy"] * 4)
    assert [BUSY_BACKOFF.ceiling(i) / 2 <= wait <= BUSY_BACKOFF.ceiling(i) for i, wait in enumerate(busy)] == [True] * 4
    assert sum(busy) <= 0.15 < RPC_BACKOFF.initial_s
    down = run([None, None])
    assert all(RPC_BACKOFF.ceiling(i) / 2 <= wait for i, wait in enumerate(down))
    mixed = run(["server_busy", None, "server_busy"])
    assert mixed[0] <= BUSY_BACKOFF.initial_s and mixed[1] >= RPC_BACKOFF.ceiling(1) / 2 and mixed[2] <= 0.04


def test_a_backoff_can_be_chosen_by_the_error() -> None:
    fn, time = Failing(succeed_on=3), FakeTime()
    short, long = Backoff(initial_s=0.001, max_s=0.001), Backoff(initial_s=100.0, max_s=100.0)
    assert retry_call(fn, backoff=long, retryable=is_flaky, attempts=5, sleep=time.sleep, clock=time.clock,
                      backoff_for=lambda error: short) == "done"
    assert time.sleeps and max(time.sleeps) <= 0.001


@pytest.mark.parametrize("hint, low, high", [("400", 0.25, 0.5), ("1e9", 2.5, 5.0), ("nan", 0.005, 0.01),
                                             ("soon", 0.005, 0.01), ("-3", 0.005, 0.01)])
def test_a_busy_refusal_is_retried_after_the_wait_the_service_asks_for(hint: str, low: float, high: float) -> None:
    """The service's retry-after, jittered to [0.625, 1.25] of it and capped at 5 s; one that is not a
    number of milliseconds >= 0 is ignored (BUSY_BACKOFF's first wait instead)."""
    time = FakeTime()
    fn = Failing(succeed_on=2, error=lambda _: FakeRpcError(grpc.StatusCode.UNAVAILABLE, "server_busy", hint))
    call_with_retry(fn, what="download", idempotent=True, deadline_unix=1e9, clock=time.clock, sleep=time.sleep)
    assert low <= time.sleeps[0] <= high
