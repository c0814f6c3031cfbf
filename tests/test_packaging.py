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

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("fedbroker", "coordinator", "worker", "aggregators", "proto")


def pins(name: str) -> dict[str, str]:
    out = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            dist, _, version = line.partition("==")
            assert version, f"{name}: {line!r} is not pinned with =="
            out[dist.lower().replace("_", "-")] = version
    return out


def imported_top_levels() -> set[str]:
    names: set[str] = set()
    for folder in PACKAGE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
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
    assert project["project"]["scripts"]["fedbroker"] == "fedbroker.app.cli:main"
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "requirements.txt" in manifest and "requirements-dev.txt" in manifest  # an sdist can build


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


def test_the_fedbroker_command_lists_its_verbs():
    done = subprocess.run([sys.executable, "-m", "fedbroker", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for verb in ("demo", "worker", "coordinator", "aggregator", "submit", "status", "simulate"):
        assert verb in done.stdout, verb


def test_every_package_of_the_tree_is_listed_for_the_wheel():
    """pyproject.toml lists the packages by hand (one namespace over five source roots): a new subpackage
    left off the list would be missing from the wheel and the image."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"fedbroker", "fedbroker.k8s_base"}
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
