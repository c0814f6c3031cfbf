"""No pickle anywhere: nothing outside tests/ imports a pickle-like module, loads tensors or YAML in a way that
can construct objects, or evaluates text as code; and a checkpoint crafted with a pickled object is refused.

The scan reads the syntax tree of every Python file (not the text: a docstring that says "never pickle" is
fine, a `numpy.load` split over lines is still found)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import numpy as np
import pytest

from fedbroker.coordinator.checkpoints import load_checkpoint, save_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SKIP_DIRS = {"tests", ".git", ".hypothesis", "__pycache__", "build", "runs", "node_modules"}
PICKLE_LIKE = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle", "joblib"}
CODE_FROM_TEXT = {"eval", "exec", "compile"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader"}


def sources() -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.startswith(".venv") and not d.endswith(".egg-info")]
        found.extend(Path(folder) / f for f in files if f.endswith(".py"))
    return sorted(found)


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.AST | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for node in ast.walk(tree):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            found += [f"{line}: imports {a.name}" for a in node.names if a.name.split(".")[0] in PICKLE_LIKE]
        elif isinstance(node, ast.ImportFrom):
            module = (node.module or "").split(".")[0]
            if module in PICKLE_LIKE:
                found.append(f"{line}: imports from {node.module}")
            if module in ("torch", "numpy", "yaml") and any(a.name in ("load", "unsafe_load", "full_load")
                                                            for a in node.names):
                found.append(f"{line}: imports a bare load from {module} (call it through the module)")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in CODE_FROM_TEXT:
                found.append(f"{line}: {name}() turns text into code")
            elif name == "torch.load" and not _is_const(_keyword(node, "weights_only"), True):
                found.append(f"{line}: torch.load without weights_only=True")
            elif name in ("np.load", "numpy.load") and not _is_const(_keyword(node, "allow_pickle"), False):
                found.append(f"{line}: {name} without allow_pickle=False")
            elif name in ("yaml.unsafe_load", "yaml.full_load", "yaml.load_all", "yaml.unsafe_load_all"):
                found.append(f"{line}: {name} can construct objects")
            elif name == "yaml.load":
                loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
                if loader is None or _dotted(loader).split(".")[-1] not in SAFE_YAML_LOADERS:
                    found.append(f"{line}: yaml.load without SafeLoader")
            for k in node.keywords:
                if k.arg == "allow_pickle" and not _is_const(k.value, False):
                    found.append(f"{line}: allow_pickle is not False")
        elif isinstance(node, ast.Name) and node.id in PICKLE_LIKE:
            found.append(f"{line}: uses {node.id}")
    return found


def test_the_scan_covers_the_services_and_catches_each_pattern(tmp_path):
    names = {str(p.relative_to(ROOT)) for p in sources()}
    assert {"fedbroker/rpc/codec.py", "coordinator/fedbroker/coordinator/checkpoints.py", "worker/fedbroker/worker/agent.py",
            "aggregators/fedbroker/aggregators/service.py"} <= names
    assert not any(n.startswith("tests/") for n in names)
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport numpy as np, torch, yaml\nnp.load('x')\nnp.load('x', allow_pickle=True)\n"
                   "torch.load('m')\ntorch.load('m', weights_only=False)\nyaml.load(s)\nyaml.load(s, Loader=yaml.Loader)\n"
                   "eval(data)\nexec(data)\nfrom numpy import load\n")
    flagged = {int(problem.split(":")[1]) for problem in problems(bad)}
    assert flagged == set(range(1, 12)) - {2}, problems(bad)
    ok = tmp_path / "ok.py"
    ok.write_text('"""never pickle"""\nimport numpy as np, torch, yaml\nnp.load("x", allow_pickle=False)\n'
                  'torch.load("m", weights_only=True)\nyaml.safe_load(s)\nyaml.load(s, Loader=yaml.SafeLoader)\n'
                  "model.eval()\n")
    assert problems(ok) == []


def test_no_source_file_uses_pickle_or_turns_data_into_code():
    found = [problem for path in sources() for problem in problems(path)]
    assert not found, "\n".join(found)


class _Payload:
    """Unpickling this touches a file: proof that code would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.marker.touch, ())


def test_a_checkpoint_with_a_pickled_object_array_is_refused_and_runs_nothing(tmp_path):
    good = save_checkpoint(tmp_path, "job", 1, {"0.weight": np.ones((2, 2), np.float32)}, '{"layers": []}')
    assert good.endswith(".safetensors") and load_checkpoint(good)[0]["0.weight"].shape == (2, 2)
    marker = tmp_path / "pwned"
    payload = np.empty(1, dtype=object)
    payload[0] = _Payload(marker)
    crafted = tmp_path / "job" / "round-00002.npz"  # numpy's archive, which can carry pickled objects
    with open(crafted, "wb") as fh:
        np.savez(fh, **{"0.weight": payload})
    with pytest.raises(ValueError, match="not a safetensors checkpoint"):
        load_checkpoint(crafted)
    assert not marker.exists()
    disguised = tmp_path / "job" / "round-00003.safetensors"  # the same archive under a checkpoint's name
    disguised.write_bytes(crafted.read_bytes())
    with pytest.raises(ValueError, match="not a safetensors checkpoint"):
        load_checkpoint(disguised)
    assert not marker.exists()
    with np.load(crafted, allow_pickle=True) as data:  # the payload is live: loading it unsafely runs it
        data["0.weight"]
    assert marker.exists()
