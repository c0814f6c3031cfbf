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
    assert {"FedbrokerRoundStalled", "FedbrokerWorkerPrivacyBudgetNearlyExhausted", "FedbrokerUploadRejectionRateHigh",
            "FedbrokerNoActiveWorkers", "FedbrokerBrokerConnectionLost"} <= alerts


def test_a_broken_rule_fails_its_unit_test(tmp_path):
    """The unit tests can fail: the budget alert at 1% instead of 10% no longer fires when it should."""
    broken = (PROMETHEUS / "alerts.yml").read_text().replace("< 0.1\n", "< 0.01\n")
    (tmp_path / "alerts.yml").write_text(broken)
    (tmp_path / "alerts_test.yml").write_text((PROMETHEUS / "alerts_test.yml").read_text())
    result = subprocess.run([tool("promtool"), "test", "rules", "alerts_test.yml"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "FedbrokerWorkerPrivacyBudgetNearlyExhausted" in result.stdout + result.stderr
