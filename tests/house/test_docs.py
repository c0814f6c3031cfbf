"""The documents hold together: docs/algorithms.md is the repository's own account of its algorithms
(nothing points outside the repository for it, and it names every registered algorithm and every parameter
with the code's default); the README stays the user's short path and its links, like those of docs/ and
deploy/, reach a file and a heading that exist."""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fedbroker.aggregators.alignment import ALIGNMENT
from fedbroker.aggregators.registry import Registry
from fedbroker.aggregators.robust import ROBUST
from fedbroker.aggregators.selection import SELECTION
from fedbroker.aggregators.weighting import WEIGHTING
from tests.source_roots import ROOT

DOC = ROOT / "docs" / "algorithms.md"
# Built from pieces so this file does not match its own search.
FORBIDDEN = ("ALGORITHMS" + ".md", ".." + "/shared")
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "build", "dist", "docs", "__pycache__"}
REGISTRIES: dict[str, Registry[Any]] = {"alignment": ALIGNMENT, "weighting": WEIGHTING, "selection": SELECTION,
                                        "robust": ROBUST}


def _repository_files() -> list[Path]:
    """Tracked (and new, not ignored) .py and .md files; a directory walk where git is unavailable."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*.py", "*.md"],
            cwd=ROOT, capture_output=True, text=True, check=True, timeout=60,
        ).stdout.splitlines()
        paths = [ROOT / p for p in listed]
    except (OSError, subprocess.SubprocessError):
        paths = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".md")]
    return sorted(
        p for p in paths
        if p.is_file() and not SKIP_DIRS.intersection(p.relative_to(ROOT).parts[:-1])
    )


def test_no_file_outside_docs_points_to_the_private_notes() -> None:
    files = _repository_files()
    assert files, "found no .py or .md files to check"
    offenders: list[str] = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), start=1):
            offenders.extend(
                f"{path.relative_to(ROOT)}:{lineno}: {needle}" for needle in FORBIDDEN if needle in line
            )
    assert not offenders, "point to docs/algorithms.md instead:\n" + "\n".join(offenders)


def _algorithms() -> list[tuple[str, str, type]]:
    return [(kind, name, registry.get(name)) for kind, registry in REGISTRIES.items() for name in registry.names()]


def _doc_default(value: object) -> str:
    """How the doc's parameter tables write a code default."""
    if value is dataclasses.MISSING:
        return "required"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None:
        return "`null`"
    return f"`{value}`"


def _table_defaults(doc: str) -> dict[str, set[str]]:
    """Parameter name → the second cell of every table row `| `name` | default | ... |`."""
    defaults: dict[str, set[str]] = {}
    for match in re.finditer(r"^\| `(\w+)` \| ([^|]+?) \|", doc, flags=re.MULTILINE):
        defaults.setdefault(match.group(1), set()).add(match.group(2).strip())
    return defaults


def test_the_registries_are_not_empty() -> None:
    for kind, registry in REGISTRIES.items():
        assert registry.names(), f"no {kind} algorithms registered"


@pytest.mark.parametrize(("kind", "name", "cls"), _algorithms(), ids=lambda v: getattr(v, "__name__", str(v)))
def test_every_registered_algorithm_and_parameter_is_documented(kind: str, name: str, cls: type) -> None:
    doc = DOC.read_text(encoding="utf-8")
    assert f"`{name}`" in doc, f"{kind} algorithm {name!r} is not named in docs/algorithms.md"
    if not dataclasses.is_dataclass(cls):
        return
    tables = _table_defaults(doc)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        assert field.name in tables, f"{kind} {name!r}: parameter {field.name!r} has no row in a parameter table"
        default = field.default
        if default is dataclasses.MISSING and field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        written = _doc_default(default)
        assert written in tables[field.name], (
            f"{kind} {name!r}: parameter {field.name!r} defaults to {written} in the code, "
            f"docs/algorithms.md says {sorted(tables[field.name])}"
        )


# ----- the README is the user's path; docs/ and deploy/ hold the rest, and every link between them lands -----

README = ROOT / "README.md"
README_MAX_LINES = 450
LINKED_DOCS = (README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "deploy").glob("*.md")))


def test_the_readme_keeps_the_two_commands_and_stays_short() -> None:
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text
    lines = len(text.splitlines())
    assert lines < README_MAX_LINES, f"README.md has {lines} lines: move reference material to docs/"
    assert (ROOT / "docs" / "architecture.md").is_file()


def _heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors: a heading lower-cased, punctuation dropped, spaces as hyphens, repeats numbered."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#+\s+(.*)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_a_heading(doc: Path) -> None:
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.DOTALL)
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _heading_anchors(path):
            broken.append(f"{link}: no such heading")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)
