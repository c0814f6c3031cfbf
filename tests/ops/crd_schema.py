"""CloudNativePG's Cluster checked against the schema of the operator's own CRD.

No registry this project reaches ships the CRD's openAPIV3Schema as data. What the npm registry does serve is
`@kubernetes-models/cloudnative-pg` 1.0.0, whose build (`crd-generate`) read the operator's v1.29.0 release
manifest (`cnpg-1.29.0.yaml`) and compiled each CRD's schema into an Ajv validator; `make crd-tools` installs
it (pinned in the Makefile and tests/ops/cnpg_schema/package-lock.json) and node runs it
(tests/ops/cnpg_schema/validate.mjs). It enforces what the CRD says: types, enums, required fields, bounds,
patterns, quantities. It does not refuse unknown fields (the CRD leaves them to the API server, which prunes
them): tests/ops/operator_types.py does that.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.ops.conftest import ROOT, missing

INSTALLED = ROOT / ".k8s-tools" / "cnpg-schema" / "node_modules" / "@kubernetes-models" / "cloudnative-pg"
CLUSTER_VALIDATOR = INSTALLED / "_schemas" / "PostgresqlCnpgIoV1Cluster.js"
RUNNER = Path(__file__).parent / "cnpg_schema" / "validate.mjs"
OPERATOR_MANIFEST = "cloudnative-pg/releases/download/v1.29.0/cnpg-1.29.0.yaml"
HINT = "make crd-tools (@kubernetes-models/cloudnative-pg, pinned in the Makefile)"


def _installed_package() -> dict[str, Any]:
    """The installed package, refused unless it is the pinned version and was generated from the CRD."""
    if not CLUSTER_VALIDATOR.exists():
        missing(f"CloudNativePG's CRD schema is not installed; install it with: {HINT}")
    package: dict[str, Any] = json.loads((INSTALLED / "package.json").read_text())
    pinned = re.search(r"^CNPG_SCHEMA_PACKAGE\s*:=\s*@kubernetes-models/cloudnative-pg@(\S+)",
                       (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert pinned and package["version"] == pinned.group(1), f"cloudnative-pg {package['version']} installed: {HINT}"
    sources = package.get("crd-generate", {}).get("input", [])
    assert any(s.endswith(OPERATOR_MANIFEST) for s in sources), f"not generated from the operator's CRD: {sources}"
    return package


def cluster_schema_problems(clusters: list[dict[str, Any]]) -> list[list[str]]:
    """Each Cluster's problems against the CRD schema ("/spec/instances: minimum {...}"), [] for a valid one."""
    _installed_package()
    node = shutil.which("node")
    if node is None:
        missing(f"node is not installed (Node.js runs CloudNativePG's compiled schema): {HINT}")
    done = subprocess.run([str(node), str(RUNNER), str(CLUSTER_VALIDATOR)], input=json.dumps(clusters),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"the schema runner failed: {done.stderr[-2000:]}"
    problems: list[list[str]] = json.loads(done.stdout)
    assert len(problems) == len(clusters)
    return problems
