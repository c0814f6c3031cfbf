"""`fedbroker demo` as a newcomer runs it: it finishes, prints the table, writes results.json and a plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def run_demo(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "fedbroker", "demo", "--rounds", "2", "--out", str(tmp_path), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    results = json.loads((run_dir / "results.json").read_text())
    assert (run_dir / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return results, proc.stdout


def check(results: dict, stdout: str, *, broker: str, dp: bool) -> None:
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    for r in results["rounds"]:
        assert set(r) >= {"round", "accuracy", "loss", "epsilon", "seconds"}
        assert 0.0 <= r["accuracy"] <= 1.0 and r["clients"] == 3
        assert (sorted(r["epsilon"]) == ["worker-0", "worker-1", "worker-2"]) is dp
    summary = results["summary"]
    assert summary["broker"] == broker and summary["status"] == "completed"
    assert summary["final_accuracy"] == results["rounds"][-1]["accuracy"]
    assert summary["centralized_accuracy"] > 0.85
    assert "final federated accuracy" in stdout and "centralised no-DP baseline" in stdout


def test_demo_with_dp_on_the_in_process_bus(tmp_path):
    results, stdout = run_demo(tmp_path)
    check(results, stdout, broker="in-process", dp=True)
    eps = [r["epsilon"]["worker-0"] for r in results["rounds"]]
    assert 0 < eps[0] < eps[1]


def test_demo_over_rabbitmq_as_separate_processes(tmp_path, rabbitmq_url):
    results, stdout = run_demo(tmp_path, "--broker", rabbitmq_url, "--no-dp", "--partition", "iid")
    check(results, stdout, broker="rabbitmq", dp=False)


@pytest.mark.parametrize("bus", ["in-process", "rabbitmq"])
def test_demo_in_async_mode_shows_versions(tmp_path, bus, request):
    extra = ["--broker", request.getfixturevalue("rabbitmq_url")] if bus == "rabbitmq" else []
    results, stdout = run_demo(tmp_path, "--mode", "async", *extra)
    assert results["unit"] == "version" and results["summary"]["status"] == "completed"
    assert len(results["rounds"]) == 6  # 2 rounds' worth of trainings: 3 workers × 2 / buffer 1
    versions = [r["model_version"] for r in results["rounds"]]
    assert versions == sorted(versions) and len(set(versions)) == 6
    table = stdout.split("training the centralised")[1]
    assert "version" in table.splitlines()[2] and "staleness" in table and "round" not in table.splitlines()[2]
    assert results["summary"]["broker"] == bus


def test_the_iris_demo_with_dp_completes_all_its_rounds_within_the_budget(tmp_path):
    results, stdout = run_demo(tmp_path, "--dataset", "iris", "--rounds", "5")
    assert results["summary"]["status"] == "completed" and results["refusals"] == []
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3, 4, 5]
    assert all(r["clients"] == 3 for r in results["rounds"])
    assert 0 < results["summary"]["max_epsilon"] <= 10.0
    assert "planned ε" in stdout
