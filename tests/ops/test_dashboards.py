"""Every metric a dashboard panel or an alert rule uses is one the code exports, and each dashboard shows
what an operator looks for first."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from fedbroker import metrics as shared_metrics
from fedbroker.aggregators import metrics as aggregator_metrics  # importing a service's metrics registers them
from fedbroker.coordinator import metrics as coordinator_metrics
from fedbroker.metrics import exported_names
from fedbroker.worker import metrics as worker_metrics
from tests.ops.conftest import DEPLOY

DASHBOARDS = sorted((DEPLOY / "grafana").glob("*.json"))
# Series Prometheus makes itself (not exported by any process).
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset", "bool",
             "inf", "nan", "le"}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (or a Grafana target with $variables)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    expr = re.sub(r"\$\w+", " ", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", expr):
        name, call = match.group(1), match.group(2)
        if not call and name not in _KEYWORDS and not re.fullmatch(r"\d.*", name):
            names.add(name)
    return names


def panel_exprs(dashboard: dict) -> list[tuple[str, str]]:
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
        for row_panel in panel.get("panels", []):
            out.extend((row_panel["title"], t["expr"]) for t in row_panel.get("targets", []))
    return out


def alert_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


def test_metric_name_extraction_sees_through_functions_matchers_and_ranges():
    expr = ('histogram_quantile(0.9, sum by (le, worker_id) (rate(fedbroker_worker_training_seconds_bucket'
            '{worker_id=~"$worker_id", outcome="x_total"}[$__rate_interval]))) / on (instance) '
            'group_left (job_id) up and time() - foo_seconds offset 5m > 0.5')
    assert metric_names(expr) == {"fedbroker_worker_training_seconds_bucket", "up", "foo_seconds"}


def test_there_are_the_three_dashboards():
    assert {p.stem for p in DASHBOARDS} >= {"overview", "workers", "aggregation"}


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_metric_a_dashboard_panel_uses_is_exported(path: Path):
    exported = exported_names() | SYNTHETIC
    dashboard = json.loads(path.read_text())
    unknown = {(title, name) for title, expr in panel_exprs(dashboard) for name in metric_names(expr)
               if name not in exported}
    assert not unknown, f"{path.name}: panels use metrics no process exports: {sorted(unknown)}"


def test_every_metric_an_alert_rule_uses_is_exported():
    exported = exported_names() | SYNTHETIC
    unknown = {(alert, name) for alert, expr in alert_exprs() for name in metric_names(expr) if name not in exported}
    assert not unknown, f"alert rules use metrics no process exports: {sorted(unknown)}"



def test_a_misspelt_metric_would_be_caught():
    assert "fedbroker_coordinator_rounds_complete_total" not in exported_names()
    assert "fedbroker_coordinator_rounds_completed_total" in exported_names()


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboards_are_importable_grafana_json(path: Path):
    dashboard = json.loads(path.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 30
    assert any(v["type"] == "datasource" for v in dashboard["templating"]["list"])
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["panels"]
    for panel in dashboard["panels"]:
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]) and panel["targets"]
        assert all(t["expr"].strip() and t["refId"] for t in panel["targets"])


@pytest.mark.parametrize("name, needed", [
    ("overview", {"fedbroker_coordinator_rounds_completed_total", "fedbroker_coordinator_model_accuracy",
                  "fedbroker_coordinator_round_duration_seconds_bucket", "fedbroker_coordinator_round_participants",
                  "fedbroker_coordinator_round_aggregated", "fedbroker_coordinator_workers_active",
                  "fedbroker_coordinator_rounds_failed_total", "fedbroker_coordinator_category_workers_active",
                  "fedbroker_coordinator_category_jobs", "fedbroker_coordinator_dead_letter_messages",
                  "fedbroker_coordinator_federated_accuracy", "fedbroker_coordinator_evaluation_reports_total"}),
    ("workers", {"fedbroker_worker_epsilon_spent", "fedbroker_worker_epsilon_budget_remaining",
                 "fedbroker_worker_epsilon_next_round_cost",
                 "fedbroker_worker_training_samples_per_second", "fedbroker_worker_tasks_total",
                 "fedbroker_worker_evaluations_total", "fedbroker_coordinator_site_heartbeat_age_seconds",
                 "fedbroker_coordinator_site_log_records_stored_total",
                 "fedbroker_coordinator_site_log_records_total"}),
    ("aggregation", {"fedbroker_aggregator_aggregation_seconds_bucket", "fedbroker_aggregator_received_bytes_total",
                     "fedbroker_aggregator_sent_bytes_total", "fedbroker_aggregator_uploads_rejected_total",
                     "fedbroker_aggregator_alignment_matched_distance", "fedbroker_aggregator_selection_fitness",
                     "fedbroker_grpc_server_handling_seconds_bucket",
                     "fedbroker_aggregator_robust_updates_discarded_total",
                     "fedbroker_aggregator_secure_rounds_total", "fedbroker_aggregator_secure_workers_dropped_total",
                     "fedbroker_aggregator_secure_unmask_seconds_bucket"}),
])
def test_each_dashboard_shows_what_its_operators_look_for(name, needed):
    dashboard = json.loads((DEPLOY / "grafana" / f"{name}.json").read_text())
    used = {n for _, expr in panel_exprs(dashboard) for n in metric_names(expr)}
    assert needed <= used, sorted(needed - used)


def test_no_metric_has_a_per_round_or_per_sample_label():
    from prometheus_client.metrics import MetricWrapperBase

    allowed = {"job_id", "worker_id", "client", "reason", "rpc", "status", "outcome", "category", "message", "kind",
               "alignment", "weighting", "selection", "robust", "grpc_service", "grpc_method", "grpc_code",
               "stage", "part"}
    seen = 0
    for module in (aggregator_metrics, coordinator_metrics, worker_metrics, shared_metrics):
        for name, value in vars(module).items():
            if isinstance(value, MetricWrapperBase):
                seen += 1
                assert set(value._labelnames) <= allowed, (name, value._labelnames)
                assert "job" not in value._labelnames and "instance" not in value._labelnames  # Prometheus' own
    assert seen >= 40


def test_the_rounds_per_hour_panel_counts_rounds_by_counters_that_start_at_zero():
    """increase() on `rounds_started` misses a job's first round (it starts before its 0 is scraped): the panel
    counts the rounds that ended, whose counters exist at 0 long before."""
    dashboard = json.loads((DEPLOY / "grafana" / "overview.json").read_text())
    exprs = [expr for title, expr in panel_exprs(dashboard) if title == "Rounds per hour"]
    used = {n for expr in exprs for n in metric_names(expr)}
    assert used == {"fedbroker_coordinator_rounds_completed_total", "fedbroker_coordinator_rounds_failed_total"}
    assert all("increase(" in expr for expr in exprs)
