"""`fedbroker submit` reads a job's pinned start file on the data scientist's machine (beside the job file),
checks it against its pin and the model, and sends its bytes; nothing is sent for a job that pins none."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedbroker.app.submit import start_file
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.spec import parse_job
from fedbroker.model import initial_weights
from fedbroker.weights.start import encode, sha256_hex

MODEL = {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 3}]}


def write_job(tmp_path, data: bytes, pin: str) -> tuple[str, object]:
    (tmp_path / "w.safetensors").write_bytes(data)
    raw = {"name": "j", "category": "c",
           "model": {**MODEL, "initial_weights": {"path": "w.safetensors", "sha256": pin}}}
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(raw))
    return str(path), parse_job(raw)


def test_the_pinned_file_beside_the_job_is_read_and_sent_as_it_is(tmp_path, monkeypatch) -> None:
    data = encode(initial_weights(parse_job({"name": "j", "category": "c", "model": MODEL}).model, seed=1))
    path, job = write_job(tmp_path, data, sha256_hex(data))
    monkeypatch.chdir("/")  # relative to the job file, not to where the command runs
    assert start_file(job, job_path=path) == data
    assert start_file(parse_job({"name": "j", "category": "c", "model": MODEL}), job_path=path) == b""


def test_a_file_off_its_pin_or_off_the_model_is_refused_before_it_travels(tmp_path) -> None:
    data = encode({"0.weight": np.zeros((3, 4), np.float32)})
    path, job = write_job(tmp_path, data, "0" * 64)
    with pytest.raises(ConfigError, match="the job pins"):
        start_file(job, job_path=path)
    path, job = write_job(tmp_path, data, sha256_hex(data))
    with pytest.raises((ConfigError, ConfigErrors), match=r"model\.initial_weights\.0\.bias: is missing"):
        start_file(job, job_path=path)
