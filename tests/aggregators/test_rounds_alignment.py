"""Alignment, weighting and selection run inside the aggregation service exactly as jobs name them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.errors import ConfigError
from fedbroker.job.spec import parse_model
from fedbroker.job.submission import accept_job
from fedbroker.model import build_model, load_numpy_state
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec

SPEC = parse_model({"input_shape": [6], "layers": [
    {"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 8, "out_features": 3}]})


def network(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"0.weight": rng.normal(size=(8, 6)).astype(np.float32), "0.bias": rng.normal(size=8).astype(np.float32),
            "2.weight": rng.normal(size=(3, 8)).astype(np.float32), "2.bias": rng.normal(size=3).astype(np.float32)}


def permuted(state: dict[str, np.ndarray], perm: np.ndarray) -> dict[str, np.ndarray]:
    return {"0.weight": state["0.weight"][perm], "0.bias": state["0.bias"][perm],
            "2.weight": state["2.weight"][:, perm], "2.bias": state["2.bias"]}


def upload(book, state, worker, *, rnd=1, n=10, ish=None):
    header = pb.UpdateHeader(job_id="j", round=rnd, worker_id=worker, num_samples=n,
                             tensors=codec.tensor_specs(state), ish=ish or 0.0, has_ish=ish is not None)
    return book.receive_update(codec.stream_messages(pb.UpdateChunk, header, state))


def outputs(spec_json: str, state: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    model = build_model(parse_model(json.loads(spec_json))).double()
    load_numpy_state(model, state)
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def open_job(aggregation, workers, histograms=None):
    book = RoundBook()
    book.put_global("j", 1, SPEC.to_json(), network(99))
    book.open_round("j", 1, workers, deadline=1e12, aggregation=aggregation, seed=0, histograms=histograms)
    return book


def test_feddna_in_the_service_realigns_permuted_copies_into_the_same_function():
    original = network(0)
    workers = ["a", "b", "c"]
    book = open_job({"alignment": "feddna"}, workers)
    for k, w in enumerate(workers):
        upload(book, permuted(original, np.random.default_rng(k).permutation(8)), w)
    result = book.close("j", 1)
    x = np.random.default_rng(5).normal(size=(16, 6))
    _, spec_json, state = book.global_model("j")
    np.testing.assert_allclose(outputs(spec_json, state, x), outputs(SPEC.to_json(), original, x), atol=1e-5)
    assert result.stats["alignment_total_matched_distance"] == pytest.approx(0.0, abs=1e-4)


def test_plain_fedavg_of_the_same_permuted_copies_does_not_keep_the_function():
    original = network(0)
    book = open_job({"alignment": "none", "selection": "random", "selection_params": {"m": 3}}, ["a", "b", "c"])
    for k, w in enumerate(["a", "b", "c"]):
        upload(book, permuted(original, np.random.default_rng(k).permutation(8)), w)
    book.close("j", 1)
    x = np.random.default_rng(5).normal(size=(16, 6))
    _, spec_json, state = book.global_model("j")
    assert np.abs(outputs(spec_json, state, x) - outputs(SPEC.to_json(), original, x)).max() > 0.1


@pytest.mark.parametrize("alignment", ["pfnm", "nafi"])
def test_bayesian_matching_returns_a_spec_that_fits_its_tensors_and_the_next_round(alignment):
    workers = ["a", "b", "c"]
    book = open_job({"alignment": alignment}, workers, histograms={w: [5, 5, 5] for w in workers})
    for k, w in enumerate(workers):
        upload(book, network(k), w)
    result = book.close("j", 1)
    spec = parse_model(json.loads(result.model_spec_json))
    _, _, state = book.global_model("j")
    width = spec.layers[0].params["out_features"]
    assert width >= 8 and result.stats["alignment_global_neurons_layer_0"] == width
    assert state["0.weight"].shape == (width, 6) and state["2.weight"].shape == (3, width)
    # the next round's uploads are checked against the grown model
    book.open_round("j", 2, workers, deadline=1e12, aggregation={"alignment": alignment}, seed=0)
    grown = {k: np.zeros_like(v) for k, v in state.items()}
    assert not upload(book, grown, "a", rnd=2).duplicate


def test_dwfed_with_every_weight_zero_falls_back_to_the_plain_mean():
    book = open_job({"weighting": "dwfed"}, ["a", "b"])
    upload(book, {k: np.full_like(v, 1.0) for k, v in network(0).items()}, "a", ish=0.0)
    upload(book, {k: np.full_like(v, 3.0) for k, v in network(0).items()}, "b", ish=0.0)
    result = book.close("j", 1)
    assert result.stats["weighting_fallback"] == 1.0
    np.testing.assert_allclose(book.global_model("j")[2]["0.bias"], 2.0)


def test_dwfed_weights_updates_by_reported_ish():
    book = open_job({"weighting": "dwfed"}, ["a", "b"])
    upload(book, {k: np.full_like(v, 1.0) for k, v in network(0).items()}, "a", ish=0.2)
    upload(book, {k: np.full_like(v, 3.0) for k, v in network(0).items()}, "b", ish=0.8)
    book.close("j", 1)
    np.testing.assert_allclose(book.global_model("j")[2]["0.bias"], 0.2 * 1 + 0.8 * 3, rtol=1e-6)


def test_alignment_of_a_group_norm_model_is_refused_at_submission():
    job = {"name": "j", "category": "digits", "aggregation": {"alignment": "feddna"}, "model": {
        "input_shape": [1, 8, 8], "layers": [
            {"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": 3},
            {"type": "GroupNorm", "num_groups": 2, "num_channels": 4}, {"type": "Flatten"},
            {"type": "Linear", "in_features": 144, "out_features": 10}]}}
    with pytest.raises(ConfigError, match=r"model.layers\[1\]: alignment 'feddna' cannot align this model: GroupNorm: its 2 groups"):
        accept_job(job)
