"""A per-channel norm after a conv (a BatchNorm as DP trains it: GroupNorm with one channel per group) travels
with the conv's output channels: its scale and shift are permuted with the channels they belong to and averaged
with them. The defining property: permuted copies of one network with such norms are realigned exactly, and the
aggregate computes the same function as the original."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedbroker.aggregators.alignment import ALIGNMENT, AlignInput, Layer, permute_units
from fedbroker.aggregators.alignment.base import weighted_mean_layers
from fedbroker.aggregators.layer_conversion import from_layers, to_layers
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.job.alignment_plan import alignment_plan
from fedbroker.job.spec import ModelSpec, parameter_shapes, parse_model
from fedbroker.model import build_model, load_numpy_state
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec

SPEC = parse_model({"input_shape": [2, 6, 6], "layers": [
    {"type": "Conv2d", "in_channels": 2, "out_channels": 5, "kernel_size": 3},
    {"type": "GroupNorm", "num_groups": 5, "num_channels": 5}, {"type": "ReLU"},
    {"type": "Conv2d", "in_channels": 5, "out_channels": 4, "kernel_size": 3, "padding": 1},
    {"type": "GroupNorm", "num_groups": 4, "num_channels": 4}, {"type": "Tanh"},
    {"type": "Flatten"},
    {"type": "Linear", "in_features": 64, "out_features": 3}]})
HIDDEN = {"0": ("1", "3", 5), "3": ("4", "7", 4)}  # conv → (its norm, the next matched layer, width)


def network(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state = {name: rng.normal(size=shape).astype(np.float32) for name, shape in parameter_shapes(SPEC).items()}
    for norm in ("1", "4"):  # scales away from 1 and shifts away from 0, so a misplaced one shows
        state[f"{norm}.weight"] = (1.0 + rng.uniform(0.2, 1.5, size=state[f"{norm}.weight"].shape)).astype(np.float32)
    return state


def permuted(state: dict[str, np.ndarray], perms: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The same function with each conv's channels shuffled, its norm's tensors and the next layer's inputs too."""
    out = dict(state)
    for conv, (norm, nxt, width) in HIDDEN.items():
        p = perms[conv]
        for name in (f"{conv}.weight", f"{conv}.bias", f"{norm}.weight", f"{norm}.bias"):
            out[name] = out[name][p]
        w = out[f"{nxt}.weight"]
        out[f"{nxt}.weight"] = (w[:, p] if w.ndim == 4 else
                                w.reshape(w.shape[0], width, -1)[:, p].reshape(w.shape))
    return out


