"""A hostile job data section (a dishonest data scientist, or a server that forges a job's settings): refused at
submission, and again by the site from the settings it receives, before it reads a file or spends ε. A site runs
only the closed list of transforms; no code travels with a job (deploy/SECURITY.md, "A job's data pipeline")."""

from __future__ import annotations

import pytest

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.settings import settings_digest, settings_message
from fedbroker.job.spec import parse_job
from fedbroker.job.submission import accept_job_text
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker.job_settings import JobSettingsCache

JOB = """
name: ct
category: c
model:
  input_shape: [1, 32, 32]
  layers:
    - {type: Conv2d, in_channels: 1, out_channels: 2, kernel_size: 3, padding: 1}
    - {type: AdaptiveAvgPool2d, output_size: 1}
    - {type: Flatten}
    - {type: Linear, in_features: 2, out_features: 2}
data:
"""
ROWS = {  # row of the table: (the job's data section as YAML, its JSON as a forged settings message carries it)
    "huge resize": ("  preprocess: [{resize: [65536, 65536]}]", '{"preprocess":[{"resize":[65536,65536]}]}',
                    "data.preprocess[0].resize"),
    "many channels": ("  preprocess: [{channels: 100000}]", '{"preprocess":[{"channels":100000}]}',
                      "data.preprocess[0].channels"),
    "unknown transform": ("  preprocess: [{python: 'import os; os.remove(\"/\")'}]",
                          '{"preprocess":[{"python":"import os"}]}', "data.preprocess[0].python"),
    "steps beyond the limit": ("  augment: [" + ", ".join(["{flip: {}}"] * 1000) + "]",
                               '{"augment":[' + ",".join(['{"flip":{}}'] * 1000) + "]}", "data.augment"),
    "NaN parameter": ("  preprocess: [{window: {center: .nan, width: 400}}]",
                      '{"preprocess":[{"window":{"center":NaN,"width":400}}]}', "data.preprocess[0].window.center"),
    "infinite probability": ("  augment: [{flip: {p: .inf}}]", '{"augment":[{"flip":{"p":Infinity}}]}',
                             "data.augment[0].flip.p"),
}


def _fields(exc: ConfigError) -> list[str]:
    return [e.field for e in exc.errors] if isinstance(exc, ConfigErrors) else [exc.field]


@pytest.mark.parametrize("row", sorted(ROWS))
def test_a_hostile_data_section_is_refused_at_submission(row: str) -> None:
    yaml_text, _, field = ROWS[row]
    with pytest.raises(ConfigError) as caught:
        accept_job_text(JOB + yaml_text + "\n")
    assert field in _fields(caught.value)


@pytest.mark.parametrize("row", sorted(ROWS))
def test_a_site_refuses_a_hostile_pipeline_the_server_sends(row: str) -> None:
    """The server forged the settings after submission (a consistent digest included): the site parses them
    itself, so the task is refused before any training, budget or ε (the agent turns this into a poison task)."""
    _, pipeline_json, field = ROWS[row]
    message = settings_message("ct-1", parse_job({"name": "ct", "category": "c", "model": {
        "input_shape": [1, 32, 32], "layers": [{"type": "Flatten"},
                                               {"type": "Linear", "in_features": 1024, "out_features": 2}]}}))
    message.data.pipeline_json = pipeline_json
    task = pb.RoundTask(job_id="ct-1", round=1, settings=message, settings_digest=settings_digest(message))
    cache = JobSettingsCache(kept=4)
    with pytest.raises(ConfigError) as caught:
        cache.for_task(task, fetch=lambda digest: message)
    assert field in _fields(caught.value) and cache.get("ct-1") is None
