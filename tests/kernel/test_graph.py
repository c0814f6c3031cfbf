"""The model graph (model.nodes, model.blocks): expansion, names, shapes and every problem named with its path."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.graph.nodes import MAX_BLOCK_DEPTH, MAX_NODES
from fedbroker.job.model_spec import model_bounds
from fedbroker.job.spec import job_from_text, output_shapes, parameter_shapes, parse_model

BASIC = {
    "params": ["cin", "cout", "stride"],
    "inputs": ["x"],
    "nodes": {
        "conv1": {"type": "Conv2d", "in_channels": "$cin", "out_channels": "$cout", "kernel_size": 3,
                  "stride": "$stride", "padding": 1, "bias": False, "inputs": ["x"]},
        "norm1": {"type": "GroupNorm", "num_groups": 2, "num_channels": "$cout"},
        "relu1": {"type": "ReLU"},
        "conv2": {"type": "Conv2d", "in_channels": "$cout", "out_channels": "$cout", "kernel_size": 3, "padding": 1},
        "sum": {"type": "add", "inputs": ["conv2", "x"]},
    },
    "output": "sum",
}
RESNET: dict[str, Any] = {
    "input_shape": [3, 8, 8],
    "blocks": {"basic": BASIC},
    "nodes": {
        "stem": {"type": "Conv2d", "in_channels": 3, "out_channels": 4, "kernel_size": 3, "padding": 1},
        "b1": {"block": "basic", "cin": 4, "cout": 4, "stride": 1},
        "b2": {"block": "basic", "cin": 4, "cout": 4, "stride": 1},
        "cat": {"type": "concat", "inputs": ["b2", "stem"]},
        "pool": {"type": "AvgPool2d", "kernel_size": 8},
        "flat": {"type": "Flatten"},
        "head": {"type": "Linear", "in_features": 8, "out_features": 3},
    },
}


def model(**changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(RESNET)
    out.update(changes)
    return out


def problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises((ConfigError, ConfigErrors)) as caught:
        parse_model(raw)
    exc = caught.value
    return [str(e) for e in getattr(exc, "errors", [exc])]


def test_blocks_expand_into_dotted_nodes_in_topological_order():
    spec = parse_model(RESNET)
    names = [n.name for n in spec.nodes]
    assert names == ["stem", "b1.conv1", "b1.norm1", "b1.relu1", "b1.conv2", "b1.sum", "b2.conv1", "b2.norm1",
                     "b2.relu1", "b2.conv2", "b2.sum", "cat", "pool", "flat", "head"]
    by_name = {n.name: n for n in spec.nodes}
    assert by_name["b1.conv1"].inputs == ("stem",) and by_name["b1.sum"].inputs == ("b1.conv2", "stem")
    assert by_name["b2.conv1"].inputs == ("b1.sum",) and by_name["cat"].inputs == ("b2.sum", "stem")
    assert by_name["b1.conv1"].params["in_channels"] == 4 and by_name["b1.conv1"].params["bias"] is False
    assert spec.output == "head" and spec.output_shape == (3,) and spec.layers == ()
    assert output_shapes(spec)[names.index("cat")] == (8, 8, 8)  # concat adds channels: 4 + 4


def test_weights_are_named_node_dot_tensor_inside_block_instances():
    names = list(parameter_shapes(parse_model(RESNET)))
    assert names[:4] == ["stem.weight", "stem.bias", "b1.conv1.weight", "b1.norm1.weight"]
    assert "b2.conv2.bias" in names and "b1.conv1.bias" not in names and names[-2:] == ["head.weight", "head.bias"]


def test_the_wire_form_reparses_to_the_same_model_whatever_the_mapping_order():
    spec = parse_model(RESNET)
    again = parse_model(json.loads(spec.to_json()))
    assert again == spec and again.to_json() == spec.to_json()
    shuffled = json.loads(spec.to_json())
    shuffled["nodes"] = dict(reversed(list(shuffled["nodes"].items())))  # every input is explicit on the wire
    assert parse_model(shuffled).nodes == spec.nodes


def test_a_chain_is_a_graph_of_numbered_nodes_and_keeps_its_names():
    chain = {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 5},
                                            {"type": "ReLU"}, {"type": "Linear", "in_features": 5, "out_features": 2}]}
    spec = parse_model(chain)
    assert [(n.name, n.inputs) for n in spec.nodes] == [("0", ("input",)), ("1", ("0",)), ("2", ("1",))]
    assert spec.output == "2" and not spec.is_graph
    assert list(parameter_shapes(spec)) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert json.loads(spec.to_json()) == {"input_shape": [4], "layers": [
        {"type": "Linear", "in_features": 4, "out_features": 5, "bias": True}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 5, "out_features": 2, "bias": True}]}


def test_concat_of_mismatched_maps_names_the_input_and_both_shapes():
    raw = model()
    raw["nodes"]["down"] = {"type": "MaxPool2d", "kernel_size": 2, "inputs": ["stem"]}
    raw["nodes"]["b1"]["inputs"] = ["stem"]
    raw["nodes"]["cat"] = {"type": "concat", "inputs": ["b2", "down"]}
    raw["nodes"] = {k: raw["nodes"][k] for k in ["stem", "down", "b1", "b2", "cat", "pool", "flat", "head"]}
    assert problems(raw) == ["model.nodes.cat.inputs[1]: 4×4×4 cannot concat with 4×8×8 (concat joins channels, "
                             "axis 0; every other axis must match)"]


def test_add_of_different_shapes_is_refused_inside_the_block_instance():
    raw = model()
    raw["nodes"]["b2"]["cout"] = 8  # conv2 outputs 8 channels, x has 4: the block's add fails in b2 only
    found = problems(raw)
    assert "model.nodes.b2.sum.inputs[1]: 4×8×8 cannot add to 8×8×8 (add needs inputs of one shape)" in found


def test_structural_problems_are_all_named_at_once():
    raw = model()
    raw["nodes"]["b1"]["extra"] = 1                                       # extra block parameter
    del raw["nodes"]["b2"]["stride"]                                      # missing block parameter
    raw["nodes"]["cat"]["inputs"] = ["b2", "nowhere"]                      # dangling input
    raw["nodes"]["spare"] = {"type": "ReLU", "inputs": ["stem"]}            # unused node
    raw["nodes"]["Bad"] = {"type": "ReLU"}                                 # bad name
    raw["nodes"]["mystery"] = {"block": "missing"}                         # unknown block
    raw["output"] = "head"
    found = problems(raw)
    assert "model.nodes.b1.extra: block basic has no parameter 'extra'; its params: cin, cout, stride" in found
    assert "model.nodes.b2.stride: is required by block basic" in found
    assert any(p.startswith("model.nodes.cat.inputs[1]: unknown node 'nowhere'") for p in found)
    assert any(p.startswith("model.nodes.Bad: a name must match") for p in found)
    assert any(p.startswith("model.nodes.mystery.block: unknown block 'missing'; declared: basic") for p in found)


def test_a_node_that_does_not_reach_the_output_is_named():
    raw = model(output="head")
    raw["nodes"]["spare"] = {"type": "ReLU", "inputs": ["stem"]}
    assert problems(raw) == ["model.nodes.spare: does not reach the output 'head': every node must feed the output"]


def test_a_cycle_is_named_with_its_path():
    raw = model()
    raw["nodes"]["b1"]["inputs"] = ["cat"]                                 # b1 → b2 → cat → b1
    found = problems(raw)
    assert any(p.startswith("model.nodes.b1.inputs[0]: cycle: b1 → cat → b2 → b1") for p in found), found


def test_a_block_input_no_node_reads_is_named():
    raw = model()
    raw["blocks"]["two"] = {"inputs": ["x", "y"], "nodes": {"r": {"type": "ReLU", "inputs": ["x"]}}}
    raw["nodes"]["b1"]["inputs"] = ["both"]
    raw["nodes"] = {"stem": raw["nodes"].pop("stem"), "both": {"block": "two", "inputs": ["stem", "stem"]},
                    **raw["nodes"]}
    found = problems(raw)
    assert found == ["model.blocks.two.inputs[1]: input 'y' is read by no node that reaches the output"]


def test_reserved_and_repeated_names_are_refused():
    raw = model()
    raw["nodes"]["input"] = {"type": "ReLU", "inputs": ["head"]}
    raw["nodes"]["forward"] = {"type": "ReLU", "inputs": ["input"]}
    raw["blocks"]["basic"]["params"] = ["cin", "cout", "stride", "cin"]
    found = problems(raw)
    assert any(p.startswith("model.nodes.input: 'input' is reserved") for p in found)
    assert any(p.startswith("model.nodes.forward: 'forward' is reserved") for p in found)
    assert "model.blocks.basic.params[3]: 'cin' is named twice" in found


def test_a_node_named_twice_in_the_yaml_text_is_refused():
    text = ("name: j\ncategory: c\nmodel:\n  input_shape: [4]\n  nodes:\n    a: {type: ReLU}\n    a: {type: Tanh}\n"
            "    head: {type: Linear, in_features: 4, out_features: 2}\n")
    with pytest.raises(ConfigError, match="repeats the key 'a' in one mapping"):
        job_from_text(text)


def test_a_placeholder_must_name_a_parameter_of_its_block():
    raw = model()
    raw["blocks"]["basic"]["nodes"]["norm1"]["num_groups"] = "$groups"
    raw["nodes"]["stem"]["out_channels"] = "$cout"
    found = problems(raw)
    assert any(p.startswith("model.blocks.basic.nodes.norm1.num_groups: '$groups' must name a parameter of this "
                            "block") for p in found)
    assert any(p.startswith("model.nodes.stem.out_channels: '$cout' must name a block parameter") for p in found)


def test_a_substituted_value_is_checked_at_the_instance_path():
    raw = model()
    raw["nodes"]["b1"]["stride"] = 0
    found = problems(raw)
    assert found == ["model.nodes.b1.conv1.stride: must be an integer in [1, 64], got 0"]


def test_block_recursion_is_named_with_its_path_of_blocks():
    raw = model()
    raw["blocks"]["outer"] = {"nodes": {"inner": {"block": "middle"}}}
    raw["blocks"]["middle"] = {"nodes": {"again": {"block": "outer"}}}
    found = problems(raw)
    assert "model.blocks.middle.nodes.again.block: block recursion: outer → middle → outer" in found


def bomb(levels: int, fan: int = 10) -> dict[str, Any]:
    """A model whose blocks nest `levels` deep, each holding `fan` instances of the one below."""
    blocks: dict[str, Any] = {"l0": {"nodes": {f"n{i}": {"type": "ReLU"} for i in range(fan)}}}
    for k in range(1, levels):
        blocks[f"l{k}"] = {"nodes": {f"i{i}": {"block": f"l{k - 1}"} for i in range(fan)}}
    return {"input_shape": [4], "blocks": blocks, "nodes": {"body": {"block": f"l{levels - 1}"}}}


def test_a_block_instantiation_bomb_is_refused_before_it_is_expanded():
    assert problems(bomb(12)) == [f"model.nodes: expands to more than {MAX_NODES} nodes with its blocks (counted "
                                  f"before expanding); the limit is {MAX_NODES}"]


def test_blocks_nested_past_the_depth_limit_are_refused():
    found = problems(bomb(MAX_BLOCK_DEPTH + 3, fan=1))
    assert found == [f"model.blocks.l{MAX_BLOCK_DEPTH}: nests blocks {MAX_BLOCK_DEPTH + 1} deep; the limit is "
                     f"{MAX_BLOCK_DEPTH}"]


def test_the_node_limit_itself_validates():
    spec = parse_model(bomb(5))  # 10^5 ReLU nodes
    assert len(spec.nodes) == MAX_NODES and spec.nodes[-1].name == "body.i9.i9.i9.i9.n9"


def test_a_shape_that_explodes_is_refused_at_the_node_where_it_passes_the_limit():
    nodes: dict[str, Any] = {"c0": {"type": "Conv2d", "in_channels": 1, "out_channels": 64, "kernel_size": 1}}
    for i in range(1, 40):
        nodes[f"c{i}"] = {"type": "concat", "inputs": [f"c{i - 1}", f"c{i - 1}"]}
    nodes["flat"] = {"type": "Flatten"}
    found = problems({"input_shape": [1, 64, 64], "nodes": nodes})
    assert len(found) == 1 and found[0].startswith("model.nodes.c11: outputs 131072×64×64 = 536870912 values")


def test_merges_and_layers_check_their_number_of_inputs():
    raw = model()
    raw["nodes"]["cat"]["inputs"] = ["b2"]
    raw["nodes"]["pool"]["inputs"] = ["cat", "stem"]
    found = problems(raw)
    assert "model.nodes.cat.inputs: concat merges two or more inputs, got 1" in found
    assert "model.nodes.pool.inputs: AvgPool2d takes one input, got 2" in found


def test_the_graph_leaves_the_outputs_shape_to_the_jobs_task():
    """A U-Net's output is per pixel: what the output must be is the task's rule (the job's task section), not the
    graph's; the graph only exposes the output's shape."""
    raw = model(output="pool")
    raw["nodes"] = {k: v for k, v in raw["nodes"].items() if k not in ("flat", "head")}
    assert parse_model(raw).output_shape == (8, 1, 1)


def test_a_model_is_a_chain_or_a_graph_never_both():
    raw = model(layers=[{"type": "ReLU"}])
    assert any(p.startswith("model.layers: unknown field") for p in problems(raw))


def test_bounds_count_parameters_activations_and_flops_by_the_stated_rule():
    spec = parse_model({"input_shape": [2, 4, 4], "nodes": {
        "conv": {"type": "Conv2d", "in_channels": 2, "out_channels": 3, "kernel_size": 3, "padding": 1},
        "both": {"type": "add", "inputs": ["conv", "conv"]},
        "flat": {"type": "Flatten"},
        "head": {"type": "Linear", "in_features": 48, "out_features": 5}}})
    found = model_bounds(spec)
    assert found.parameters == (3 * 2 * 9 + 3) + (5 * 48 + 5)
    assert found.activation_bytes == 4 * (32 + 48 + 48 + 48 + 5)
    # conv: 2 × 54 weights × 16 positions + 48 outputs; add, flat: 48 each; head: 2 × 240 + 5
    assert found.flops == (2 * 54 * 16 + 48) + 48 + 48 + (2 * 240 + 5)


def test_every_torch_module_attribute_a_node_could_be_named_is_reserved():
    import re

    from torch import nn

    from fedbroker.graph.nodes import NAME, TORCH_ATTRIBUTES
    names = {n for n in set(dir(nn.Module())) | set(dir(nn.ModuleDict())) if NAME.fullmatch(n)}
    assert names <= TORCH_ATTRIBUTES, sorted(names - TORCH_ATTRIBUTES)
    assert re.fullmatch(NAME, "b1") and not re.fullmatch(NAME, "B1")


def test_the_graph_module_runs_merges_out_of_place_and_matches_the_spec_names():
    import torch

    from fedbroker.model import build_model
    spec = parse_model(RESNET)
    model = build_model(spec, seed=0)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == parameter_shapes(spec)
    assert list(model.state_dict()) == list(parameter_shapes(spec))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    model(x).sum().backward()  # an in-place merge on a tensor autograd still needs would raise here
    assert x.grad is not None and model(x).shape == (2, 3)


def test_a_graph_job_is_refused_what_only_chains_support_yet():
    from fedbroker.job.submission import accept_job

    job = {"name": "graph", "category": "digits", "model": model(),
           "training": {"rounds": 1, "local_epochs": 1, "batch_size": 8, "lr": 0.1},
           "aggregation": {"alignment": "pfnm", "weighting": "fedavg", "selection": "all"},
           "data": {"standardize": "federated", "bounds": [[0, 1]]}}
    with pytest.raises(ConfigErrors) as caught:
        accept_job(job)
    text = str(caught.value)
    assert "alignment 'pfnm' cannot align this model: add sums" in text  # named at the node (alignment_plan)
    assert "data.standardize: federated puts the agreed standardize layer in front of a chain" in text
    job["aggregation"] = {"alignment": "none", "weighting": "fedavg", "selection": "ga",
                          "selection_params": {"m": 1, "fitness": "probe", "probe_dataset": "digits"}}
    job["data"] = {"standardize": "none"}
    with pytest.raises(ConfigError, match="a probe that runs a chain of layers"):
        accept_job(job)
    job["aggregation"] = {"alignment": "none", "weighting": "fedavg", "selection": "all"}
    assert accept_job(job).model.is_graph


def test_an_instance_as_the_output_names_its_blocks_output_node():
    raw = {"input_shape": [6], "blocks": {"mlp": {"params": ["w"], "nodes": {
        "lin": {"type": "Linear", "in_features": "$w", "out_features": "$w"},  # no inputs: the block's input
        "act": {"type": "Tanh"}}}},
        "nodes": {"first": {"block": "mlp", "w": 6}, "last": {"block": "mlp", "w": 6}}}
    spec = parse_model(raw)
    assert spec.output == "last.act" and spec.output_shape == (6,)
    assert [(n.name, n.inputs) for n in spec.nodes] == [
        ("first.lin", ("input",)), ("first.act", ("first.lin",)), ("last.lin", ("first.act",)),
        ("last.act", ("last.lin",))]
