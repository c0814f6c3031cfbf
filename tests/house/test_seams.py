"""The seams between a service's parts are public: no `Protocol` names another class's private members.

A Protocol that lists `_lock` or `_job` is a back-reference in disguise: the part that declares it reaches
into the class that implements it, which no import-cycle test sees (the implementer imports the part, the
part imports nothing back). The round book's secure rounds once did so (`secure_rounds.Book`); they now take
the book's public `JobTable`. A member with a leading underscore in a Protocol's body (a method, a property,
an annotated or assigned attribute) fails here; dunders (`__call__`) are public and pass.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator

from tests.house.test_layering import MODULES

BOOK_AS_IT_WAS = '''
class Book(Protocol):
    clock: Callable[[], float]
    _lock: threading.Lock

    def _job(self, job_id: str) -> Job: ...

    @staticmethod
    def _receiving(job: Job, header: pb.UpdateHeader) -> Round: ...
'''


def _is_protocol(base: ast.expr) -> bool:
    """`Protocol`, `typing.Protocol`, `Protocol[T]`, `typing_extensions.Protocol[T]`."""
    if isinstance(base, ast.Subscript):
        base = base.value
    return (isinstance(base, ast.Name) and base.id == "Protocol") or \
        (isinstance(base, ast.Attribute) and base.attr == "Protocol")


def _declared(body: list[ast.stmt]) -> Iterator[tuple[str, int]]:
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node.lineno
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            yield node.target.id, node.lineno
        elif isinstance(node, ast.Assign):
            yield from ((t.id, node.lineno) for t in node.targets if isinstance(t, ast.Name))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def protocols(source: str) -> Iterator[tuple[str, list[tuple[str, int]]]]:
    """(class name, its declared members with their lines) for every Protocol class in `source`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and any(_is_protocol(b) for b in node.bases):
            yield node.name, list(_declared(node.body))


def private_members(source: str) -> list[str]:
    """`Class._member:line` for every private member a Protocol of `source` declares."""
    return [f"{cls}.{name}:{line}" for cls, members in protocols(source) for name, line in members if _private(name)]


def test_a_protocol_over_private_members_is_caught() -> None:
    """The check sees the shape it forbids (the secure rounds' old `Book`), and lets a dunder through."""
    assert private_members(BOOK_AS_IT_WAS) == ["Book._lock:4", "Book._job:6", "Book._receiving:9"]
    assert private_members("class Check(typing.Protocol[T]):\n    def __call__(self) -> None: ...\n") == []


def test_no_protocol_declares_a_private_member() -> None:
    seen: set[str] = set()
    bad: list[str] = []
    for name, path in MODULES.items():
        if name.startswith("fedbroker.proto.fedbroker_pb2"):
            continue
        source = path.read_text(encoding="utf-8")
        seen.update(f"{name}.{cls}" for cls, _ in protocols(source))
        bad.extend(f"{name}: {found}" for found in private_members(source))
    assert "fedbroker.bus.base.Bus" in seen and "fedbroker.aggregators.weighting.base.Weighting" in seen, \
        f"the scan missed the house's Protocols: {sorted(seen)}"
    assert not bad, "Protocols naming private members (give the part a public collaborator instead):\n" + \
        "\n".join(bad)
