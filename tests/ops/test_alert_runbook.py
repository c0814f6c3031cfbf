"""Every alert has a runbook entry with first steps, and the alerts fit the job's clock.

No tool needed: the rules, the runbook and the job defaults are read as files and code. promtool's own proof
that FedbrokerNoActiveWorkers fires inside the window is a case in alerts_test.yml (test_prometheus_rules.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedbroker.job.spec import ScheduleConfig
from tests.ops.conftest import DEPLOY, ROOT

PROMETHEUS = DEPLOY / "prometheus"
UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def seconds(duration: str) -> float:
    """A Prometheus duration (`1m30s`, `15s`, `5m`) in seconds."""
    parts = re.findall(r"(\d+)(ms|s|m|h|d)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a Prometheus duration: {duration!r}"
    return sum(int(n) * UNITS[u] for n, u in parts)


def rules() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text(encoding="utf-8"))
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"] if "alert" in r}


def runbook(text: str) -> dict[str, list[str]]:
    """OPERATING.md's alert table: alert name → its cells (severity (for), meaning, first steps)."""
    section = text.split("## Alerts (`deploy/prometheus/alerts.yml`)", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `(Fedbroker\w+)` \|(.*)\|\s*$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split(" | ")]
    return rows


def test_every_alert_has_a_runbook_row_with_its_severity_and_first_steps():
    table = runbook((DEPLOY / "OPERATING.md").read_text(encoding="utf-8"))
    for name, rule in rules().items():
        assert name in table, f"{name} has no row in deploy/OPERATING.md's alert table"
        severity, meaning, steps = table[name]
        expected = rule["labels"]["severity"] + (f" ({rule['for']})" if "for" in rule else "")
        assert severity == expected, f"{name}: the runbook says {severity!r}, alerts.yml {expected!r}"
        assert len(meaning) > 20 and len(steps) > 20, f"{name}: the runbook row lacks its meaning or first steps"
    assert set(table) <= set(rules()), f"runbook rows without a rule: {sorted(set(table) - set(rules()))}"


def test_the_runbook_parser_sees_a_missing_row():
    """The check above can fail: a runbook without the async alert's row is caught."""
    text = (DEPLOY / "OPERATING.md").read_text(encoding="utf-8")
    cut = "\n".join(line for line in text.splitlines() if not line.startswith("| `FedbrokerAsyncJobNoVersion`"))
    assert "FedbrokerAsyncJobNoVersion" in runbook(text) and "FedbrokerAsyncJobNoVersion" not in runbook(cut)


@pytest.mark.parametrize("readme", [ROOT / "README.md", DEPLOY / "README.md"], ids=["README", "deploy/README"])
def test_every_alert_is_named_in_the_readmes_alert_list(readme: Path):
    text = readme.read_text(encoding="utf-8")
    listing = text[text.index("**Alerts**"):].split("\n\n", 1)[0]
    missing = [name for name in rules() if f"`{name}`" not in listing]
    assert not missing, f"{readme.relative_to(ROOT)}'s alert list lacks {missing}"


def test_the_unit_tests_evaluate_rules_as_often_as_prometheus_does():
    """An alert's `for` is counted in evaluations: promtool must step as the deployed Prometheus does."""
    deployed = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text(encoding="utf-8"))["global"]
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text(encoding="utf-8"))
    assert seconds(tests["evaluation_interval"]) == seconds(deployed["evaluation_interval"])


def test_no_active_workers_fires_before_a_default_job_stops_waiting():
    """Worst case from a job's start to the alert firing: one scrape before the coordinator's gauge is seen,
    one evaluation before it is noticed, the rule's `for`, one more evaluation to fire. A job with the default
    schedule fails after wait_for_workers_s; the alert must come first."""
    deployed = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text(encoding="utf-8"))["global"]
    worst = (seconds(rules()["FedbrokerNoActiveWorkers"]["for"]) + seconds(deployed["scrape_interval"])
             + 2 * seconds(deployed["evaluation_interval"]))
    assert worst < ScheduleConfig().wait_for_workers_s, (
        f"FedbrokerNoActiveWorkers may fire {worst:g}s after a job starts; a default job fails after "
        f"{ScheduleConfig().wait_for_workers_s:g}s")


def test_the_promtool_case_shows_no_active_workers_firing_inside_the_window():
    """alerts_test.yml holds a case where the alert fires before the default wait ends (promtool runs it)."""
    tests = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text(encoding="utf-8"))["tests"]
    fired = [seconds(c["eval_time"]) for t in tests for c in t.get("alert_rule_test", [])
             if c["alertname"] == "FedbrokerNoActiveWorkers" and c.get("exp_alerts")]
    quiet = [seconds(c["eval_time"]) for t in tests for c in t.get("alert_rule_test", [])
             if c["alertname"] == "FedbrokerNoActiveWorkers" and not c.get("exp_alerts")]
    assert min(fired) < ScheduleConfig().wait_for_workers_s
    assert min(quiet) < min(fired), "no case shows it quiet before its `for` has passed"
