"""A model whose first layer is `standardize` (the preprocessing that travels in the spec, no weights) goes
through every aggregation path as the other parameterless layers do: the state dict and its conversion to
alignment's layers skip it, FedDNA/PFNM/NAFI realign permuted copies exactly and hand back a spec that still
carries its mean and std, a FedAvg round averages the weights and keeps the spec, and the GA's numpy probe
forward applies it as torch does."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedbroker.aggregators.alignment import ALIGNMENT, AlignInput
from fedbroker.aggregators.layer_conversion import from_layers, to_layers
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.selection import Probe
from fedbroker.job.spec import ModelSpec, parameter_shapes, parse_model
from fedbroker.job.submission import accept_job
from fedbroker.model import build_model, load_numpy_state
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec

# mean and std in values float32 holds exactly: the torch buffers and the numpy probe compute alike
MEAN = [0.5, -1.25, 3.0, 0.0, 10.0, -2.5]
STD = [0.5, 2.0, 4.0, 1.0, 0.25, 8.0]
SPEC = parse_model({"input_shape": [6], "layers": [
    {"type": "standardize", "mean": MEAN, "std": STD},
    {"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 8, "out_features": 5}, {"type": "Tanh"},
    {"type": "Linear", "in_features": 5, "out_features": 3}]})
HIDDEN = {"1": 8, "3": 5}


def network(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.normal(size=shape).astype(np.float32) for name, shape in parameter_shapes(SPEC).items()}


def permuted(state: dict[str, np.ndarray], perms: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same function with hidden layers 1 and 3 shuffled (and the next layer's inputs with them)."""
    out = dict(state)
    for layer, nxt in (("1", "3"), ("3", "5")):
        p = perms[layer]
        out[f"{layer}.weight"], out[f"{layer}.bias"] = out[f"{layer}.weight"][p], out[f"{layer}.bias"][p]
        out[f"{nxt}.weight"] = out[f"{nxt}.weight"][:, p]
    return out


