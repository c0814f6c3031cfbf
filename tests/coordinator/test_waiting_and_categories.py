"""A job that cannot start its next round says why (JobRow.waiting, and one `waiting` event per change of reason,
never one per poll), and the reason is cleared when the round opens; a job whose category no registered worker
serves is accepted with a warning naming the known categories, or refused when the coordinator is strict."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from sqlalchemy import text

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve as serve_aggregator
from fedbroker.app import jobs
from fedbroker.app.cli import cmd_status
from fedbroker.app.submit import cmd_submit
from fedbroker.bus import InProcessBus
from fedbroker.config import DPPolicy
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.service import CoordinatorClient, serve
from fedbroker.coordinator.store import StateStore
from fedbroker.coordinator.waiting import MAX_LISTED, unaffordable
from fedbroker.rpc.aggregation_client import AggregatorClient

pytestmark = pytest.mark.timeout(120)

JOB: dict[str, Any] = {
    "name": "wait", "category": "clinic", "seed": 0,
    "model": {"input_shape": [3], "layers": [{"type": "Linear", "in_features": 3, "out_features": 2}]},
    "training": {"rounds": 1, "batch_size": 4},
    "schedule": {"min_workers": 2, "min_clients": 2, "wait_for_workers_s": 300, "round_timeout_s": 300},
}
STINGY = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=0.01)
GENEROUS = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=1e6)


def register(store: StateStore, worker_id: str, dp: DPPolicy, category: str = "clinic") -> None:
    store.upsert_worker(worker_id=worker_id, categories=[category], histogram=[5, 5], dp=dp, epsilon_spent=0.0,
                        device="cpu", num_samples=10, input_shape=[3], num_classes=2)


def wait_for(what: str, check: Callable[[], Any], within_s: float = 60.0) -> Any:
    """Poll `check` until it returns something truthy; a hang guard, not a deadline the test relies on."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


class Deployment:
    def __init__(self, tmp_path: Path, *, strict: bool = False, broker_consumer_timeout_s: float | None = None) -> None:
        self.book_server, book_port = serve_aggregator(RoundBook())
        target = f"127.0.0.1:{book_port}"
        self.store = StateStore(str(tmp_path / "coordinator.sqlite"))
        self.coordinator = Coordinator(bus=InProcessBus(namespace=f"wait-{tmp_path.name}"), store=self.store,
                                       aggregator=AggregatorClient(target), aggregator_target=target,
                                       checkpoint_dir=str(tmp_path / "ck"), poll_interval_s=0.02, safety_poll_s=0.02,
                                       # a registered site stays active for the whole test, however loaded the
                                       # machine: no reason below may depend on how long a step took
                                       heartbeat_timeout_s=3600.0,
                                       strict_categories=strict, broker_consumer_timeout_s=broker_consumer_timeout_s)
        self.coordinator.start()
        self.server, port = serve(self.coordinator)
        self.target = f"127.0.0.1:{port}"
        self.client = CoordinatorClient(self.target)

    def job_row(self, job_id: str) -> Any:
        (row,) = self.client.status(job_id).jobs
        return row

    def events(self, job_id: str, kind: str) -> list[str]:
        return [e.message for e in self.store.events(job_id) if e.kind == kind]

    def close(self) -> None:
        self.client.close()
        self.server.stop(grace=0)
        self.coordinator.stop()
        self.book_server.stop(grace=0)
        self.store.close()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(tmp_path)
    yield d
    d.close()


def cli(deployment: Deployment, capsys: pytest.CaptureFixture[str], command: Callable[[argparse.Namespace], int],
        **args: Any) -> str:
    """What a `fedbroker` command prints against this coordinator."""
    capsys.readouterr()
    assert command(argparse.Namespace(coordinator=deployment.target, config=None, **{"json": False, **args})) == 0
    out, err = capsys.readouterr()
    print(err, end="", file=sys.stderr)  # for the caller to read (capsys keeps it)
    return out


