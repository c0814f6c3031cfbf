"""The package declares what it needs to run: every third-party module the installed code imports comes
from a runtime requirement (requirements.txt, which pyproject.toml reads), never from the dev extra alone,
so `pip install .` gives a `fedbroker` command that runs."""

from __future__ import annotations

import ast
import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.source_roots import ROOT

PACKAGE_DIRS = ("fedbroker", "coordinator", "worker", "aggregators", "proto", "app")


def pins(name: str) -> dict[str, str]:
    out = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            dist, _, version = line.partition("==")
            assert version, f"{name}: {line!r} is not pinned with =="
            out[dist.lower().replace("_", "-")] = version
    return out


# Modules that may import an optional extra's distributions (lazily: the package runs without the extra).
OPTIONAL = {ROOT / "app" / "fedbroker" / "app" / "tracking.py": "requirements-tracking.txt"}


def imported_top_levels(paths: list[Path] | None = None) -> set[str]:
    if paths is None:
        paths = [p for folder in PACKAGE_DIRS for p in (ROOT / folder).rglob("*.py") if p not in OPTIONAL]
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_pyproject_reads_its_dependencies_from_the_requirements_files():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert set(project["project"]["dynamic"]) == {"dependencies", "optional-dependencies"}
    dynamic = project["tool"]["setuptools"]["dynamic"]
    assert dynamic["dependencies"] == {"file": ["requirements.txt"]}
    assert dynamic["optional-dependencies"]["dev"] == {"file": ["requirements-dev.txt"]}
    assert dynamic["optional-dependencies"]["tracking"] == {"file": ["requirements-tracking.txt"]}
    assert project["project"]["scripts"]["fedbroker"] == "fedbroker.app.cli:main"
    manifest = (ROOT / "MANIFEST.in").read_text()
    for name in ("requirements.txt", "requirements-dev.txt", "requirements-tracking.txt"):
        assert name in manifest  # an sdist can build


def test_runtime_and_dev_requirements_are_separate_and_torch_stays_pinned():
    runtime, dev = pins("requirements.txt"), pins("requirements-dev.txt")
    assert not runtime.keys() & dev.keys()
    assert runtime["torch"] == "2.13.0"
    assert {"pytest", "ruff", "mypy", "hypothesis", "grpcio-tools"} <= dev.keys()


def test_every_third_party_import_of_the_package_is_a_runtime_requirement():
    runtime = pins("requirements.txt")
    distributions = importlib.metadata.packages_distributions()
    stdlib = sys.stdlib_module_names
    ours = {"fedbroker", *PACKAGE_DIRS}
    missing = {}
    for module in sorted(imported_top_levels() - stdlib - ours - {"__future__", "_typeshed"}):
        dists = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not dists & runtime.keys():
            missing[module] = sorted(dists)
    assert not missing, f"imported at run time but not in requirements.txt: {missing}"


def test_an_optional_extra_is_imported_only_by_its_module_and_only_when_used():
    """MLflow (the tracking extra) comes from requirements-tracking.txt, never from the runtime pins, and only
    inside functions (or for the type checker), so `fedbroker` runs where the extra is not installed."""
    runtime = pins("requirements.txt")
    distributions = importlib.metadata.packages_distributions()
    for path, extra in OPTIONAL.items():
        allowed = pins(extra)
        assert not allowed.keys() & runtime.keys()
        tree = ast.parse(path.read_text(), filename=str(path))
        third_party = imported_top_levels([path]) - sys.stdlib_module_names - {"fedbroker", "__future__"}
        for module in third_party:
            dists = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
            assert dists & (allowed.keys() | runtime.keys()), (path.name, module, dists)
        at_import = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        eager = {a.name.split(".")[0] for n in at_import for a in n.names} | {
            n.module.split(".")[0] for n in at_import if isinstance(n, ast.ImportFrom) and n.module}
        assert not eager & {m for m in third_party if m not in runtime}, f"{path.name} imports its extra eagerly"


def test_the_fedbroker_command_lists_its_verbs():
    done = subprocess.run([sys.executable, "-m", "fedbroker", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for verb in ("demo", "worker", "coordinator", "aggregator", "submit", "status", "simulate"):
        assert verb in done.stdout, verb


def test_every_package_of_the_tree_is_listed_for_the_wheel():
    """pyproject.toml lists the packages by hand (one namespace over six source roots): a new subpackage
    left off the list would be missing from the wheel and the image."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"fedbroker", "fedbroker.k8s_base", "fedbroker.model_catalogue"}
    for root in (ROOT, *(ROOT / d for d in PACKAGE_DIRS[1:])):
        for init in (root / "fedbroker").rglob("__init__.py"):
            found.add(".".join(init.parent.relative_to(root).parts))
    assert listed == found


def test_the_version_is_the_installed_distributions_and_a_bare_checkout_says_so(monkeypatch, capsys):
    """The namespace has no __init__ to hold a __version__: `--version` asks the package metadata, and a
    checkout that was never installed has none."""
    from fedbroker.app.cli import main

    def installed(name: str) -> str:
        assert name == "fedbroker"
        return "9.9.9"

    def never_installed(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    for version, said in ((installed, "9.9.9"), (never_installed, "unknown (not installed)")):
        monkeypatch.setattr(importlib.metadata, "version", version)
        with pytest.raises(SystemExit) as done:
            main(["--version"])
        assert done.value.code == 0 and capsys.readouterr().out == f"fedbroker {said}\n"
