"""`jobs show` says what a layer-wise job's rounds do: the model sets their number, one per matched layer."""

from __future__ import annotations

import copy
import json

from fedbroker.app.jobs import layerwise_rounds
from fedbroker.job.submission import accept_job
from tests.integration.test_layerwise_e2e import JOB


def test_the_job_view_names_each_layerwise_round_and_its_layer() -> None:
    spec = json.loads(accept_job(copy.deepcopy(JOB)).to_json())
    assert layerwise_rounds(spec) == [("layer-wise", (
        "3 rounds set by the model, one per matched layer: round 1 matches 1; round 2 matches 3; round 3 averages 5 "
        "by class shares; each round freezes the layers matched before it"))]


def test_a_job_in_another_mode_has_no_such_line() -> None:
    job = copy.deepcopy(JOB)
    job["aggregation"] = {"alignment": "nafi"}
    assert layerwise_rounds(json.loads(accept_job(job).to_json())) == []
