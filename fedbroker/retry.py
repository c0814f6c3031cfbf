"""One way to wait and try again: capped exponential backoff with jitter, bounded by attempts or a deadline.

Every retry in the project goes through here (gRPC calls, the bus's reconnects, the coordinator riding out an
aggregation-service outage or a broker outage, a worker's failed task), so the constants differ per caller
but the shape does not, and every wait is jittered: clients that failed together do not retry together.

Jitter is "equal jitter": a wait is drawn uniformly from [ceiling/2, ceiling]. Full jitter ([0, ceiling])
spreads clients a little more, but it can draw a wait near zero, which hammers a peer that is restarting
and makes a backoff's least wait meaningless; equal jitter keeps half the ceiling as a floor and still
spreads a herd over the other half.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fedbroker.errors import ConfigError

T = TypeVar("T")

# 2**60 times any positive initial delay is past every cap; a bigger exponent only risks an overflow.
_MAX_EXPONENT = 60
_RNG = random.Random()  # jitter needs no secrecy; tests pass their own seeded one


@dataclass(frozen=True)
class Backoff:
    """Waits of `initial_s`, `initial_s * multiplier`, … up to `max_s`, each jittered (see the module)."""

    initial_s: float
    max_s: float
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not (isinstance(self.initial_s, (int, float)) and math.isfinite(self.initial_s) and self.initial_s > 0):
            raise ConfigError("initial_s", f"must be a finite number > 0, got {self.initial_s!r}")
        if not (isinstance(self.max_s, (int, float)) and self.max_s >= self.initial_s):
            raise ConfigError("max_s", f"must be >= initial_s ({self.initial_s:g}), got {self.max_s!r}")
        if not (isinstance(self.multiplier, (int, float)) and math.isfinite(self.multiplier) and self.multiplier >= 1):
            raise ConfigError("multiplier", f"must be a finite number >= 1, got {self.multiplier!r}")

    def ceiling(self, retry: int) -> float:
        """The longest wait before retry number `retry` (0 for the first retry), before jitter."""
        return min(self.max_s, self.initial_s * self.multiplier ** min(max(retry, 0), _MAX_EXPONENT))

    def delay(self, retry: int, *, rng: random.Random | None = None, at_most: float | None = None) -> float:
        """A jittered wait in [ceiling/2, ceiling]; `at_most` lowers the ceiling first (e.g. the time left
        before a deadline), so the wait never exceeds it."""
        ceiling = self.ceiling(retry)
        if at_most is not None:
            ceiling = min(ceiling, max(0.0, at_most))
        return (rng or _RNG).uniform(ceiling / 2, ceiling)


def retry_call(
    fn: Callable[[], T],
    *,
    backoff: Backoff,
    retryable: Callable[[Exception], bool],
    attempts: int | None = None,
    deadline: float | None = None,
    on_retry: Callable[[Exception, int, float], None] | None = None,
    sleep: Callable[[float], object] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
    backoff_for: Callable[[Exception], Backoff] | None = None,
) -> T:
    """`fn()`, tried again after a backoff while it raises an exception that `retryable` accepts.

    Stops at `attempts` calls in all, or at `deadline` (a `clock()` time, monotonic by default): a wait that
    would end past the deadline is shortened to end at it, and that last try decides, so a caller retries
    for as long as its deadline allows and never sleeps past it. Then, as for an exception `retryable`
    refuses, the last exception propagates unchanged. `on_retry(error, retry, delay)` is told of each
    retry before its wait (for logging; `retry` counts from 1). `sleep` may return early (e.g. a stop
    event's `wait`); a caller that must stop retrying then says so through `retryable`. `backoff_for(error)`,
    when given, picks the backoff by the error (a peer shedding load is retried sooner than one that is down).
    """
    if attempts is None and deadline is None:
        raise ConfigError("attempts", "a retry needs an attempt limit or a deadline, got neither")
    if attempts is not None and (isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1):
        raise ConfigError("attempts", f"must be an integer >= 1, got {attempts!r}")
    retry = 0
    while True:
        try:
            return fn()
        except Exception as error:
            if not retryable(error) or (attempts is not None and retry + 1 >= attempts):
                raise
            delay = (backoff_for(error) if backoff_for is not None else backoff).delay(retry, rng=rng)
            if deadline is not None:
                left = deadline - clock()
                if left <= 0:
                    raise
                delay = min(delay, left)  # the last wait ends at the deadline, for a last try there
            retry += 1
            if on_retry is not None:
                on_retry(error, retry, delay)
            sleep(delay)
