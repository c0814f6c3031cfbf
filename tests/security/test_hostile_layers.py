"""The layer types' surfaces (deploy/SECURITY.md, "Layer types"): a site's data that is not token ids, a model sized
to exhaust a site, running statistics that would carry a site's data outside DP, and a server's weights whose
names do not fit the layer."""

from __future__ import annotations

import numpy as np
import pytest

from fedbroker.errors import ConfigError
from fedbroker.job.spec import parse_model
from fedbroker.job.submission import accept_job
from fedbroker.model import build_model, load_numpy_state, state_to_numpy
from fedbroker.worker.global_model import fit_problem
from tests.layer_examples import NEW_LAYER_EXAMPLES

TEXT = NEW_LAYER_EXAMPLES["LSTM"][0]  # Embedding(11, 8) → LSTM → Linear over 5 token ids


def _job(model: dict) -> dict:
    return {"name": "j", "category": "digits", "model": model,
            "aggregation": {"alignment": "none", "weighting": "fedavg", "selection": "all"}}


@pytest.mark.parametrize("bad", [11.0, -1.0, 2.5, np.nan])
def test_a_sites_data_that_is_not_token_ids_is_refused_before_training_without_echoing_it(bad: float) -> None:
    x = np.zeros((4, 5), dtype=np.float32)
    assert fit_problem(parse_model(TEXT), x, 3, holder="this worker's data") == ""
    x[2, 3] = bad
    problem = fit_problem(parse_model(TEXT), x, 3, holder="this worker's data")
    assert problem == ("model.layers[0] is an Embedding that reads the input as token ids, but this worker's data "
                       "holds features that are not whole numbers in [0, 11) (num_embeddings)")
    assert str(bad) not in problem and "sample" not in problem


def test_a_huge_vocabulary_is_refused_at_submission_naming_the_field() -> None:
    model = {"input_shape": [4], "layers": [{"type": "Embedding", "num_embeddings": 10 ** 9, "embedding_dim": 8},
                                            {"type": "Flatten"}, {"type": "Linear", "in_features": 32,
                                                                  "out_features": 2}]}
    with pytest.raises(ConfigError, match=r"model\.layers\[0\]\.num_embeddings: must be an integer in \[1, "):
        accept_job(_job(model))
    model["layers"][0]["num_embeddings"] = 1 << 20  # within the bound, but 2^20 × 256 floats: the parameter bound
    model["layers"][0]["embedding_dim"] = 256
    model["layers"][2]["in_features"] = 1024
    with pytest.raises(ConfigError, match=r"model\.layers\[0\]: Embedding brings the model to 268435456 parameters"):
        accept_job(_job(model))


def test_an_rnn_with_an_absurd_hidden_size_is_refused_at_submission_naming_the_layer() -> None:
    model = {"input_shape": [5, 4], "layers": [
        {"type": "LSTM", "input_size": 4, "hidden_size": 65536, "num_layers": 8, "output": "last"},
        {"type": "Linear", "in_features": 65536, "out_features": 2}]}
    with pytest.raises(ConfigError) as info:
        accept_job(_job(model))
    assert "model.layers[0]: LSTM brings the model to" in str(info.value) and "more than 200000000" in str(info.value)
    model["layers"][0]["num_layers"] = 1000
    with pytest.raises(ConfigError, match=r"model\.layers\[0\]\.num_layers: must be an integer in \[1, 8\]"):
        accept_job(_job(model))


def test_batchnorm_carries_no_running_statistics_of_a_sites_data() -> None:
    """BatchNorm's running mean and variance would be a site's feature statistics released outside DP; spelt
    BatchNorm, the layer trains as GroupNorm, whose only weights are its DP-trained scale and shift."""
    for kind in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d"):
        for raw in NEW_LAYER_EXAMPLES[kind]:
            names = set(build_model(parse_model(raw), seed=0).state_dict())
            assert not any("running" in n or "num_batches" in n for n in names), names


def test_weights_under_another_layers_names_are_refused_by_name() -> None:
    """A server sending an RNN's cells under Opacus's inner names (or torch's packed attention) is refused, not
    loaded half-way: the names on the wire are exactly the table's."""
    spec = parse_model(TEXT)
    state = state_to_numpy(build_model(spec, seed=0))
    cells = {k.replace("weight_ih_l0", "l0.ih.weight"): v for k, v in state.items()}
    with pytest.raises(ValueError, match=r"missing \['1\.weight_ih_l0'\], unexpected \['1\.l0\.ih\.weight'\]"):
        load_numpy_state(build_model(spec), cells)