def shuffles(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {layer: rng.permutation(width) for layer, width in HIDDEN.items()}


def outputs(spec: ModelSpec, state: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    model = build_model(spec).double()
    load_numpy_state(model, state)
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


def raw_inputs(n: int = 32) -> np.ndarray:
    """Inputs on the scales the standardize layer undoes: without it the function would look very different."""
    return np.random.default_rng(5).normal(size=(n, 6)) * np.array(STD) + np.array(MEAN)


def test_the_state_dict_and_the_alignment_layers_skip_it() -> None:
    assert sorted(parameter_shapes(SPEC)) == ["1.bias", "1.weight", "3.bias", "3.weight", "5.bias", "5.weight"]
    assert sorted(build_model(SPEC).state_dict()) == sorted(parameter_shapes(SPEC))
    layers = to_layers(SPEC, network(0))
    assert [layer.weight.shape for layer in layers] == [(8, 6), (5, 8), (3, 5)]
    spec, tensors = from_layers(SPEC, layers)
    assert spec == SPEC and sorted(tensors) == sorted(parameter_shapes(SPEC))


@pytest.mark.parametrize("alignment", ["feddna", "pfnm", "nafi"])
def test_permuted_copies_behind_a_standardize_layer_are_realigned_exactly(alignment: str) -> None:
    original = network(0)
    moves = [shuffles(k) if k else {layer: np.arange(w) for layer, w in HIDDEN.items()} for k in range(3)]
    clients = [to_layers(SPEC, permuted(original, m)) for m in moves]
    params = {"layers": "all"} if alignment == "feddna" else {}
    result = ALIGNMENT.create(alignment, params).align(AlignInput(clients=clients, weights=np.full(3, 1 / 3), rng=np.random.default_rng(1),
                                                       class_shares=np.full((3, 3), 1 / 3)))
    for k, move in enumerate(moves):  # client unit j is the original's unit move[j], and is put back there
        assert len(result.permutations[k]) == 2
        for got, layer in zip(result.permutations[k], ("1", "3")):
            np.testing.assert_array_equal(got, move[layer])
    spec, tensors = from_layers(SPEC, result.layers)
    assert spec.layers[0] == SPEC.layers[0]  # the preprocessing is handed on unchanged
    assert spec.layers[0].params == {"mean": tuple(MEAN), "std": tuple(STD)}
    x = raw_inputs()
    if alignment == "feddna":  # the mean of exactly realigned copies is the original network
        np.testing.assert_allclose(outputs(spec, tensors, x), outputs(SPEC, original, x), atol=1e-5)
    else:  # the Bayesian matchings shrink toward their prior but keep every neuron
        assert [t.shape for t in tensors.values()] == [original[n].shape for n in tensors]


def open_job(aggregation: dict, workers: list[str], histograms: dict | None = None) -> RoundBook:
    book = RoundBook()
    book.put_global("j", 1, SPEC.to_json(), network(99))
    book.open_round("j", 1, workers, deadline=1e12, aggregation=aggregation, seed=0, histograms=histograms)
    return book


def upload(book: RoundBook, state: dict[str, np.ndarray], worker: str, *, n: int = 10) -> None:
    header = pb.UpdateHeader(job_id="j", round=1, worker_id=worker, num_samples=n, tensors=codec.tensor_specs(state))
    book.receive_update(codec.stream_messages(pb.UpdateChunk, header, state))


def test_a_fedavg_round_averages_the_weights_and_keeps_the_preprocessing_in_the_spec() -> None:
    book = open_job({"alignment": "none"}, ["a", "b"])
    upload(book, network(1), "a", n=10)
    upload(book, network(2), "b", n=30)
    result = book.close("j", 1)
    _, spec_json, state = book.global_model("j")
    assert parse_model(json.loads(spec_json)) == SPEC == parse_model(json.loads(result.model_spec_json))
    for name in parameter_shapes(SPEC):
        np.testing.assert_allclose(state[name], 0.25 * network(1)[name] + 0.75 * network(2)[name], rtol=1e-6)


@pytest.mark.parametrize("alignment", ["feddna", "pfnm", "nafi"])
def test_an_aligned_round_in_the_service_keeps_the_standardize_layer(alignment: str) -> None:
    original = network(0)
    workers = ["a", "b", "c"]
    params = {"alignment_params": {"layers": "all"}} if alignment == "feddna" else {}
    book = open_job({"alignment": alignment, **params}, workers, histograms={w: [5, 5, 5] for w in workers})
    for k, w in enumerate(workers):
        upload(book, permuted(original, shuffles(k)), w)
    result = book.close("j", 1)
    _, spec_json, state = book.global_model("j")
    spec = parse_model(json.loads(spec_json))
    assert spec.layers[0] == SPEC.layers[0] and spec == parse_model(json.loads(result.model_spec_json))
    x = raw_inputs()
    if alignment == "feddna":
        np.testing.assert_allclose(outputs(spec, state, x), outputs(SPEC, original, x), atol=1e-5)
    else:
        assert outputs(spec, state, x).shape == (32, 3)


def test_a_job_with_a_standardize_layer_is_accepted_for_every_alignment() -> None:
    for alignment in ("none", "feddna", "pfnm", "nafi"):
        job = accept_job({"name": "j", "category": "clinic", "model": SPEC.to_dict(),
                          "aggregation": {"alignment": alignment}})
        assert job.model == SPEC


def test_the_probe_forward_standardises_as_torch_does() -> None:
    x = raw_inputs(7)
    states = [network(k) for k in range(3)]
    probe = Probe(SPEC, x, np.zeros(7, dtype=np.int64))
    stack = np.stack([np.concatenate([np.ravel(s[n]) for n in parameter_shapes(SPEC)]) for s in states])
    _, got = probe.forward(stack.astype(np.float64))
    for k, state in enumerate(states):
        np.testing.assert_allclose(got[k], outputs(SPEC, state, x), rtol=1e-10, atol=1e-12)
    one_value = parse_model({**SPEC.to_dict(), "layers": [{"type": "standardize", "mean": 2.0, "std": 0.5},
                                                          *SPEC.to_dict()["layers"][1:]]})
    _, got = Probe(one_value, x, np.zeros(7, dtype=np.int64)).forward(stack[:1])
    np.testing.assert_allclose(got[0], outputs(one_value, states[0], x), rtol=1e-10, atol=1e-12)
