"""The house's walls: who may import whom, read from the source (every import, function-local ones too).

- One namespace, six source roots: the kernel in `fedbroker/`, each service in its own top-level folder
  (`coordinator/fedbroker/coordinator/...`), and the face on top in `app/fedbroker/app/`. Every module has
  exactly one file, no file is a link, and the folders are not importable by their bare names (`import
  coordinator` fails).
- The kernel (`fedbroker/*.py` and its wings: `bus/`, `job/`, `algorithms/`, `rpc/`, `secagg/`, `datasets/`)
  imports no service and not the app: it is what the services share, so a change in a service never ripples
  into it. No kernel folder holds more than 15 modules on its top level.
- The services (`fedbroker.coordinator`, `.worker`, `.aggregators`) never import the app, nor each other:
  each imports only the kernel, the generated protocol and itself.
- Services import only the kernel and the generated protocol, never each other (a star, not a stack).
- No module over 600 lines and no function over 80 (generated code aside), and none within 50 lines of the cap
  (a module that close is one cut for size away from a seam cut for meaning).
- No import cycles, counted over module files (a package's `__init__` importing its own submodules is
  not a cycle).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.source_roots import ROOT, SOURCE_ROOTS

SERVICES = ("fedbroker.coordinator", "fedbroker.worker", "fedbroker.aggregators")
APP = "fedbroker.app"
BARE = {"coordinator", "worker", "aggregators", "proto", "app"}


def _module_files() -> Iterator[tuple[str, Path]]:
    """(dotted name, file) for every module under each source root's `fedbroker/` portion."""
    for root in SOURCE_ROOTS:
        for folder, dirs, files in os.walk(root / "fedbroker"):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = Path(folder).relative_to(root)
            for name in files:
                if name.endswith(".py"):
                    parts = [*rel.parts, name[:-3]]
                    if parts[-1] == "__init__":
                        parts.pop()
                    yield ".".join(parts), Path(folder) / name


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for name, path in _module_files():
        assert name not in found, f"{name} has two files: {found[name]} and {path}"
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in the file, resolved to a module of ours where possible."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                yield (candidate if candidate in MODULES else base), node.lineno


def _internal_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for target, _ in _imports(name, path):
            if target in MODULES and target != name:
                # a package importing its own submodules (its public face) is how packages are built
                if path.name == "__init__.py" and target.startswith(name + "."):
                    continue
                graph[name].add(target)
    return graph


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_kernel(module: str) -> bool:
    return module.startswith("fedbroker") and not any(_in(module, p) for p in (*SERVICES, APP, "fedbroker.proto")) \
        and module != "fedbroker.__main__"


def test_the_kernel_imports_no_service_and_not_the_app() -> None:
    bad = [f"{name} imports {target} (line {line})"
           for name, path in MODULES.items() if _is_kernel(name)
           for target, line in _imports(name, path)
           if any(_in(target, p) for p in (*SERVICES, APP))]
    assert not bad, "the kernel must not import services or the app:\n" + "\n".join(bad)


def test_services_import_only_the_kernel_and_the_protocol() -> None:
    """A star, not a stack: what two services share lives in the kernel, so no service stands on another."""
    bad = []
    for name, path in MODULES.items():
        own = next((s for s in SERVICES if _in(name, s)), None)
        if own is None:
            continue
        for target, line in _imports(name, path):
            if not _in(target, "fedbroker") or _in(target, own):
                continue
            if not (_is_kernel(target) or _in(target, "fedbroker.proto")):
                bad.append(f"{name} imports {target} (line {line})")
    assert not bad, "a service may import only the kernel, the protocol and itself:\n" + "\n".join(bad)


def test_services_never_import_the_app() -> None:
    bad = [f"{name} imports {target} (line {line})"
           for name, path in MODULES.items() if any(_in(name, s) for s in SERVICES)
           for target, line in _imports(name, path) if _in(target, APP)]
    assert not bad, "\n".join(bad)


def test_nothing_imports_the_top_level_folders_by_their_bare_names() -> None:
    sources = [*MODULES.values(), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py"),
               *ROOT.glob("experiments/*.py")]
    bad = []
    for path in sources:
        rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for target, line in _imports("", path):
            if target.split(".")[0] in BARE:
                bad.append(f"{rel}:{line} imports {target}; use fedbroker.{target}")
    assert not bad, "\n".join(bad)


def test_there_are_no_import_cycles() -> None:
    graph = _internal_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_walls_are_seen_by_this_test() -> None:
    """The checks above read the right tree: every service and the app are found under their source roots."""
    for package in (*SERVICES, APP, "fedbroker.proto", "fedbroker.job.spec", "fedbroker.rpc.codec"):
        assert package in MODULES, f"{package} not found under {[str(r) for r in SOURCE_ROOTS]}"
    assert "fedbroker.aggregators.alignment.feddna" in MODULES


