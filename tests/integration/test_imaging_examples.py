"""The two imaging examples run as their READMEs say, through real processes: the example's folder is copied into a
temporary folder (so its worker configs find their data where the README's steps write it), `make_data.py` (and
for the X-rays `pretrain.py`) run at a tiny size, then the aggregation service, the coordinator and the three
sites' workers (`fedbroker worker --config worker-site-<x>.yaml`) start as their own processes over a private
RabbitMQ, each on a broker user of its own, DP on as the shipped configs have it. The job is submitted, followed to
its end and downloaded as the README says; the download's README must state the job's data section, and the
README's Python snippet, run as written in a fresh interpreter, must give the served model's outputs on a raw file.

Sizes: 40 images per site and 64 pretext images (X-rays); 3 volumes of ~8 axial slices per site (CT). What is
asserted is what DP leaves certain (the job completes, every site is charged ε, the scores are there and in range),
never a score floor."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from experiments.catalogue_e2e import served_outputs
from fedbroker.job.pipeline import parse_pipeline
from tests.integration.processes import Deployment, _clean_env
from tests.integration.test_consortium_study import wait_for
from tests.rabbitmq_node import PrivateRabbitMQ

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SITES = ("site-a", "site-b", "site-c")


def copy_example(name: str, tmp: Path) -> Path:
    """The example's shipped files (never a `data/` folder a developer generated) under tmp/examples/<name>."""
    folder = tmp / "examples" / name
    shutil.copytree(ROOT / "examples" / name, folder, ignore=shutil.ignore_patterns("data", "__pycache__"))
    return folder


