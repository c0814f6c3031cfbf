"""The async experiment's speed model: each worker's steps really are slowed by its own delay, on the bus the
experiment runs on (a delay matched to no worker once left every worker at full speed, unnoticed)."""

from __future__ import annotations

import math
import threading

import numpy as np
import pytest

from experiments import async_fedbuff
from fedbroker.bus import open_bus


def test_the_delays_spread_tenfold_between_the_fastest_and_slowest_decile():
    draws = np.array(list(async_fedbuff.step_delays(0, 20_000).values()))
    ratio = np.quantile(draws, 0.9) / np.quantile(draws, 0.1)
    assert math.isclose(ratio, 10.0, rel_tol=0.05), ratio
    assert async_fedbuff.step_delays(3, 12) == async_fedbuff.step_delays(3, 12)  # seeded


def test_each_worker_trains_at_its_own_delay_on_the_in_process_bus(monkeypatch):
    delays = {"w00": 0.001, "w01": 0.02}
    slept: dict[str, list[float]] = {}

    def fake_train(*args, progress=None, **kwargs):  # three steps
        for step in range(3):
            progress(step, 3)

    monkeypatch.setattr(async_fedbuff.fedbroker.worker.agent, "train_local", fake_train)
    slow = async_fedbuff.SlowSteps(delays)
    slow.sleep = lambda s: slept.setdefault(threading.current_thread().name.rsplit(".", 1)[-1], []).append(s)
    bus = open_bus(None, namespace="exp-async-test")
    done = threading.Semaphore(0)
    try:
        for worker_id in delays:
            bus.consume_tasks(worker_id, lambda d: (slow(progress=lambda s, t: None), d.ack(), done.release()))
        bus.start()
        for worker_id in delays:
            bus.publish_task(worker_id, b"task")
        assert done.acquire(timeout=30) and done.acquire(timeout=30)
    finally:
        bus.close()
    assert slept == {"w00": [0.001] * 3, "w01": [0.02] * 3}


def test_a_thread_that_names_no_worker_is_an_error_not_a_worker_at_full_speed():
    with pytest.raises(RuntimeError, match="names none of the workers"):
        async_fedbuff.SlowSteps({"w00": 0.1}).delay()