def test_a_job_waiting_for_affordable_workers_says_why_once_per_reason_and_clears_it_when_the_round_opens(
        deployment: Deployment, capsys: pytest.CaptureFixture[str]) -> None:
    register(deployment.store, "site-a", STINGY)
    register(deployment.store, "site-b", STINGY)
    for silent in ("site-c", "site-d"):  # registered, silent: they may come back, so the job waits
        register(deployment.store, silent, GENEROUS)
    deployment.store._run("silence them", text("UPDATE workers SET last_seen = 0 WHERE worker_id IN ('site-c', 'site-d')"))
    job_id = deployment.client.submit(yaml.safe_dump(JOB))

    first = wait_for("the first reason", lambda: deployment.job_row(job_id).waiting)
    assert first.startswith("0 of 2 active worker(s) of category 'clinic' can afford round 1, schedule.min_clients "
                            "is 2 (site-a: the round would cost ε "), first
    assert "0.010 left of its budget; site-b: the round would cost ε" in first, first
    polls = deployment.coordinator.context.poll_interval_s
    time.sleep(20 * polls)  # many polls with the same reason: still one event
    assert deployment.events(job_id, "waiting") == [first]
    assert deployment.job_row(job_id).status == "running" and deployment.store.rounds(job_id) == []
    shown = cli(deployment, capsys, jobs.cmd_show, job_id=job_id)
    assert f"{'waiting':<12} {first}" in shown.splitlines(), shown
    assert first in cli(deployment, capsys, jobs.cmd_list).splitlines()[2]
    status = cli(deployment, capsys, cmd_status, job=job_id)
    assert status.split("WAITING\n")[1].splitlines()[2] == f"{job_id}  {first}", status
    (as_json,) = json.loads(cli(deployment, capsys, jobs.cmd_list, json=True))
    assert as_json["waiting"] == first

    register(deployment.store, "site-a", GENEROUS)  # its owner raised the budget: a new reason, a new event
    second = wait_for("the second reason", lambda: [m for m in deployment.events(job_id, "waiting") if m != first])
    assert second == [f"1 of 2 active worker(s) of category 'clinic' can afford round 1, schedule.min_clients is 2 "
                      f"(site-b: {first.split('site-b: ')[1]}"], second

    register(deployment.store, "site-b", GENEROUS)
    wait_for("round 1 to open", lambda: deployment.store.rounds(job_id))
    assert deployment.job_row(job_id).waiting == ""
    kinds = [e.kind for e in deployment.store.events(job_id)]
    assert kinds.count("waiting") == 2 and kinds.index("round_opened") > max(
        i for i, k in enumerate(kinds) if k == "waiting")
    assert "WAITING" not in cli(deployment, capsys, cmd_status, job=job_id)
    logs = cli(deployment, capsys, jobs.cmd_logs, job_id=job_id, follow=False)
    assert sum(" waiting " in line for line in logs.splitlines()) == 2, logs
    assert deployment.client.cancel(job_id) in ("cancelled", "cancelling")


