"""The coordinator's calls to the aggregation service ride out its restarts (coordinator/service_calls.py): a
call in flight when the service stops comes back CANCELLED, and is tried again like UNAVAILABLE, unless the
coordinator itself is stopping."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import pytest

from fedbroker.coordinator.job_run import Stopped
from fedbroker.coordinator.service_calls import AggregatorCalls
from fedbroker.errors import Rejection
from fedbroker.rpc.plumbing import RemoteError

pytestmark = pytest.mark.timeout(60)


def failing_first(*codes: grpc.StatusCode) -> tuple[list[int], Callable[[], int]]:
    """A call that fails with each of `codes` in turn, then answers 7; and the count of its tries."""
    tries = [0]

    def call() -> int:
        tries[0] += 1
        if tries[0] <= len(codes):
            raise RemoteError("", f"try {tries[0]}", codes[tries[0] - 1])
        return 7

    return tries, call


@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_call_cut_by_a_service_restart_is_tried_again(code: grpc.StatusCode) -> None:
    tries, call = failing_first(code)
    assert AggregatorCalls(outage_s=60, stop=threading.Event()).call("j", "status", call) == 7
    assert tries[0] == 2


def test_a_refusal_is_not_tried_again() -> None:
    tries, call = failing_first(grpc.StatusCode.FAILED_PRECONDITION)
    with pytest.raises(RemoteError):
        AggregatorCalls(outage_s=60, stop=threading.Event()).call("j", "status", call)
    assert tries[0] == 1


def test_a_stopping_coordinator_is_not_kept_waiting_by_a_cancelled_call() -> None:
    stop = threading.Event()
    stop.set()
    tries, call = failing_first(grpc.StatusCode.CANCELLED)
    with pytest.raises(Stopped):
        AggregatorCalls(outage_s=60, stop=stop).call("j", "status", call)
    assert tries[0] == 1


def test_a_service_that_lost_the_job_gets_it_back_and_the_call_is_repeated() -> None:
    tries = [0]
    lost: list[str] = []

    def call() -> int:
        tries[0] += 1
        if tries[0] == 1:
            raise RemoteError(Rejection.UNKNOWN_JOB, "no job j", grpc.StatusCode.NOT_FOUND)
        return 7

    assert AggregatorCalls(outage_s=60, stop=threading.Event()).call("j", "status", call, on_lost_job=lost.append) == 7
    assert tries[0] == 2 and lost == ["no job j"]
