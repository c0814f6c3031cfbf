"""Where Flower lives: `.venv-bench` (`make bench-env`), never the project's own environment.

Flower pins protobuf < 7 and fedbroker's generated code needs protobuf 7, so Flower runs only in
subprocesses of that environment (`bench.averaging`, `bench.flower_sim`).
"""

from __future__ import annotations

import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_VENV = os.environ.get("FEDBROKER_BENCH_VENV", os.path.join(REPO, ".venv-bench"))


def bench_python() -> str | None:
    """The bench environment's interpreter when it can import Flower, else None."""
    python = os.path.join(BENCH_VENV, "bin", "python")
    if not os.path.exists(python):
        return None
    try:
        ok = subprocess.run([python, "-c", "import flwr.server.strategy.aggregate"], capture_output=True,
                            timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return python if ok else None
