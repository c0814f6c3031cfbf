"""Write deploy/k8s/components/prometheus-operator/prometheusrule.yaml from deploy/prometheus/alerts.yml.

The alert rules live in one place (alerts.yml, unit-tested by promtool); the operator's PrometheusRule is
derived from it, and tests/ops/test_k8s.py fails when the two differ. Run: python -m tests.ops.sync_prometheus_rule
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
RULE = ROOT / "deploy" / "k8s" / "components" / "prometheus-operator" / "prometheusrule.yaml"
HEADER = ("# GENERATED from deploy/prometheus/alerts.yml (the rules promtool tests); tests/ops/test_k8s.py fails\n"
          "# when the two differ. Regenerate with: python -m tests.ops.sync_prometheus_rule\n")


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> Any:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render() -> str:
    groups = yaml.safe_load(ALERTS.read_text(encoding="utf-8"))["groups"]
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
           "metadata": {"name": "fedbroker", "labels": {"release": "kube-prometheus-stack"}},
           "spec": {"groups": groups}}
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=120)


if __name__ == "__main__":
    RULE.write_text(render(), encoding="utf-8")
    print(f"wrote {RULE.relative_to(ROOT)}")
