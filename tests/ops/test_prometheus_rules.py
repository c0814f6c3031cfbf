"""promtool checks the scrape config and runs the alert rules' unit tests; every alert has a test."""

from __future__ import annotations

import subprocess

import yaml

from tests.ops.conftest import DEPLOY, tool

PROMETHEUS = DEPLOY / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_scrape_config_and_its_rule_file():
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout + result.stderr


def test_alert_rules_pass_their_promtool_unit_tests():
    result = promtool("test", "rules", "alerts_test.yml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_rule_has_a_unit_test_that_expects_it_to_fire():
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    firing = {c["alertname"] for t in tests for c in t.get("alert_rule_test", []) if c.get("exp_alerts")}
    quiet = {c["alertname"] for t in tests for c in t.get("alert_rule_test", []) if not c.get("exp_alerts")}
    assert alerts <= firing, f"alerts never shown to fire: {sorted(alerts - firing)}"
    assert alerts <= quiet, f"alerts never shown to stay quiet: {sorted(alerts - quiet)}"
    assert {"FedbrokerRoundStalled", "FedbrokerWorkerCannotAffordNextRound", "FedbrokerUploadRejectionRateHigh",
            "FedbrokerNoActiveWorkers", "FedbrokerBrokerConnectionLost", "FedbrokerRoundsFailing",
            "FedbrokerDeadLetters"} <= alerts


def promtool_test(tmp_path, alerts: str, tests: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "alerts.yml").write_text(alerts)
    (tmp_path / "alerts_test.yml").write_text(tests)
    return subprocess.run([tool("promtool"), "test", "rules", "alerts_test.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)


def test_a_broken_rule_fails_its_unit_test(tmp_path):
    """The unit tests can fail: the budget alert comparing the next round's cost with the whole budget instead
    of what is left no longer fires when it should."""
    alerts = (PROMETHEUS / "alerts.yml").read_text()
    broken = alerts.replace("> fedbroker_worker_epsilon_budget_remaining\n", "> fedbroker_worker_epsilon_budget\n")
    assert broken != alerts
    result = promtool_test(tmp_path, broken, (PROMETHEUS / "alerts_test.yml").read_text())
    assert result.returncode != 0 and "FedbrokerWorkerCannotAffordNextRound" in result.stdout + result.stderr


def test_the_rounds_failing_alert_needs_the_series_to_exist_at_zero_first(tmp_path):
    """Why the coordinator creates a job's counters at 0 when the job starts: a series that first appears at 1
    (how the counter looked before) never fires the alert, one that starts at 0 does."""
    alerts = (PROMETHEUS / "alerts.yml").read_text()

    def case(values: str, firing: bool) -> str:
        expected = ('[{exp_labels: {severity: warning, job_id: j}, exp_annotations: {summary: "Job j had a failed '
                    'round", description: "`fedbroker status --job j` shows the refusals and failures."}}]'
                    if firing else "[]")
        return ("rule_files: [alerts.yml]\nevaluation_interval: 1m\ntests:\n"
                f"  - interval: 1m\n    input_series:\n"
                f"      - {{series: 'fedbroker_coordinator_rounds_failed_total{{job_id=\"j\"}}', values: '{values}'}}\n"
                f"    alert_rule_test:\n      - {{eval_time: 5m, alertname: FedbrokerRoundsFailing, "
                f"exp_alerts: {expected}}}\n")

    started_at_zero = promtool_test(tmp_path, alerts, case("_ 0 0 1 1 1 1", firing=True))
    assert started_at_zero.returncode == 0, started_at_zero.stdout + started_at_zero.stderr
    first_seen_at_one = promtool_test(tmp_path, alerts, case("_ _ _ 1 1 1 1", firing=False))
    assert first_seen_at_one.returncode == 0, first_seen_at_one.stdout + first_seen_at_one.stderr
