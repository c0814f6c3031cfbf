"""`jobs download` of a job with LoRA adapters: the folder holds the plain model the adapted one computes, and
the README's snippet, run as written in a fresh interpreter, gives the served model's outputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import torch
from safetensors.numpy import load_file

from fedbroker.app.jobs import MODEL_FILE, README_FILE, write_model
from fedbroker.job.spec import parse_job
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.weights.adapters import planned_model, start_state
from tests.source_roots import PYTHONPATH

JOB = {"name": "ft", "category": "c", "model": {
    "input_shape": [6], "layers": [{"type": "Linear", "in_features": 6, "out_features": 16}, {"type": "ReLU"},
                                   {"type": "Linear", "in_features": 16, "out_features": 4}],
    "adapters": {"rank": 2, "alpha": 6, "targets": ["0"], "train": ["2"]}}}


def test_the_download_merges_adapters_and_its_snippet_gives_the_served_outputs(tmp_path) -> None:
    job = parse_job(JOB)
    state = start_state(job.model, job.plan, seed=0)
    rng = np.random.default_rng(1)
    state = {k: (v + rng.normal(size=v.shape)).astype(np.float32) for k, v in state.items()}  # B trained away from 0
    served = planned_model(job.model, job.plan)
    served.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
    header = pb.ModelHeader(job_id="ft-1", round=3, version=4, model_spec_json=job.model.to_json())
    write_model(tmp_path, header, state, job.to_json())
    written = load_file(str(tmp_path / MODEL_FILE))
    assert set(written) == {"0.weight", "0.bias", "2.weight", "2.bias"}   # a plain model: no adapter tensors
    readme = (tmp_path / README_FILE).read_text()
    assert "adapters merged" in readme and "4 class scores (logits)" in readme and "argmax" in readme
    x = rng.normal(size=(10, 6)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    (snippet,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    script = snippet + ("import numpy as np, torch\n"
                        "np.save('out.npy', model(torch.from_numpy(np.load('x.npy'))).detach().numpy())\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert run.returncode == 0, run.stderr
    expected = served(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_path / "job.json").read_text())["model"]["adapters"]["rank"] == 2