def run_script(tmp: Path, script: str, *args: str) -> str:
    """`python examples/<script> ARGS` from tmp, as the README runs it from the repository root."""
    done = subprocess.run([sys.executable, script, *args], cwd=tmp, env=_clean_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"{script}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def readme_snippet(folder: Path) -> str:
    """The README's Python block (the download applied to a raw file), exactly as written."""
    (snippet,) = re.findall(r"```python\n(.*?)```", (folder / "README.md").read_text(), flags=re.S)
    return snippet


def federation(d: Deployment, folder: Path) -> None:
    """README step 3: the aggregation service, the coordinator, and one worker per site with its shipped config."""
    d.spawn("aggregator", "aggregator", {"aggregator.listen": d.aggregator, "aggregator.spool_dir": d.tmp / "spool"})
    d.spawn("coordinator", "coordinator", {"coordinator.listen": d.coordinator,
                                           "coordinator.state_dir": folder / "data" / "state"})
    for site in SITES:
        d.spawn(site, "worker", {"worker.heartbeat_s": 1.0}, cwd=d.tmp,
                args=("--config", str(folder.relative_to(d.tmp) / f"worker-{site}.yaml")))

    wait_for(lambda: d.listed(len(SITES)), 240, "the three sites to register", d)


def submit_and_follow(d: Deployment, job_file: Path) -> tuple[str, dict[str, Any]]:
    """README step 4: submit, follow the events to the end, then the job as `jobs show` gives it."""
    job_id = json.loads(d.cli("submit", str(job_file.relative_to(d.tmp)), "--json", cwd=d.tmp))["job_id"]

    doc = wait_for(lambda: d.ended_job(job_id), 480, "the job to end", d)
    assert doc["status"] == "completed", f"{doc.get('error')}\n{d.logs()}"
    charged = {p["worker_id"]: p["epsilon"] for p in doc["participants"] if p["status"] == "aggregated"}
    assert sorted(charged) == list(SITES) and all(0 < e <= 10 for e in charged.values()), doc["participants"]
    return job_id, doc


def download(d: Deployment, job_id: str, folder: Path, job: dict[str, Any]) -> Path:
    """README step 5: the download, whose README states what a raw file goes through."""
    out = folder / "data" / "model"
    d.cli("jobs", "download", job_id, "--out", str(out.relative_to(d.tmp)), cwd=d.tmp)
    text = (out / "README.md").read_text()
    for line in parse_pipeline(job["data"]).describe():
        assert line.split(":")[0].strip("- ") in text, f"the download's README lacks {line!r}:\n{text}"
    return out


def run_snippet(d: Deployment, folder: Path) -> Any:
    """The README's snippet in a fresh interpreter, from the repository root's place (tmp): its printed JSON."""
    done = subprocess.run([sys.executable, "-c", readme_snippet(folder)], cwd=d.tmp, env=_clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("example, args", [("xray-folders", ("--per-site", "12", "--pretext", "8")),
                                           ("segmentation-nifti", ("--per-site", "2", "--depth", "6"))])
def test_each_sites_shipped_worker_config_reads_its_generated_data_and_the_job_fits_it(
        tmp_path: Path, example: str, args: tuple[str, ...]) -> None:
    """Without a broker: every site's worker.yaml, as shipped (DP on), reads what make_data.py wrote where the
    README's step writes it, and the job's data section turns each site's samples into the model's input."""
    from fedbroker.config import load_config
    from fedbroker.datasets import load_worker_data
    from fedbroker.job.model_spec import parse_model

    folder = copy_example(example, tmp_path)
    run_script(tmp_path, f"examples/{example}/make_data.py", *args)
    job = yaml.safe_load((folder / "job.yaml").read_text())
    model = dict(job["model"])
    model.pop("initial_weights", None)
    spec = parse_model(model)
    pipeline = parse_pipeline(job["data"])
    for site in SITES:
        worker = load_config(str(folder / f"worker-{site}.yaml"), environ={}).worker
        assert worker.id == site and worker.dp.enabled and worker.ledger_path.startswith(str(folder / "data"))
        data = load_worker_data(worker)
        assert data.input_shape == (1, 0, 0)  # one grey channel; the files' sizes differ
        assert pipeline.output_shape(data.input_shape) == spec.input_shape
        if example == "xray-folders":
            assert np.asarray(data.y).shape[1] == job["task"]["labels"] == 3
        else:
            assert data.num_classes == job["task"]["classes"] == 2


@pytest.fixture
def deployment(private_rabbitmq: PrivateRabbitMQ, tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(private_rabbitmq.url, tmp_path, name="imaging", worker_ids=list(SITES), users=private_rabbitmq)
    try:
        yield d
    finally:
        d.close()


def test_the_xray_folders_example_runs_from_its_readme(deployment: Deployment) -> None:
    d = deployment
    folder = copy_example("xray-folders", d.tmp)
    run_script(d.tmp, "examples/xray-folders/make_data.py", "--per-site", "40", "--pretext", "64")
    printed = run_script(d.tmp, "examples/xray-folders/pretrain.py", "--epochs", "1")
    assert "held-out accuracy" in printed
    job_file = folder / "data" / "job.yaml"
    job = yaml.safe_load(job_file.read_text())
    pin = job["model"]["initial_weights"]["sha256"]
    assert re.fullmatch(r"[0-9a-f]{64}", pin), pin  # pretrain.py pinned the file it wrote
    federation(d, folder)
    job_id, doc = submit_and_follow(d, job_file)
    assert [r["federated_metric"] for r in doc["rounds"]] == ["macro_f1"] * 3
    scores = doc["rounds"][-1]["federated_scores"]  # per finding: the latest scored round's (jobs show)
    for finding in range(3):  # effusion, nodule, cardiomegaly
        assert 0.0 <= scores[f"auroc/{finding}"] <= 1.0 and 0.0 <= scores[f"auroc_bound/{finding}"] <= 0.5
    out = download(d, job_id, folder, job)
    assert "sigmoid" in (out / "README.md").read_text()

    got = run_snippet(d, folder)
    assert list(got) == ["effusion", "nodule", "cardiomegaly"]
    from fedbroker.datasets.image_files import decode
    from fedbroker.datasets.transforms import prepare

    x = prepare(parse_pipeline(job["data"]), decode(str(folder / "data/site-a/images/site-a-00000.png")))
    served = 1 / (1 + np.exp(-served_outputs(folder / "data" / "state", job_id, x[None].astype(np.float32))[0]))
    np.testing.assert_allclose(list(got.values()), served, rtol=1e-5, atol=1e-5)


def test_the_segmentation_nifti_example_runs_from_its_readme(deployment: Deployment) -> None:
    d = deployment
    folder = copy_example("segmentation-nifti", d.tmp)
    run_script(d.tmp, "examples/segmentation-nifti/make_data.py", "--per-site", "3", "--depth", "8")
    job_file = folder / "job.yaml"
    job = yaml.safe_load(job_file.read_text())
    federation(d, folder)
    job_id, doc = submit_and_follow(d, job_file)
    assert [r["federated_metric"] for r in doc["rounds"]] == ["dice"] * 3
    assert all(0.0 <= r["federated_scores"]["dice"] <= 1.0 for r in doc["rounds"])
    scores = doc["rounds"][-1]["federated_scores"]  # per class: the latest scored round's (jobs show)
    assert 0.0 <= scores["dice/1"] <= 1.0 and scores["dice"] == pytest.approx(scores["dice/1"])
    assert 0.0 <= scores["iou/1"] <= scores["dice/1"]
    out = download(d, job_id, folder, job)
    assert "argmax" in (out / "README.md").read_text()

    got = run_snippet(d, folder)
    assert 0.0 <= got["dice"] <= 1.0
    import nibabel as nib
    import torch

    from fedbroker.datasets.transforms import prepare

    scan = nib.load(folder / "data/site-a/volumes/case-000.nii.gz")
    written = nib.load(folder / "data/case-000-predicted.nii.gz")
    assert written.shape == scan.shape and np.allclose(written.affine, scan.affine)
    volume, predicted = scan.get_fdata(dtype=np.float32), np.asarray(written.dataobj)
    pipeline = parse_pipeline(job["data"])
    x = np.stack([prepare(pipeline, volume[None, :, :, z]) for z in range(volume.shape[2])]).astype(np.float32)
    served = served_outputs(folder / "data" / "state", job_id, x).argmax(1)[:, None].astype(np.float32)
    back = torch.nn.functional.interpolate(torch.from_numpy(served), size=volume.shape[:2], mode="nearest")
    assert np.array_equal(predicted, back[:, 0].numpy().transpose(1, 2, 0).astype(np.uint8))
    assert got["lesion_voxels"] == int(predicted.sum())