def shuffles(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {conv: rng.permutation(width) for conv, (_, _, width) in HIDDEN.items()}


def outputs(spec: ModelSpec, state: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    model = build_model(spec).double()
    load_numpy_state(model, state)
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


X = np.random.default_rng(7).normal(size=(16, 2, 6, 6))


def test_the_norms_are_attached_to_the_conv_before_them() -> None:
    plan = alignment_plan(SPEC)
    assert [(m.node, [n.node for n in m.norms]) for m in plan.layers] == [("0", ["1"]), ("3", ["4"]), ("7", [])]
    layers = to_layers(SPEC, network(0))
    assert sorted(layers[0].channels) == ["1.bias", "1.weight"] and sorted(layers[1].channels) == ["4.bias", "4.weight"]
    spec, tensors = from_layers(SPEC, layers)
    assert spec == SPEC and sorted(tensors) == sorted(parameter_shapes(SPEC))


def test_permuting_a_layer_moves_its_norm_with_it_and_keeps_the_function() -> None:
    original = network(0)
    layers = to_layers(SPEC, original)
    p = np.random.default_rng(3).permutation(5)
    moved = permute_units(layers, 0, p)
    _, tensors = from_layers(SPEC, moved)
    np.testing.assert_array_equal(tensors["1.weight"][p], original["1.weight"])
    np.testing.assert_allclose(outputs(SPEC, tensors, X), outputs(SPEC, original, X), atol=1e-5)


def test_the_mean_averages_the_norms_with_their_layer() -> None:
    a = Layer(np.ones((2, 3)), np.zeros(2), {"n.weight": np.array([1.0, 2.0])})
    b = Layer(np.ones((2, 3)), np.zeros(2), {"n.weight": np.array([3.0, 6.0])})
    mean = weighted_mean_layers([[a], [b]], np.array([0.25, 0.75]))
    np.testing.assert_allclose(mean[0].channels["n.weight"], [2.5, 5.0])


@pytest.mark.parametrize("alignment", ["feddna", "pfnm", "nafi"])
def test_permuted_copies_with_per_channel_norms_are_realigned_exactly(alignment: str) -> None:
    original = network(0)
    moves = [shuffles(k) if k else {conv: np.arange(w) for conv, (_, _, w) in HIDDEN.items()} for k in range(3)]
    clients = [to_layers(SPEC, permuted(original, m)) for m in moves]
    # a prior this weak leaves the Bayesian global neurons at the clients' common value (G/S → mean)
    params = {"layers": "all"} if alignment == "feddna" else {"sigma0_2": 1e6}
    result = ALIGNMENT.create(alignment, params).align(AlignInput(
        clients=clients, weights=np.full(3, 1 / 3), rng=np.random.default_rng(1), class_shares=np.full((3, 3), 1.0)))
    for k, move in enumerate(moves):  # client unit j is the original's unit move[j], and is put back there
        for got, conv in zip(result.permutations[k], HIDDEN):
            np.testing.assert_array_equal(got, move[conv])
    spec, tensors = from_layers(SPEC, result.layers)
    assert spec == SPEC
    np.testing.assert_allclose(tensors["1.weight"], original["1.weight"], rtol=1e-4)
    np.testing.assert_allclose(outputs(spec, tensors, X), outputs(SPEC, original, X), atol=1e-3)


def test_an_aligned_round_in_the_service_computes_the_original_function() -> None:
    original = network(0)
    book = RoundBook()
    book.put_global("j", 1, SPEC.to_json(), network(99))
    workers = ["a", "b", "c"]
    book.open_round("j", 1, workers, deadline=1e12, aggregation={"alignment": "feddna",
                                                                 "alignment_params": {"layers": "all"}}, seed=0)
    for k, w in enumerate(workers):
        state = permuted(original, shuffles(k + 1))
        header = pb.UpdateHeader(job_id="j", round=1, worker_id=w, num_samples=10, tensors=codec.tensor_specs(state))
        book.receive_update(codec.stream_messages(pb.UpdateChunk, header, state))
    book.close("j", 1)
    _, spec_json, state = book.global_model("j")
    spec = parse_model(json.loads(spec_json))
    np.testing.assert_allclose(outputs(spec, state, X), outputs(SPEC, original, X), atol=1e-5)


GRAPH = parse_model({"input_shape": [2, 6, 6], "nodes": {
    "stem": {"type": "Conv2d", "in_channels": 2, "out_channels": 5, "kernel_size": 3, "padding": 1},
    "norm": {"type": "BatchNorm2d", "num_features": 5},  # trains as GroupNorm(5, 5): per channel
    "act": {"type": "ReLU"}, "flat": {"type": "Flatten"},
    "head": {"type": "Linear", "in_features": 180, "out_features": 3}}})


def test_a_chain_written_as_a_graph_is_realigned_by_node_name_in_the_service() -> None:
    rng = np.random.default_rng(0)
    original = {name: rng.normal(size=shape).astype(np.float32) for name, shape in parameter_shapes(GRAPH).items()}
    book = RoundBook()
    book.put_global("j", 1, GRAPH.to_json(), original)
    workers = ["a", "b", "c"]
    book.open_round("j", 1, workers, deadline=1e12, aggregation={"alignment": "feddna"}, seed=0)
    for k, w in enumerate(workers):
        p = np.random.default_rng(k + 1).permutation(5)
        state = dict(original)
        for name in ("stem.weight", "stem.bias", "norm.weight", "norm.bias"):
            state[name] = original[name][p]
        state["head.weight"] = original["head.weight"].reshape(3, 5, 36)[:, p].reshape(3, 180)
        header = pb.UpdateHeader(job_id="j", round=1, worker_id=w, num_samples=10, tensors=codec.tensor_specs(state))
        book.receive_update(codec.stream_messages(pb.UpdateChunk, header, state))
    book.close("j", 1)
    _, spec_json, state = book.global_model("j")
    spec = parse_model(json.loads(spec_json))
    assert spec.is_graph
    np.testing.assert_allclose(outputs(spec, state, X), outputs(GRAPH, original, X), atol=1e-5)
