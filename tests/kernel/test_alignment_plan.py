"""Which models FedDNA, PFNM and NAFI can align is read off the layer table's alignment traits and a walk over
the model's nodes: chains of Linear/Conv with elementwise layers and per-channel norms attached to the layer
before them are taken; everything else is refused at submission, naming the node and why. The layer-wise mode
takes exactly one round per matched layer, and freezes the layers matched before each round."""

from __future__ import annotations

from typing import Any

import pytest

from fedbroker.errors import ConfigError
from fedbroker.job.alignment_plan import alignment_plan, plan_alignment
from fedbroker.job.spec import ModelSpec, parse_model
from fedbroker.job.submission import accept_job
from fedbroker.layers import LAYERS
from fedbroker.layers.base import AlignTrait, LayerType

CONV_CHAIN = {"input_shape": [2, 8, 8], "layers": [
    {"type": "Conv2d", "in_channels": 2, "out_channels": 4, "kernel_size": 3, "padding": 1},
    {"type": "GroupNorm", "num_groups": 4, "num_channels": 4}, {"type": "ReLU"},
    {"type": "MaxPool2d", "kernel_size": 2},
    {"type": "Conv2d", "in_channels": 4, "out_channels": 6, "kernel_size": 3, "bias": False},
    {"type": "BatchNorm2d", "num_features": 6}, {"type": "GELU"}, {"type": "Dropout", "p": 0.1},
    {"type": "Flatten"},
    {"type": "Linear", "in_features": 24, "out_features": 5}, {"type": "Tanh"},
    {"type": "Linear", "in_features": 5, "out_features": 3}]}


def job(model: dict, alignment: Any = "nafi", **training: Any) -> dict:
    return {"name": "j", "category": "c", "model": model, "aggregation": {"alignment": alignment},
            "training": training}


def refusal(model: dict, alignment: Any = "nafi", **training: Any) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        accept_job(job(model, alignment, **training))
    return [str(e) for e in getattr(caught.value, "errors", [caught.value])]


def test_every_layer_type_declares_a_trait() -> None:
    kinds = {"matched", "elementwise", "per_channel", "input", "blocks"}
    for name, layer_type in LAYERS.items():
        params = {key: param.default for key, param in layer_type.params.items()}
        if name in ("GroupNorm",):
            params.update(num_groups=2, num_channels=4)
        if "num_features" in params:
            params["num_features"] = 8
        trait = layer_type.alignment(params)
        assert trait.kind in kinds, name
        assert trait.kind != "blocks" or trait.reason, name


def test_a_conv_chain_with_norms_is_planned_with_each_norm_on_the_layer_before_it() -> None:
    plan = alignment_plan(parse_model(CONV_CHAIN))
    assert [(m.node, [n.node for n in m.norms]) for m in plan.layers] == [("0", ["1"]), ("4", ["5"]), ("9", []),
                                                                          ("11", [])]
    assert plan.layers[1].tensors() == ("4.weight", "5.weight", "5.bias")  # no bias: bias false
    for name in ("feddna", "pfnm", "nafi"):
        assert accept_job(job(CONV_CHAIN, name)).aggregation.alignment == name


@pytest.mark.parametrize(("norm", "why"), [
    ({"type": "GroupNorm", "num_groups": 2, "num_channels": 4}, "its 2 groups each normalise 2 channels together"),
    ({"type": "BatchNorm2d", "num_features": 4}, None),
])
def test_a_norm_is_taken_only_when_its_groups_do_not_mix_channels(norm: dict, why: str | None) -> None:
    model = {"input_shape": [1, 6, 6], "layers": [
        {"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": 3}, norm, {"type": "Flatten"},
        {"type": "Linear", "in_features": 64, "out_features": 2}]}
    if why is None:
        accept_job(job(model))
        return
    (problem,) = refusal(model)
    assert problem.startswith("model.layers[1]: alignment 'nafi' cannot align this model: GroupNorm: " + why)


