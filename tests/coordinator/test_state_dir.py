"""One coordinator per state directory, owner-only files, and a bounded number of job threads (issue 12).

A second coordinator on a state directory is refused with an error naming the directory and the holder's pid
(a real second process holds it); the directory is 0700, the SQLite file (with its -wal and -shm) and the
checkpoints 0600; jobs beyond `max_running_jobs` wait `pending` in submission order instead of each getting
a thread."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fedbroker.bus import InProcessBus
from fedbroker.coordinator.checkpoints import save_checkpoint
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.state_dir import StateDirInUse
from fedbroker.coordinator.store import StateStore
from fedbroker.errors import ConfigError
from fedbroker.job.spec import parse_job
from fedbroker.rpc.aggregation_client import AggregatorClient

HOLD = """
import sys, time
from fedbroker.coordinator.store import StateStore
StateStore.in_directory(sys.argv[1])
print("holding", flush=True)
time.sleep(120)
"""


def mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_second_coordinator_on_the_same_state_directory_is_refused_naming_it_and_the_holder(tmp_path: Path) -> None:
    state = tmp_path / "state"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(state)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        with pytest.raises(StateDirInUse) as info:
            StateStore.in_directory(str(state))
        assert str(state) in str(info.value) and f"pid {holder.pid}" in str(info.value)
        assert isinstance(info.value, ConfigError) and info.value.field == "coordinator.state_dir"
    finally:
        holder.kill()
        holder.wait(30)
    store = StateStore.in_directory(str(state))  # the lock died with its process: a restart is not blocked
    store.close()
    StateStore.in_directory(str(state)).close()  # and close() released it


def test_the_state_directory_its_database_and_checkpoints_are_owner_only(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        state = tmp_path / "state"
        store = StateStore.in_directory(str(state))
        store.add_job("j", "j", "{}", 1, "{}")
        path = save_checkpoint(state / "checkpoints", "j", 1, {"w": np.zeros(3, np.float32)}, "{}")
        assert mode(state) == 0o700
        for name in ("coordinator.sqlite", "coordinator.sqlite-wal", "coordinator.sqlite-shm", "coordinator.lock"):
            assert mode(state / name) == 0o600, name
        assert mode(path) == 0o600
        assert mode(state / "checkpoints") == 0o700 and mode(state / "checkpoints" / "j") == 0o700
        store.close()
        legacy = tmp_path / "legacy.sqlite"  # a file an older version left world-readable is tightened
        legacy.touch(mode=0o644)
        os.chmod(legacy, 0o644)
        StateStore(str(legacy)).close()
        assert mode(legacy) == 0o600
    finally:
        os.umask(old)


def job(name: str, wait_for_workers_s: float) -> object:
    return parse_job({"name": name, "category": "nobody",
                      "model": {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]},
                      "schedule": {"wait_for_workers_s": wait_for_workers_s}})


def job_threads(ids: list[str]) -> set[str]:
    """The live threads of these jobs."""
    names = {f"job-{i}" for i in ids}
    return {t.name for t in threading.enumerate() if t.name in names}


def wait_for(predicate, timeout: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


def test_jobs_beyond_max_running_jobs_wait_pending_in_submission_order(tmp_path: Path) -> None:
    bus = InProcessBus(namespace="pool-test")
    store = StateStore(str(tmp_path / "coordinator.sqlite"))
    coordinator = Coordinator(bus=bus, store=store, aggregator=AggregatorClient("127.0.0.1:1"),
                              aggregator_target="127.0.0.1:1", checkpoint_dir=str(tmp_path / "ck"),
                              poll_interval_s=0.02, max_running_jobs=2)
    coordinator.start()
    try:
        # the first two end soon (no worker registers), the rest wait for workers for an hour
        ids = [coordinator.submit(job(f"p{i}", 0.3 if i < 2 else 3600)) for i in range(6)]
        assert job_threads(ids) <= {f"job-{i}" for i in ids[:2]}
        assert all(store.job(i).status == "pending" for i in ids[2:])
        assert coordinator.wait(ids[0], 60) == "failed" and coordinator.wait(ids[1], 60) == "failed"
        wait_for(lambda: job_threads(ids) == {f"job-{ids[2]}", f"job-{ids[3]}"})  # the next two, in order
        assert len(job_threads(ids)) == 2
    finally:
        coordinator.stop()
        bus.close()
    assert coordinator.wait(ids[5], 0) == "pending"  # still queued when the coordinator stopped: resumed next start
    assert not job_threads(ids)
    store.close()


def test_max_running_jobs_must_be_a_positive_integer(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="max_running_jobs: must be an integer >= 1, got 0"):
        Coordinator(bus=InProcessBus(namespace="pool-test"), store=StateStore(":memory:"),
                    aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="x", checkpoint_dir="ck",
                    max_running_jobs=0)
