"""Static security scan: checkov over what `kubectl kustomize` renders for base, dev, gpu and ha, and the Dockerfile.

No check may fail. A check the project does not fix is skipped where it applies, with its reason (a
`checkov.io/skip<N>: CKV_...=reason` annotation on the object, a `# checkov:skip=CKV_...:reason` comment in
the Dockerfile), and listed in deploy/README.md under "Security scan". checkov runs from its own virtualenv,
.venv-tools (`make security-tools`), offline (--skip-download), so it reports no severities: every failed
check needs a decision, a fix or a documented skip.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from typing import Any

import pytest

from tests.ops.conftest import DEPLOY, ROOT, missing, tool

TARGETS = {"base": "base", "dev": "overlays/dev", "gpu": "overlays/gpu", "ha": "overlays/ha"}
FRAMEWORKS = {"kubernetes", "dockerfile"}
HINT = "make security-tools (creates .venv-tools with the checkov version the Makefile pins)"


def pinned_version() -> str:
    match = re.search(r"^CHECKOV_VERSION\s*:?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, "the Makefile pins no CHECKOV_VERSION"
    return match.group(1)


def checkov() -> str:
    own = ROOT / ".venv-tools" / "bin" / "checkov"
    found = str(own) if own.exists() else shutil.which("checkov")
    if found is None:
        missing(f"checkov is not installed; install it with: {HINT}")
    return str(found)


@pytest.fixture(scope="module")
def scan(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """checkov's JSON report per framework, for the three rendered targets and the Dockerfile."""
    binary = checkov()
    work = tmp_path_factory.mktemp("checkov")
    for name, target in TARGETS.items():
        result = subprocess.run([tool("kubectl"), "kustomize", str(DEPLOY / "k8s" / target)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"kubectl kustomize {target} failed:\n{result.stderr}"
        (work / name).mkdir()
        (work / name / "rendered.yaml").write_text(result.stdout)
    shutil.copy(ROOT / "Dockerfile", work / "Dockerfile")
    # Not --quiet: it drops the skipped checks from the report, and they are checked against the README here.
    command = [binary, "--directory", str(work), "--framework", *sorted(FRAMEWORKS), "--compact",
               "--output", "json", "--skip-download"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=work)
    assert result.returncode in (0, 1), f"checkov exited {result.returncode}:\n{result.stderr[-4000:]}"
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    by_framework = {r["check_type"]: r for r in reports if "check_type" in r}
    assert set(by_framework) == FRAMEWORKS, f"checkov reported {sorted(by_framework)}:\n{result.stdout[:2000]}"
    version = by_framework["kubernetes"]["summary"]["checkov_version"]
    if version != pinned_version():
        missing(f"checkov {version} found, the Makefile pins {pinned_version()}: {HINT}")
    return by_framework


def _where(check: dict[str, Any]) -> str:
    return f"{check['check_id']} ({check['check_name']}): {check['resource']} in {check['file_path']}"


def test_checkov_scanned_every_rendered_target_and_the_dockerfile(scan):
    for framework, report in scan.items():
        assert report["summary"]["parsing_errors"] == 0, (framework, report["results"]["parsing_errors"])
    results = scan["kubernetes"]["results"]
    files = {c["file_path"] for kind in ("passed_checks", "failed_checks", "skipped_checks") for c in results[kind]}
    assert files == {f"/{name}/rendered.yaml" for name in TARGETS}
    assert scan["kubernetes"]["summary"]["resource_count"] >= 3 * 30
    assert scan["dockerfile"]["summary"]["resource_count"] == 1
    assert scan["kubernetes"]["summary"]["passed"] > 1000  # the checks ran, not only parsed


def test_no_check_fails(scan):
    failed = [_where(c) for report in scan.values() for c in report["results"]["failed_checks"]]
    assert not failed, ("fix these, or skip each with its reason in the manifest and list it in deploy/README.md "
                        "under 'Security scan':\n  " + "\n  ".join(failed))


def _readme_security_scan() -> str:
    readme = (DEPLOY / "README.md").read_text()
    match = re.search(r"^## Security scan\n(.*?)(?=^## |\Z)", readme, re.MULTILINE | re.DOTALL)
    assert match, "deploy/README.md has no '## Security scan' section"
    return match.group(1)


def test_every_skipped_check_has_a_reason_and_is_justified_in_the_readme(scan):
    skipped = [c for report in scan.values() for c in report["results"]["skipped_checks"]]
    assert skipped, "nothing is skipped: then drop the 'Security scan' skip list from deploy/README.md"
    for check in skipped:
        reason = check["check_result"].get("suppress_comment") or ""
        assert len(reason) > 20 and reason != "No comment provided", f"no reason given: {_where(check)}"
    # the table's first column; the text around it may name fixed checks
    documented = set(re.findall(r"^\|\s*(CKV_[A-Z0-9]+_\d+)\b", _readme_security_scan(), re.MULTILINE))
    ids = {c["check_id"] for c in skipped}
    assert ids <= documented, f"skipped without a line in deploy/README.md (Security scan): {sorted(ids - documented)}"
    assert documented <= ids, f"deploy/README.md (Security scan) lists checks no longer skipped: {sorted(documented - ids)}"