def test_a_batchnorm_whose_dp_groups_mix_channels_is_refused_with_the_groups() -> None:
    model = {"input_shape": [1, 6, 6], "layers": [
        {"type": "Conv2d", "in_channels": 1, "out_channels": 64, "kernel_size": 3},
        {"type": "BatchNorm2d", "num_features": 64}, {"type": "Flatten"},
        {"type": "Linear", "in_features": 1024, "out_features": 2}]}
    (problem,) = refusal(model, "feddna")
    assert problem.startswith("model.layers[1]: alignment 'feddna' cannot align this model: BatchNorm2d: "
                              "BatchNorm2d(64) trains as GroupNorm(32, 64) under DP")


def test_a_norm_over_flattened_features_is_refused_naming_it() -> None:
    model = {"input_shape": [1, 4, 4], "layers": [
        {"type": "Conv2d", "in_channels": 1, "out_channels": 2, "kernel_size": 3}, {"type": "Flatten"},
        {"type": "BatchNorm1d", "num_features": 8}, {"type": "Linear", "in_features": 8, "out_features": 2}]}
    (problem,) = refusal(model)
    assert problem.startswith("model.layers[2]: alignment 'nafi' cannot align this model: BatchNorm1d holds [8] "
                              "values per tensor, but the layer before it (0) has 2 units")


def test_an_lstm_is_refused_naming_it() -> None:
    model = {"input_shape": [4, 3], "layers": [
        {"type": "LSTM", "input_size": 3, "hidden_size": 4}, {"type": "Flatten"},
        {"type": "Linear", "in_features": 16, "out_features": 2}]}
    problems = refusal(model, "pfnm")
    assert any(p.startswith("model.layers[0]: alignment 'pfnm' cannot align this model: LSTM: ") for p in problems)


def test_a_linear_over_positions_is_refused() -> None:
    model = {"input_shape": [5, 4], "layers": [
        {"type": "Linear", "in_features": 4, "out_features": 6}, {"type": "Flatten"},
        {"type": "Linear", "in_features": 30, "out_features": 2}]}
    (problem,) = refusal(model)
    assert problem.startswith("model.layers[0]: alignment 'nafi' cannot align this model: Linear acts on each "
                              "position of a rank-2 input")


def test_fedavg_takes_every_model_alignment_refuses() -> None:
    model = {"input_shape": [4, 3], "layers": [
        {"type": "LSTM", "input_size": 3, "hidden_size": 4}, {"type": "Flatten"},
        {"type": "Linear", "in_features": 16, "out_features": 2}]}
    accept_job(job(model, "none"))


CONV = {"type": "Conv2d", "kernel_size": 3, "padding": 1}


def graph(nodes: dict, **extra: Any) -> dict:
    return {"input_shape": [3, 8, 8], "nodes": nodes, **extra}


RESNET = graph({
    "stem": {**CONV, "in_channels": 3, "out_channels": 8},
    "b1": {"block": "basic", "c": 8},
    "flat": {"type": "Flatten"},
    "head": {"type": "Linear", "in_features": 512, "out_features": 10}},
    blocks={"basic": {"params": ["c"], "nodes": {
        "conv1": {**CONV, "in_channels": "$c", "out_channels": "$c", "inputs": ["x"]},
        "relu": {"type": "ReLU"},
        "conv2": {**CONV, "in_channels": "$c", "out_channels": "$c"},
        "sum": {"type": "add", "inputs": ["conv2", "x"]}}}})


def test_a_skip_connection_is_refused_at_its_add_node() -> None:
    problems = {p.split(": ", 1)[0]: p for p in refusal(RESNET, "feddna")}
    assert "alignment 'feddna' cannot align this model: add sums b1.conv2 and stem: a skip connection ties" in \
        problems["model.nodes.b1.sum.inputs"]
    assert "its output is read by b1.conv1 and b1.sum" in problems["model.nodes.stem"]


