"""A downloaded model's README states exactly what a raw file goes through (the job's data pipeline), and the
Python it gives, run on a raw file, prepares it exactly as the sites prepared what they trained on."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from fedbroker.app.jobs import README_FILE, write_model
from fedbroker.app.model_readme import data_section
from fedbroker.datasets.stream import FileSamples, batch_reader
from fedbroker.job.pipeline import parse_pipeline
from fedbroker.job.spec import parse_job
from fedbroker.model import build_model, initial_weights
from fedbroker.proto import fedbroker_pb2 as pb
from tests.source_roots import PYTHONPATH

DATA = {"preprocess": [{"window": {"center": 40, "width": 400}}, {"resize": [24, 24]}, {"channels": 3},
                       {"normalize": "per_image"}],
        "augment": [{"flip": {"p": 0.5}}, {"intensity": {"scale": 0.1, "p": 0.5}}]}
MODEL = {"input_shape": [3, 24, 24], "layers": [
    {"type": "Conv2d", "in_channels": 3, "out_channels": 4, "kernel_size": 3, "padding": 1}, {"type": "ReLU"},
    {"type": "AdaptiveAvgPool2d", "output_size": 1}, {"type": "Flatten"},
    {"type": "Linear", "in_features": 4, "out_features": 2}]}


def test_the_readme_says_each_step_a_raw_file_goes_through(tmp_path: Path) -> None:
    job = parse_job({"name": "ct", "category": "c", "model": MODEL, "data": DATA})
    spec = job.model
    header = pb.ModelHeader(job_id="ct-1", round=3, version=3, model_spec_json=spec.to_json())
    write_model(tmp_path, header, initial_weights(spec, seed=0), job.to_json())
    text = (tmp_path / README_FILE).read_text()
    assert "## What a raw file goes through" in text and "a raw file as the job's data pipeline prepares it" in text
    for line in parse_pipeline(DATA).describe():
        assert line in text
    assert job.data.pipeline.digest()[:16] in text
    plain = parse_job({"name": "p", "category": "c", "model": MODEL})
    assert data_section(spec.to_json(), plain.to_json(), job_file="job.json") == ""


def test_the_readmes_code_prepares_a_raw_file_as_the_sites_did(tmp_path: Path) -> None:
    job = parse_job({"name": "ct", "category": "c", "model": MODEL, "data": DATA})
    tensors = initial_weights(job.model, seed=4)
    header = pb.ModelHeader(job_id="ct-1", round=3, version=3, model_spec_json=job.model.to_json())
    write_model(tmp_path, header, tensors, job.to_json())
    raw = np.random.default_rng(5).normal(0.0, 500.0, size=(1, 37, 53)).astype(np.float32)  # a CT slice, in HU
    np.save(tmp_path / "raw.npy", raw)
    load, prepare_code = re.findall(r"```python\n(.*?)```", (tmp_path / README_FILE).read_text(), flags=re.S)
    script = load + prepare_code + "np.save('x.npy', x)\nnp.save('scores.npy', scores.numpy())\n"
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert run.returncode == 0, run.stderr
    # what a site read for training and evaluation: the same file among its files, through its batch reader
    files = FileSamples(["other.npy", "raw.npy"], lambda key: np.load(tmp_path / key, allow_pickle=False),
                        sample_shape=(1, 0, 0))
    np.save(tmp_path / "other.npy", raw[:, :20, :30] * 2)
    site = batch_reader(files, job.data.pipeline, mask=False)(np.array([1]))[0]
    documented = np.load(tmp_path / "x.npy")
    assert documented.shape == tuple(MODEL["input_shape"]) and np.array_equal(documented, site)
    model = build_model(job.model)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
    model.eval()
    with torch.no_grad():
        expected = model(torch.from_numpy(site)[None]).numpy()
    np.testing.assert_allclose(np.load(tmp_path / "scores.npy"), expected, rtol=1e-6, atol=1e-6)
    assert json.loads((tmp_path / "job.json").read_text())["data"]["preprocess"] == job.data.pipeline.to_dict()[
        "preprocess"]
