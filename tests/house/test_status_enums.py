"""Statuses are compared as enums, never as bare strings, in the face.

The statuses a job and its parts move through live in the kernel (`fedbroker.job.status`); the coordinator
writes them and the face reads them off a reply, converting the wire's string once (`fedbroker.app.replies`).
A comparison of a `status` or `state` with a string literal (`r.status == "closed"`, `p["status"] in ("uploaded",
"aggregated")`) is a misspelling waiting to happen: it is silently never true. This file finds every one in the
face (app/fedbroker/app, provision included) and names it.
"""

from __future__ import annotations

import ast
import textwrap

import pytest

from tests.source_roots import ROOT, SOURCE_ROOTS

FACE = ROOT / "app" / "fedbroker" / "app"
SUFFIXES = ("status", "state")
KERNEL_STATUSES = ("JobStatus", "RoundStatus", "ParticipantStatus", "EvaluationStatus", "WorkerState")


def _named(node: ast.expr) -> str | None:
    """The name a compared value goes by: `x.status`, `status`, `row["status"]`, `row.get("status")`."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    key: ast.expr | None = None
    if isinstance(node, ast.Subscript):
        key = node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        key = node.args[0]
    return key.value if isinstance(key, ast.Constant) and isinstance(key.value, str) else None


def _literal(node: ast.expr) -> bool:
    """A string constant, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and bool(node.elts) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts)


def string_comparisons(source: str) -> list[tuple[int, str]]:
    """(line, code) of each comparison between a status or state and a string literal in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            names = [_named(side) for side in sides]
            if any(n is not None and n.lower().endswith(SUFFIXES) for n in names) and any(map(_literal, sides)):
                found.append((node.lineno, ast.get_source_segment(source, node) or ast.unparse(node)))
    return sorted(found)


@pytest.mark.parametrize("code", [
    'r.status == "closed"',
    'p.status in ("uploaded", "aggregated")',
    'who.status != "revoked"',
    'state == "coordinator_only"',
    'p["status"] in ("refused", "failed", "missed")',
    'job.get("status") == "completed"',
    '"open" == r.status',
    'w.worker_state == "idle"',
])
def test_the_scan_finds_a_status_compared_with_a_string(code: str) -> None:
    assert string_comparisons(code) == [(1, code)]


@pytest.mark.parametrize("code", [
    "round_status(r) is RoundStatus.CLOSED",
    "participant_status(p) in SENT",
    "who.status is Standing.REVOKED",
    'r.round == "1"',                 # not a status
    "r.status == other.status",       # two values, no literal
])
def test_the_scan_leaves_enum_comparisons_alone(code: str) -> None:
    assert string_comparisons(code) == []


def test_the_face_compares_no_status_with_a_bare_string() -> None:
    files = sorted(FACE.rglob("*.py"))
    assert files, f"no face modules under {FACE}"
    found = [f"{path.relative_to(ROOT)}:{line}: {code}"
             for path in files for line, code in string_comparisons(path.read_text(encoding="utf-8"))]
    assert not found, ("statuses compared with bare strings (read the wire's string into its enum with "
                       "fedbroker.app.replies and compare members of fedbroker.job.status):\n" + "\n".join(found))


def test_the_status_enums_are_defined_once_in_the_kernel() -> None:
    """The coordinator and the face share one list of each status: none is defined again outside the kernel."""
    again = []
    for root in SOURCE_ROOTS:
        for path in sorted((root / "fedbroker").rglob("*.py")):
            if path == ROOT / "fedbroker" / "job" / "status.py":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            again += [f"{path.relative_to(ROOT)}:{node.lineno}: class {node.name}" for node in ast.walk(tree)
                      if isinstance(node, ast.ClassDef) and node.name in KERNEL_STATUSES]
    assert not again, "status enums defined outside fedbroker/job/status.py:\n" + "\n".join(again)


def test_a_nested_comparison_is_found_on_its_own_line() -> None:
    source = textwrap.dedent("""\
        def f(rows):
            return [
                r for r in rows
                if r.status == "closed"
            ]
        """)
    assert string_comparisons(source) == [(4, 'r.status == "closed"')]