def test_a_concat_is_refused_naming_its_inputs() -> None:
    model = graph({"a": {**CONV, "in_channels": 3, "out_channels": 4}, "b": {**CONV, "in_channels": 4, "out_channels": 4},
                   "cat": {"type": "concat", "inputs": ["b", "a"]}, "flat": {"type": "Flatten"},
                   "head": {"type": "Linear", "in_features": 512, "out_features": 2}})
    assert any(p.startswith("model.nodes.cat.inputs: alignment 'nafi' cannot align this model: concat joins b and a "
                            "along the channels") for p in refusal(model))


CHAIN_GRAPH = graph({"stem": {**CONV, "in_channels": 3, "out_channels": 4},
                     "norm": {"type": "GroupNorm", "num_groups": 1, "num_channels": 4},
                     "flat": {"type": "Flatten"},
                     "head": {"type": "Linear", "in_features": 256, "out_features": 10, "bias": False}})


def test_a_graph_that_is_a_chain_is_planned_by_node_name() -> None:
    plan, problems = plan_alignment(parse_model(CHAIN_GRAPH))
    assert problems == []
    assert plan.all_tensors() == ("stem.weight", "stem.bias", "norm.weight", "norm.bias", "head.weight")
    assert accept_job(job(CHAIN_GRAPH, "feddna")).aggregation.alignment == "feddna"


def test_a_matching_that_infers_widths_is_refused_on_a_graph_saying_what_to_write() -> None:
    (problem,) = refusal(CHAIN_GRAPH, "pfnm")
    assert problem.startswith("aggregation.alignment: 'pfnm' infers each matched layer's global width")


def test_a_new_layer_type_without_a_trait_blocks_alignment() -> None:
    odd = LayerType("Identity")  # an entry that says nothing about alignment
    assert odd.alignment({}) == AlignTrait("blocks", "its layer type declares no alignment trait")
    assert LayerType("Linear", out_width="out_features").alignment({}) == AlignTrait("matched")


def test_the_layerwise_mode_takes_one_round_per_matched_layer() -> None:
    spec = parse_model(CONV_CHAIN)
    assert alignment_plan(spec).layerwise_rounds == 4
    accepted = accept_job(job(CONV_CHAIN, {"name": "nafi", "mode": "layerwise"}, rounds=4))
    assert accepted.aggregation.alignment == "nafi"
    assert accepted.aggregation.alignment_params == {"mode": "layerwise"}
    (problem,) = refusal(CONV_CHAIN, {"name": "nafi", "mode": "layerwise"}, rounds=5)
    assert problem == ("training.rounds: is 5, but alignment 'nafi' in mode layerwise takes one round per matched "
                       "layer and this model has 4 (0, 4, 9, 11): set training.rounds to 4")


def test_the_mapping_form_needs_a_name_and_a_known_mode() -> None:
    assert any(p.startswith("aggregation.alignment.name: is required") for p in refusal(CONV_CHAIN, {"mode": "x"}))
    assert any("aggregation.alignment_params.mode" in p and "layerwise" in p
               for p in refusal(CONV_CHAIN, {"name": "pfnm", "mode": "sideways"}))
    assert any(p.startswith("aggregation.alignment_params.mode: unknown parameter for alignment 'feddna'")
               for p in refusal(CONV_CHAIN, {"name": "feddna", "mode": "layerwise"}))


def test_each_round_freezes_the_layers_matched_before_it() -> None:
    plan = alignment_plan(parse_model(CONV_CHAIN))
    assert plan.frozen_in_round(1) == frozenset()
    assert plan.frozen_in_round(2) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert plan.frozen_in_round(4) == {"0.weight", "0.bias", "1.weight", "1.bias", "4.weight", "5.weight", "5.bias",
                                       "9.weight", "9.bias"}
    assert "11.weight" not in plan.frozen_in_round(99)


def test_a_model_spec_object_is_what_the_plan_reads() -> None:
    assert isinstance(parse_model(CONV_CHAIN), ModelSpec)
