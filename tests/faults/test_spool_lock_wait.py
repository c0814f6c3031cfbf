"""A quick restart of the aggregation service: the new process waits (with a bound) for the old one to let go of
the spool's lock instead of being refused while that one is still exiting. Real `fedbroker aggregator`
processes on one spool; the old holder is a real process too, so its exit is the only thing the new one waits on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from fedbroker.aggregators.spool import LOCK_FILE
from tests.faults.harness import wait_for
from tests.integration.processes import Deployment, _clean_env, stop_all

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

HOLD = ("import sys; from fedbroker.files import FolderLock; lock = FolderLock(sys.argv[1], sys.argv[2]); "
        "print('held', flush=True); sys.stdin.read()")


def serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=1)
        except grpc.FutureTimeoutError:
            return False
    return True


def aggregator(deployment: Deployment, name: str, spool: Path, wait_s: float) -> None:
    deployment.spawn(name, "aggregator", {"aggregator.listen": deployment.aggregator, "aggregator.spool_dir": spool,
                                          "aggregator.spool_lock_wait_s": wait_s})


def test_a_service_started_while_the_old_one_still_holds_the_spool_starts_once_it_has_exited(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    deployment = Deployment("amqp://unused", tmp_path, name="lock", worker_ids=[])
    old = subprocess.Popen([sys.executable, "-c", HOLD, str(spool), LOCK_FILE], env=_clean_env(),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert old.stdout is not None and old.stdout.readline() == b"held\n"
        aggregator(deployment, "new", spool, 120)
        wait_for(lambda: "waiting up to 120 s" in deployment.logs() or deployment.processes["new"].poll() is not None,
                 60, "the new service to wait for the spool")
        deployment.alive("new")  # today's main: refused at once (exit 2), while the old process is still exiting
        assert not serving(deployment.aggregator)
        assert old.stdin is not None
        old.stdin.close()  # the old process exits, and the kernel drops its lock
        assert old.wait(30) == 0
        wait_for(lambda: serving(deployment.aggregator) or deployment.processes["new"].poll() is not None, 90,
                 "the new service to serve")
        deployment.alive("new")
        assert f"pid {old.pid}" in deployment.logs()  # the wait named who held the spool
    finally:
        stop_all([old, *deployment.processes.values()])


def test_a_second_service_right_after_terminating_the_first_starts_on_the_same_spool(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    deployment = Deployment("amqp://unused", tmp_path, name="restart", worker_ids=[])
    try:
        aggregator(deployment, "first", spool, 30)
        wait_for(lambda: serving(deployment.aggregator), 90, "the first service to serve")
        first = deployment.processes["first"]
        first.terminate()
        aggregator(deployment, "second", spool, 60)  # at once: the first may still be exiting
        assert first.wait(60) is not None
        wait_for(lambda: serving(deployment.aggregator) or deployment.processes["second"].poll() is not None, 90,
                 "the second service to serve")
        deployment.alive("second")
    finally:
        stop_all(list(deployment.processes.values()))


def test_a_holder_that_never_lets_go_is_named_once_the_bound_has_passed(tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(spool), LOCK_FILE], env=_clean_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        done = subprocess.run([sys.executable, "-m", "fedbroker", "aggregator", "--listen", "127.0.0.1:0"],
                              env={**_clean_env(), "FEDBROKER__AGGREGATOR__SPOOL_DIR": str(spool),
                                   "FEDBROKER__AGGREGATOR__SPOOL_LOCK_WAIT_S": "1"},
                              capture_output=True, text=True, timeout=120)
    finally:
        stop_all([holder])
    assert done.returncode == 2, done.stderr
    assert f"in use by another aggregation service (pid {holder.pid}" in done.stderr
    assert "did not let go within aggregator.spool_lock_wait_s = 1 s" in done.stderr
