"""The table's `probe_forward` trait says which layer types the aggregation side's numpy forward pass computes: a
job whose probe set meets another type is refused at submission, naming the layers, never failing in a round."""

from __future__ import annotations

import numpy as np
import pytest

from fedbroker.aggregators.selection import probe
from fedbroker.errors import ConfigError
from fedbroker.job.spec import LayerSpec
from fedbroker.job.submission import accept_job
from fedbroker.layers import LAYERS
from tests.layer_examples import NEW_LAYER_EXAMPLES


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_the_probe_trait_is_what_the_probe_forward_pass_computes(kind: str) -> None:
    try:
        probe._layer(LayerSpec(kind, {}), np.zeros((1, 1, 2)), {})
    except ValueError as exc:
        computes = "does not know layer type" not in str(exc)
    except (KeyError, AssertionError, TypeError, IndexError, np.exceptions.AxisError):
        computes = True  # it went past the type's dispatch (the empty parameters stop it later)
    else:
        computes = True
    assert LAYERS[kind].probe_forward == computes


def test_a_probe_set_job_on_a_model_the_probe_cannot_run_is_refused_naming_the_layers() -> None:
    job = {"name": "g", "category": "digits", "model": NEW_LAYER_EXAMPLES["LSTM"][1], "training": {"rounds": 1},
           "aggregation": {"selection": "ga", "selection_params": {"m": 2, "probe_dataset": "digits"}}}
    with pytest.raises(ConfigError, match=r"aggregation\.selection_params\.probe_dataset: the probe set's forward "
                                          r"pass \(numpy, on the aggregation side\) does not compute layers\[0\] "
                                          r"\(LSTM\); it computes Linear, Flatten"):
        accept_job(job)
