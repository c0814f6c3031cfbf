"""Every example in examples/ runs as its README says, through `fedbroker simulate`: its data is generated
(into a temporary folder), its worker config and job are the shipped files, and the federation learns.

Without DP training is deterministic (seeded), so the accuracy floors hold on any machine; the DP run of the
tabular example checks what DP makes certain (the job completes within every owner's ε budget)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedbroker.config import load_config
from fedbroker.datasets import load_worker_data

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def make_data(example: str, out: Path) -> None:
    subprocess.run([sys.executable, str(EXAMPLES / example / "make_data.py"), "--out", str(out)], check=True,
                   capture_output=True, timeout=120)


def worker_config(example: str, tmp_path: Path, *, dp: bool) -> Path:
    """The shipped worker.yaml, pointed at the data generated in tmp_path (and DP switched as asked)."""
    settings = yaml.safe_load((EXAMPLES / example / "worker.yaml").read_text())
    worker = settings["worker"]
    if "idx_dir" in worker:
        worker["idx_dir"] = str(tmp_path / "data")
    else:
        worker["data"]["path"] = str(tmp_path / "data" / Path(worker["data"]["path"]).name)
    worker["dp"]["enabled"] = dp
    path = tmp_path / "worker.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def simulate(tmp_path: Path, job: str, *args: str) -> tuple[dict, str]:
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "fedbroker", "simulate", str(EXAMPLES / job), "--workers", "3",
                           "--out", str(out), *args], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = list(out.iterdir())
    assert (run_dir / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((run_dir / "results.json").read_text())
    assert results["summary"]["status"] == "completed"
    assert "final federated accuracy" in proc.stdout
    return results, proc.stdout


@pytest.mark.parametrize("example", ["tabular-csv-dwfed", "image-cnn-idx"])
def test_the_shipped_worker_configs_read_the_generated_data(tmp_path, example):
    make_data(example, tmp_path / "data")
    config = load_config(str(worker_config(example, tmp_path, dp=True)), environ={})
    assert config.worker.dp.enabled  # as shipped: the owner's policy is DP on
    data = load_worker_data(config.worker)
    job = yaml.safe_load((EXAMPLES / example / "job.yaml").read_text())
    assert list(data.input_shape) == job["model"]["input_shape"]
    assert data.num_classes == job["model"]["layers"][-1]["out_features"]


def test_tabular_csv_with_dwfed_learns_across_three_sites(tmp_path):
    make_data("tabular-csv-dwfed", tmp_path / "data")
    config = worker_config("tabular-csv-dwfed", tmp_path, dp=False)
    results, _ = simulate(tmp_path, "tabular-csv-dwfed/job.yaml", "--worker-config", str(config),
                          "--partition", "dirichlet", "--alpha", "1.0")
    assert [r["clients"] for r in results["rounds"]] == [3] * 5
    assert results["summary"]["final_accuracy"] >= 0.85, results["rounds"]


def test_tabular_csv_with_the_owners_dp_policy_stays_within_every_budget(tmp_path):
    make_data("tabular-csv-dwfed", tmp_path / "data")
    config = worker_config("tabular-csv-dwfed", tmp_path, dp=True)
    results, stdout = simulate(tmp_path, "tabular-csv-dwfed/job.yaml", "--worker-config", str(config),
                               "--partition", "dirichlet", "--alpha", "1.0")
    assert len(results["rounds"]) == 5
    last = results["rounds"][-1]["epsilon"]
    assert sorted(last) == ["worker-0", "worker-1", "worker-2"] and all(0 < e <= 10 for e in last.values())
    assert "ε worker-0" in stdout


def test_image_cnn_on_idx_files_learns(tmp_path):
    make_data("image-cnn-idx", tmp_path / "data")
    config = worker_config("image-cnn-idx", tmp_path, dp=False)
    results, _ = simulate(tmp_path, "image-cnn-idx/job.yaml", "--worker-config", str(config),
                          "--partition", "dirichlet")
    accuracy = [r["accuracy"] for r in results["rounds"]]
    assert len(accuracy) == 4 and accuracy[-1] >= 0.85 and accuracy[-1] > accuracy[0], accuracy


@pytest.mark.parametrize("job", ["job-pfnm.yaml", "job-nafi.yaml"])
def test_one_shot_fusion_fuses_the_sites_models_in_one_round(tmp_path, job):
    results, _ = simulate(tmp_path, f"one-shot-fusion/{job}", "--dataset", "digits", "--partition", "dirichlet",
                          "--no-dp")
    (only,) = results["rounds"]
    assert only["clients"] == 3 and only["accuracy"] >= 0.75, only