def test_a_job_waiting_for_workers_to_register_says_how_many_and_which_category_is_unknown(
        deployment: Deployment, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    register(deployment.store, "site-a", GENEROUS, category="digits")
    reply = deployment.client.submit_job(yaml.safe_dump({**JOB, "category": "digts"}))
    assert reply.job_id.startswith("wait-")
    warning = ("no registered worker serves category 'digts' (known: digits); the job waits up to "
               "schedule.wait_for_workers_s (300s) for one to register")
    assert list(reply.warnings) == [warning]
    assert deployment.events(reply.job_id, "warning") == [warning]
    path = tmp_path / "job.yaml"  # `fedbroker submit` prints the id, and the warning on stderr
    path.write_text(yaml.safe_dump({**JOB, "category": "digts"}))
    printed = cli(deployment, capsys, cmd_submit, job=str(path), follow=False, wait=False, track=None,
                  experiment=None)
    assert printed.startswith("wait-")
    assert f"fedbroker submit: warning: {warning}" in capsys.readouterr().err.splitlines()
    assert deployment.events(printed.strip(), "warning") == [warning]
    waiting = wait_for("the reason", lambda: deployment.job_row(reply.job_id).waiting)
    assert waiting == ("0 of 2 worker(s) of category 'digts' active (schedule.min_workers); no registered worker "
                       "serves category 'digts' (known: digits)")
    assert deployment.job_row(reply.job_id).status == "pending"
    register(deployment.store, "site-b", GENEROUS, category="digts")  # one registers: the reason changes
    wait_for("the next reason", lambda: len(deployment.events(reply.job_id, "waiting")) == 2)
    assert deployment.job_row(reply.job_id).waiting == "1 of 2 worker(s) of category 'digts' active (schedule.min_workers)"


def test_a_strict_coordinator_refuses_a_category_no_worker_serves_with_every_other_problem(tmp_path: Path) -> None:
    deployment = Deployment(tmp_path, strict=True, broker_consumer_timeout_s=100.0)
    try:
        register(deployment.store, "site-a", GENEROUS, category="digits")
        register(deployment.store, "site-b", GENEROUS, category="other")
        with pytest.raises(grpc.RpcError) as info:
            deployment.client.submit(yaml.safe_dump({**JOB, "category": "digts"}))  # round_timeout_s 300 > 80
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = info.value.details()
        assert ("category: no registered worker serves category 'digts' (known: digits, other), and "
                "coordinator.strict_categories is on") in details, details
        assert "schedule.round_timeout_s: must be at most 80 s here, got 300" in details, details
        assert deployment.store.jobs() == []
        job = {**JOB, "category": "digits", "schedule": {**JOB["schedule"], "round_timeout_s": 60}}
        assert list(deployment.client.submit_job(yaml.safe_dump(job)).warnings) == []
    finally:
        deployment.close()


def test_a_long_list_of_reasons_is_cut_and_counted() -> None:
    why = {f"w{i:02d}": "its ε budget is spent (0.000 left)" for i in range(MAX_LISTED + 3)}
    text = unaffordable(why, what="round 4", category="c", rule="schedule.min_clients is 1")
    assert text.startswith(f"0 of {MAX_LISTED + 3} active worker(s) of category 'c' can afford round 4")
    assert text.count("its ε budget is spent") == MAX_LISTED and text.endswith("; and 3 more)")
    assert unaffordable({}, what="round 1", category="c", rule="schedule.min_clients is 1") == (
        "no active worker of category 'c' for round 1, schedule.min_clients is 1")


def test_an_asynchronous_job_nobody_can_afford_says_why_and_clears_it_once_a_task_goes_out(
        deployment: Deployment) -> None:
    register(deployment.store, "site-a", STINGY)
    register(deployment.store, "site-c", GENEROUS)  # registered, silent: it may come back, so the job waits
    deployment.store._run("silence site-c", text("UPDATE workers SET last_seen = 0 WHERE worker_id = 'site-c'"))
    job = {**JOB, "schedule": {"mode": "async", "min_workers": 1, "wait_for_workers_s": 300, "round_timeout_s": 300}}
    job_id = deployment.client.submit(yaml.safe_dump(job))
    reason = wait_for("the reason", lambda: deployment.job_row(job_id).waiting)
    assert reason.startswith("0 of 1 active worker(s) of category 'clinic' can afford a task of this asynchronous "
                             "job, one is needed (site-a: the round would cost ε "), reason
    # the row and the event are two writes: wait for the event, then pin that it is the one reason, once
    assert wait_for("the waiting event", lambda: deployment.events(job_id, "waiting")) == [reason]
    deployment.coordinator.bus.declare_worker("site-a")  # its task queue: the task waits there, held until its deadline
    register(deployment.store, "site-a", GENEROUS)
    wait_for("a task handed out", lambda: deployment.job_row(job_id).waiting == "")
    time.sleep(20 * deployment.coordinator.context.poll_interval_s)
    assert deployment.job_row(job_id).waiting == "" and deployment.events(job_id, "waiting") == [reason]
