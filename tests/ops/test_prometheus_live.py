"""A real Prometheus scrapes a running federation (RabbitMQ, gRPC, coordinator, DP workers in this process)
and its HTTP API shows the round counter rise, the per-worker ε gauges, the alert rules loaded, and every
dashboard query evaluating."""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.parse
import urllib.request
from typing import Any

import pytest

from fedbroker.app.demo import free_port
from fedbroker.config import DPPolicy
from fedbroker.job.spec import parse_job
from fedbroker.metrics import start_ephemeral_exporter
from tests.integration.conftest import Federation
from tests.ops.conftest import DEPLOY, tool
from tests.ops.test_dashboards import DASHBOARDS, panel_exprs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

WORKERS = ("p0", "p1")
POLICY = DPPolicy(noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=50.0)


def job(rounds: int) -> dict[str, Any]:
    return {
        "name": "prom", "category": "digits", "seed": 3,
        "model": {"input_shape": [1, 8, 8], "layers": [
            {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 10}]},
        "training": {"rounds": rounds, "local_epochs": 1, "batch_size": 64, "lr": 0.2},
        "schedule": {"min_workers": len(WORKERS), "wait_for_workers_s": 30, "round_timeout_s": 60},
        "evaluation": {"dataset": "digits"},
    }


class PrometheusServer:
    def __init__(self, tmp, target: str) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: ['{DEPLOY / 'prometheus' / 'alerts.yml'}']\n"
            "scrape_configs:\n"
            f"  - job_name: fedbroker-test\n    static_configs: [{{targets: ['{target}']}}]\n")
        self.log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 (prometheus writes it until stopped)
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.tmp = tmp

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> dict[tuple[tuple[str, str], ...], float]:
        result = self.api("query", query=promql)["result"]
        return {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in result}

    def scalar(self, promql: str) -> float | None:
        values = list(self.query(promql).values())
        return values[0] if values else None

    def wait_for(self, what: str, check, timeout: float = 30.0) -> Any:
        deadline = time.time() + timeout
        last: Any = None
        while time.time() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited ({self.proc.returncode}): {(self.tmp / 'prometheus.log').read_text()}")
            try:
                last = check()
            except OSError:  # not listening yet
                last = None
            if last:
                return last
            time.sleep(0.3)
        pytest.fail(f"timed out waiting for {what} (last: {last!r})")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture
def watched_federation(rabbitmq_url, tmp_path):
    fed = Federation(rabbitmq_url, tmp_path)
    port, stop_exporter = start_ephemeral_exporter()
    prometheus = PrometheusServer(tmp_path, f"127.0.0.1:{port}")
    yield fed, prometheus
    prometheus.stop()
    stop_exporter()
    fed.close()


def run_job(fed: Federation, rounds: int) -> str:
    job_id = fed.coordinator.submit(parse_job(job(rounds)))
    assert fed.coordinator.wait(job_id, timeout=120) == "completed", fed.store.job(job_id).error
    return job_id


def test_prometheus_sees_rounds_rise_and_each_workers_epsilon(watched_federation):
    fed, prometheus = watched_federation
    prometheus.wait_for("the first scrape", lambda: prometheus.scalar('up{job="fedbroker-test"}') == 1)
    for i, worker_id in enumerate(WORKERS):
        fed.add_worker(worker_id, index=i, count=len(WORKERS), dp=POLICY)

    first = run_job(fed, rounds=2)
    completed = f'sum(fedbroker_coordinator_rounds_completed_total{{job_id=~"{first}"}})'
    prometheus.wait_for("2 rounds", lambda: prometheus.scalar(completed) == 2)
    def epsilons() -> dict[str, float]:
        series = prometheus.query('fedbroker_worker_epsilon_spent{worker_id=~"p0|p1"}')
        return {dict(labels)["worker_id"]: v for labels, v in series.items()}

    spent = prometheus.wait_for("ε of both workers", lambda: len(epsilons()) == 2 and epsilons())
    assert all(0 < e < POLICY.epsilon_budget for e in spent.values()), spent

    second = run_job(fed, rounds=1)
    both = f'sum(fedbroker_coordinator_rounds_completed_total{{job_id=~"{first}|{second}"}})'
    prometheus.wait_for("the counter to rise to 3", lambda: prometheus.scalar(both) == 3)
    later = prometheus.wait_for("ε to grow", lambda: all(epsilons().get(w, 0) > spent[w] for w in WORKERS)
                                and epsilons())
    remaining = prometheus.scalar('fedbroker_worker_epsilon_budget_remaining{worker_id="p0"}')
    assert remaining == pytest.approx(POLICY.epsilon_budget - later["p0"], rel=1e-6)
    accuracy = fed.store.rounds(second)[-1].accuracy
    # Each value is waited for, not read once: the last scrape may predate the gauge's update by a second.
    prometheus.wait_for("the second job's accuracy", lambda: prometheus.scalar(
        f'fedbroker_coordinator_model_accuracy{{job_id="{second}"}}') == pytest.approx(accuracy))
    prometheus.wait_for("both workers active", lambda: (prometheus.scalar("fedbroker_coordinator_workers_active")
                                                        or 0) >= 2)
    prometheus.wait_for("the coordinator's bus connected",
                        lambda: prometheus.scalar('fedbroker_broker_connected{client="coordinator"}') == 1)
    # Counters exist at 0 from the job's start, so increase() and the RoundsFailing alert can see a first failure.
    assert prometheus.scalar(f'fedbroker_coordinator_rounds_failed_total{{job_id="{second}"}}') == 0
    # The per-category view the NoActiveWorkers alert reads, the dead-letter depth, the next round's ε cost.
    prometheus.wait_for("the category's workers", lambda: prometheus.scalar(
        'fedbroker_coordinator_category_workers_active{category="digits"}') == len(WORKERS))
    prometheus.wait_for("the dead-letter depth", lambda: prometheus.scalar(
        "fedbroker_coordinator_dead_letter_messages") == 0)
    cost = prometheus.wait_for("the next round's ε cost", lambda: prometheus.scalar(
        'fedbroker_worker_epsilon_next_round_cost{worker_id="p0"}'))
    assert 0 < cost < POLICY.epsilon_budget

    rules = prometheus.api("rules")["groups"]
    loaded = {r["name"]: r["health"] for g in rules for r in g["rules"]}
    assert {"FedbrokerRoundStalled", "FedbrokerWorkerCannotAffordNextRound", "FedbrokerNoActiveWorkers",
            "FedbrokerUploadRejectionRateHigh", "FedbrokerBrokerConnectionLost", "FedbrokerRoundsFailing",
            "FedbrokerDeadLetters"} <= set(loaded)
    prometheus.wait_for("rules evaluated", lambda: all(
        r["health"] == "ok" for g in prometheus.api("rules")["groups"] for r in g["rules"]))

    for path in DASHBOARDS:  # every panel's query is valid PromQL that this Prometheus evaluates
        for _title, expr in panel_exprs(json.loads(path.read_text())):
            promql = re.sub(r"\$__rate_interval", "1m", expr).replace("$job_id", ".*").replace("$worker_id", ".*")
            prometheus.api("query", query=promql)
