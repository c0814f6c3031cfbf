"""The job's view names what trains differently from what the job wrote (BatchNorm as GroupNorm under DP)."""

from __future__ import annotations

from fedbroker.app.jobs import settings
from tests.layer_examples import NEW_LAYER_EXAMPLES


def test_a_job_view_names_the_batchnorm_substitution() -> None:
    model = NEW_LAYER_EXAMPLES["BatchNorm2d"][0]
    lines = dict(settings({"model": model}))
    assert lines["trains as"] == "layers[1] BatchNorm2d(6) trains as GroupNorm(6, 6)"
    graph = {"input_shape": [3, 8, 8], "nodes": {"norm": {"type": "BatchNorm1d", "num_features": 3},
                                                  "odd": {"type": "BatchNorm2d", "num_features": "x"}}}
    assert dict(settings({"model": graph}))["trains as"] == "nodes.norm BatchNorm1d(3) trains as GroupNorm(1, 3)"
    assert "trains as" not in dict(settings({"model": NEW_LAYER_EXAMPLES["Conv1d"][0]}))