def test_no_file_in_the_repository_is_a_link() -> None:
    """A link gives a file two paths (and breaks on checkouts without link support)."""
    listed = subprocess.run(["git", "ls-files", "-s"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    links = [line.split("\t", 1)[1] for line in listed.splitlines() if line.startswith("120000 ")]
    assert not links, f"symbolic links in the repository: {links}"


def test_every_module_loads_from_its_one_file() -> None:
    """What Python imports is the file this test found: the path in a traceback is the path in git."""
    probe = "import importlib, sys; print(importlib.import_module(sys.argv[1]).__file__)"
    for name in ("fedbroker.coordinator.scheduler", "fedbroker.worker.agent", "fedbroker.aggregators.mean",
                 "fedbroker.proto.fedbroker_pb2", "fedbroker.job.spec", "fedbroker.app.cli"):
        done = subprocess.run([sys.executable, "-c", probe, name], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert Path(done.stdout.strip()) == MODULES[name], name


@pytest.mark.parametrize("folder", ["coordinator", "worker", "aggregators", "proto", "app"])
def test_a_service_folder_is_not_importable_by_its_bare_name(folder: str) -> None:
    done = subprocess.run([sys.executable, "-c", f"import {folder}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    assert f"import fedbroker.{folder}" in done.stderr


FILE_LIMIT, FUNCTION_LIMIT, JUST_UNDER = 600, 80, 550


def test_no_room_is_too_big_to_read() -> None:
    """No module of the package over 600 lines, no function over 80 (generated protocol code aside)."""
    too_big = []
    for name, path in MODULES.items():
        if name.startswith("fedbroker.proto.fedbroker_pb2"):
            continue
        text = path.read_text(encoding="utf-8")
        if (lines := len(text.splitlines())) > JUST_UNDER:
            too_big.append(f"{path.relative_to(ROOT)}: {lines} lines (the cap is {FILE_LIMIT}; a module within "
                           f"{FILE_LIMIT - JUST_UNDER} of it is one cut for size away: find its seam)")
        for node in ast.walk(ast.parse(text, filename=str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.end_lineno is None:
                continue
            if (length := node.end_lineno - node.lineno + 1) > FUNCTION_LIMIT:
                too_big.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not too_big, "\n".join(too_big)


ROOMS = ("kernel", "coordinator", "worker", "aggregators", "app")
CROSS_ROOM = ("integration", "faults", "security", "lifecycle", "ops", "evaluation", "experiments", "house", "ha")


def test_tests_mirror_the_rooms() -> None:
    """A room's tests are found from the room: every test file sits in a room's folder (or a cross-room one such
    as integration or faults), none at the top of tests/."""
    tests = ROOT / "tests"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert not top, f"test files at the top of tests/ (move each into its room's folder): {top}"
    folders = sorted(p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__" and
                     any(p.rglob("test_*.py")))
    unknown = [name for name in folders if name not in ROOMS + CROSS_ROOM]
    assert not unknown, f"test folders that are neither a room nor cross-room: {unknown}"
    assert set(ROOMS) <= set(folders), f"a room without tests: {sorted(set(ROOMS) - set(folders))}"


KERNEL_FOLDER_LIMIT = 15


def test_the_face_stands_on_its_own_root_and_the_kernel_has_wings() -> None:
    """The app is the top floor: its files live under `app/`, not inside the kernel's folder. The kernel keeps
    its modules in wings, so no folder of it is a hall of more than 15 modules."""
    app_files = [path for name, path in MODULES.items() if _in(name, APP)]
    assert app_files and all(path.is_relative_to(ROOT / "app") for path in app_files), \
        "the face (fedbroker.app) must live under app/fedbroker/app"
    halls = []
    for folder in sorted({path.parent for name, path in MODULES.items() if _is_kernel(name)}):
        modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        if len(modules) > KERNEL_FOLDER_LIMIT:
            halls.append(f"{folder.relative_to(ROOT)}: {len(modules)} modules")
    assert not halls, f"kernel folders over {KERNEL_FOLDER_LIMIT} top-level modules (give them wings): {halls}"


def _environment_reads(tree: ast.Module) -> Iterator[tuple[str, int]]:
    """(variable, line) for each read of the environment that names its variable, by a literal or a module-level
    string constant: `os.environ[…]`, `os.environ.get/pop/setdefault(…)`, `os.getenv(…)`, `… in os.environ`."""
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(target, ast.Name)}

    def environ(node: ast.expr) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ")

    for node in ast.walk(tree):
        key: ast.expr | None = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if (isinstance(f, ast.Attribute) and (f.attr == "getenv" or (f.attr in ("get", "pop", "setdefault")
                                                                          and environ(f.value)))) or (
                    isinstance(f, ast.Name) and f.id == "getenv"):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn) \
                and environ(node.comparators[0]):
            key = node.left
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            yield key.value, node.lineno
        elif isinstance(key, ast.Name) and key.id in constants:
            yield constants[key.id], node.lineno


def test_no_production_module_opens_a_door_for_tests_through_the_environment() -> None:
    """A test watches or breaks a process by what it injects (a test's own entry point), never by a variable the
    production code reads: no module of the package reads an environment variable whose name says TEST."""
    seen = ast.parse('import os\nEXIT = "FEDBROKER_TEST_SECURE_EXIT_AT"\nif os.environ.get(EXIT) == "w:masked": pass\n'
                     'folder = os.getenv("A_TEST_DIR")\nif "TESTING" in os.environ: pass\nos.environ["HOME"]\n')
    assert [name for name, _ in sorted(_environment_reads(seen), key=lambda r: r[1])] == [
        "FEDBROKER_TEST_SECURE_EXIT_AT", "A_TEST_DIR", "TESTING", "HOME"]  # the check sees the door it forbids
    doors = [f"{path.relative_to(ROOT)}:{line} reads {variable}" for name, path in MODULES.items()
             if not name.startswith("fedbroker.proto.fedbroker_pb2")
             for variable, line in _environment_reads(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
             if "TEST" in variable.upper()]
    assert not doors, "production code reads a test's switch from the environment:\n" + "\n".join(doors)
