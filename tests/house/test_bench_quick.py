"""`python -m bench --quick` runs every benchmark and each one measures something finite.

Times are never asserted (they belong to `make bench`, measured against baselines in the same run).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from bench.__main__ import BENCHMARKS
from tests.source_roots import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
REPO = str(ROOT)


def finite_medians(rows):
    return [v["median"] for row in rows for v in row.values()
            if isinstance(v, dict) and isinstance(v.get("median"), (int, float)) and math.isfinite(v["median"])]


def test_quick_bench_gives_every_benchmark_a_finite_number(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results["benchmarks"]) == set(BENCHMARKS)
    for name, section in results["benchmarks"].items():
        assert finite_medians(section["rows"]), f"{name} measured nothing: {section['notes']}"
    table = (tmp_path / "results.md").read_text()
    assert "python -m bench --quick" in table and results["machine"]["cpu"] in table
