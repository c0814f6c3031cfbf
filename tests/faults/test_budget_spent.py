"""Issue 30, defect: a site whose ε budget is spent. `fedbroker submit` shows each site's projected ε against its
budget and warns about a site that cannot take part; the coordinator excludes it at selection (an event naming its
budget) and fails a job left with too few sites at once, naming them, instead of waiting for budget that cannot
come back; the site says once per job, in its log, why it declines. Real RabbitMQ, real gRPC (the aggregation
service and the coordinator's API on loopback), DP workers with their own ledgers, every participant on its own
broker user as a kit deploys it (a guest run would add nothing: guest may do all a site's user may)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedbroker.app.cli import main
from fedbroker.bus import envelope
from fedbroker.config import DPPolicy
from fedbroker.coordinator.service import serve
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker.agent import WorkerAgent
from tests.faults.harness import Federation, job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

RICH = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=500.0)
POOR = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=0.5)  # below one round's ε


def submit(fed: Federation, job_dict: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Any:
    """`fedbroker submit job.yaml --json` over the coordinator's gRPC API: its one JSON document."""
    assert fed.coordinator is not None
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job_dict))
    server, port = serve(fed.coordinator)
    try:
        capsys.readouterr()
        assert main(["submit", str(path), "--json", "--coordinator", f"127.0.0.1:{port}"]) == 0
        return json.loads(capsys.readouterr().out.splitlines()[0])
    finally:
        server.stop(grace=0)


def registered(fed: Federation, *workers: str) -> None:
    wait_for(lambda: {w.worker_id for w in fed.store.workers()} >= set(workers), 60, f"{workers} to register")


def test_submit_projects_each_sites_epsilon_and_a_job_short_of_budget_fails_at_once_naming_the_sites(
        provisioned_federation: Federation, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fed = provisioned_federation
    fed.add_worker("rich", index=0, count=2, dp=RICH)
    fed.add_worker("poor", index=1, count=2, dp=POOR)
    registered(fed, "rich", "poor")
    # the job would wait schedule.wait_for_workers_s (20 minutes) for a site: it fails at once instead
    reply = submit(fed, job(training={"rounds": 2}, schedule={"min_clients": 2}), tmp_path, capsys)
    job_id = reply["job_id"]
    lines = {line.split(":", 1)[0]: line for line in reply["epsilon_projection"]}
    assert set(lines) == {"rich", "poor"}, reply
    assert "of its budget 500 (fits)" in lines["rich"] and "ε 0.000 spent + up to " in lines["rich"]
    assert "of its budget 0.5 (over its budget)" in lines["poor"] and "(2 round(s))" in lines["poor"]
    (warning,) = [w for w in reply["warnings"] if "cannot take part" in w]
    assert warning.startswith("site poor cannot take part: budget ε 0.5, 0.000 spent, 0.500 left: a round of this "
                              "job costs ε "), warning

    row = wait_for(lambda: (r := fed.store.job(job_id)) is not None and r.status == "failed" and r, 120,
                   "the job to fail")
    assert "round 1 cannot start: 1 site(s) of category 'digits' can ever afford it, 2 needed" in row.error
    assert "poor: budget ε 0.5, 0.000 spent, 0.500 left" in row.error and "rich" not in row.error, row.error
    assert fed.store.rounds(job_id) == [] and fed.workers["rich"].ledger.epsilon(job_id) == 0  # nobody trained
    (excluded,) = [e for e in fed.store.events(job_id) if e.kind == "excluded"]
    assert excluded.worker_id == "poor" and "out of ε budget, not selected: budget ε 0.5" in excluded.message


def test_a_site_out_of_budget_is_left_out_of_selection_and_the_job_runs_with_the_others(
        provisioned_federation: Federation, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fed = provisioned_federation
    for i, name in enumerate(("rich", "also-rich")):
        fed.add_worker(name, index=i, count=3, dp=RICH)
    fed.add_worker("poor", index=2, count=3, dp=POOR)
    registered(fed, "rich", "also-rich", "poor")
    reply = submit(fed, job(training={"rounds": 1}, schedule={"min_clients": 2}), tmp_path, capsys)
    fed.wait_job(reply["job_id"], 120)
    events = [(e.kind, e.worker_id) for e in fed.store.events(reply["job_id"])]
    assert events.count(("excluded", "poor")) == 1  # named once, not at every look
    assert {p.worker_id for p in fed.store.participants(reply["job_id"])} == {"rich", "also-rich"}
    assert fed.workers["poor"].ledger.total_epsilon() == 0


def test_a_site_says_once_per_job_that_its_budget_is_spent_and_why_it_declines(
        provisioned_federation: Federation, caplog: pytest.LogCaptureFixture) -> None:
    """Tasks the coordinator sent before it knew (its view of a budget lags the site's): the site declines each,
    and its log says why once, naming its budget, what it spent and what the task costs."""
    fed = provisioned_federation
    poor = fed.add_worker("poor", index=0, count=2, dp=POOR)
    declined: list[str] = []
    report = poor._report

    def recording(task: pb.RoundTask, status: Any, reason: str, **kwargs: Any) -> None:
        declined.append(reason)
        report(task, status, reason, **kwargs)

    poor._report = recording  # type: ignore[method-assign]
    registered(fed, "poor")
    training = json.dumps(job()["training"])
    caplog.set_level(logging.WARNING, logger="fedbroker.worker.budget")
    for round_number in (1, 2, 3):
        task = pb.RoundTask(job_id="spent-job", round=round_number, category="digits", training_json=training,
                            aggregator_target=fed.target, deadline_unix=4e9)
        fed.bus.publish_task("poor", envelope.encode(round_task=task))
    wait_for(lambda: len(declined) == 3, 60, "the three tasks declined")
    assert all("privacy budget exceeded" in reason for reason in declined), declined
    told = [r.getMessage() for r in caplog.records if "privacy budget spent for job spent-job" in r.getMessage()]
    assert len(told) == 1, told
    assert "the owner's budget is ε 0.5 (worker.dp.epsilon_budget), ε 0.000 is spent and a round of this job costs " \
           "ε " in told[0] and "it declines the job's tasks" in told[0], told
    assert isinstance(poor, WorkerAgent) and poor.ledger.total_epsilon() == 0


def test_an_asynchronous_job_no_site_can_afford_fails_at_once_naming_them(
        provisioned_federation: Federation, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fed = provisioned_federation
    fed.add_worker("poor", index=0, count=2, dp=POOR)
    registered(fed, "poor")
    reply = submit(fed, job(schedule={"mode": "async", "min_workers": 1}), tmp_path, capsys)
    row = wait_for(lambda: (r := fed.store.job(reply["job_id"])) is not None and r.status == "failed" and r, 120,
                   "the job to fail")
    assert row.error.startswith("a task of this asynchronous job cannot start: 0 site(s) of category 'digits' can "
                                "ever afford it, 1 needed; out of ε budget: poor: budget ε 0.5"), row.error
