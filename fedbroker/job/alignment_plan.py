"""Which units of a model neuron alignment can match, read off the model: each layer type's alignment trait
(`fedbroker.layers.base.AlignTrait`) and a walk over the model's nodes in order.

Alignment permutes the units (rows) of each matched layer (Linear, Conv2d) and moves the next matched layer's
input blocks the same way; that keeps the function only if every node in between carries unit i to unit i
(an elementwise trait) and nothing else reads the permuted units. So a model alignment can take is a *chain*:
every node reads the node before it, and no node merges two of them. A per-channel node (a BatchNorm, a
GroupNorm with one channel per group) is attached to the matched layer before it: its per-channel tensors are
permuted with that layer's units, and averaged with them. Everything else is refused at submission with the
node's path and the reason: an `add` (a skip connection ties two layers' unit orders together), a `concat`, a
GroupNorm whose groups mix channels, a type that declares no trait (LSTM, attention, ...).

The plan also defines the layer-wise mode's rounds (NAFI Appendix D): round r matches matched layer r − 1
(0-based), and every tensor of the layers before it, their attached norms included, is frozen in that round.
No torch here: the coordinator checks a job with it, the aggregation service and the workers read the same
plan, so the three agree on names without a message carrying them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.model_spec import ModelSpec, output_shapes
from fedbroker.layers import LAYERS
from fedbroker.layers.base import AlignTrait

MERGES = ("add", "concat")  # the graph's merge nodes: more than one input, never in a chain


@dataclass(frozen=True)
class AttachedNorm:
    """A per-channel node whose tensors travel with the units of the matched layer before it."""

    node: str
    type: str
    params: Mapping[str, Any]

    def tensors(self) -> tuple[str, ...]:
        """Its tensors by state_dict name (one value per unit each)."""
        return tuple(f"{self.node}.{suffix}" for suffix in LAYERS[self.type].tensors(self.params))


@dataclass(frozen=True)
class MatchedLayer:
    """One layer whose units alignment matches, with the per-channel nodes attached to its units."""

    node: str                         # its node's name: "0", "1", ... in the chain form, "b1.conv1" in a graph
    type: str
    params: Mapping[str, Any]
    bias: bool                        # whether it has a `<node>.bias` tensor
    norms: tuple[AttachedNorm, ...] = ()

    @property
    def weight_name(self) -> str:
        """The state_dict name of its weight."""
        return f"{self.node}.weight"

    @property
    def bias_name(self) -> str | None:
        """The state_dict name of its bias (None without one)."""
        return f"{self.node}.bias" if self.bias else None

    def channel_tensors(self) -> tuple[str, ...]:
        """The attached nodes' tensors (one value per unit), by state_dict name, in order."""
        return tuple(name for norm in self.norms for name in norm.tensors())

    def tensors(self) -> tuple[str, ...]:
        """Every tensor that moves with this layer's units."""
        own = (self.weight_name,) + ((self.bias_name,) if self.bias_name else ())
        return own + self.channel_tensors()


@dataclass(frozen=True)
class AlignmentPlan:
    """The matched layers of a model, input → output; the last one is the output layer."""

    layers: tuple[MatchedLayer, ...]

    @property
    def layerwise_rounds(self) -> int:
        """Rounds of the layer-wise mode: one per matched layer (the last one averages the output layer)."""
        return len(self.layers)

    def frozen_in_round(self, round_index: int) -> frozenset[str]:
        """The tensors no site may train in layer-wise round `round_index` (1-based): those of every matched
        layer before layer `round_index − 1`, with their attached norms (never the output layer's: a round past
        the scheme, which submission refuses, freezes what its last round does)."""
        done = self.layers[:max(0, min(round_index - 1, len(self.layers) - 1))]
        return frozenset(name for layer in done for name in layer.tensors())

    def all_tensors(self) -> tuple[str, ...]:
        """Every tensor the plan moves, layer by layer."""
        return tuple(name for layer in self.layers for name in layer.tensors())


@dataclass(frozen=True)
class _Node:
    name: str
    type: str
    params: Mapping[str, Any]
    inputs: tuple[str, ...]
    path: str


def model_nodes(spec: ModelSpec) -> list[_Node]:
    """The model's nodes in order, each with the path a problem names: the chain form's layers as nodes "0",
    "1", ... (`model.layers[i]`), or the graph's nodes with blocks expanded (`model.nodes.<name>`)."""
    if spec.layers:
        return [_Node(str(i), layer.type, layer.params, ("input",) if i == 0 else (str(i - 1),), f"model.layers[{i}]")
                for i, layer in enumerate(spec.layers)]
    return [_Node(n.name, n.type, n.params, tuple(n.inputs), f"model.nodes.{n.name}") for n in spec.nodes]


def _trait(node: _Node) -> AlignTrait:
    layer_type = LAYERS.get(node.type)
    if layer_type is None:
        return AlignTrait("blocks", "its type declares no alignment trait")
    return layer_type.alignment(node.params)


def _merge_problem(node: _Node) -> str:
    reads = " and ".join(node.inputs)
    if node.type == "add":
        return (f"add sums {reads}: a skip connection ties their unit orders together (unit i of one must be unit i "
                f"of the other), which matching each layer on its own cannot keep")
    if node.type == "concat":
        return (f"concat joins {reads} along the channels: the next layer then reads units of several layers, each "
                f"permuted on its own")
    return f"{node.type} reads {reads}: alignment needs a chain, each node reading only the node before it"


def _input_ranks(spec: ModelSpec) -> dict[str, int]:
    """The rank of each node's (first) input, without the batch axis; {} when the shapes cannot be inferred (the
    model's own problems are reported where it is parsed)."""
    nodes = model_nodes(spec)
    try:
        shapes = output_shapes(spec)
    except ConfigError:
        return {}
    rank = {"input": len(spec.input_shape), **{n.name: len(s) for n, s in zip(nodes, shapes)}}
    return {n.name: rank.get(n.inputs[0], 1) for n in nodes if n.inputs}


def plan_alignment(spec: ModelSpec) -> tuple[AlignmentPlan, list[ConfigError]]:
    """The model's matched layers, and every reason alignment cannot take the model (each naming its node)."""
    problems: list[ConfigError] = []
    layers: list[MatchedLayer] = []
    nodes = model_nodes(spec)
    readers: dict[str, list[str]] = {}
    for node in nodes:
        for source in node.inputs:
            readers.setdefault(source, []).append(node.name)
    previous = "input"
    ranks = _input_ranks(spec)
    for node in nodes:
        if node.type in MERGES or len(node.inputs) != 1:
            problems.append(ConfigError(f"{node.path}.inputs", _merge_problem(node)))
        elif node.inputs[0] != previous:
            problems.append(ConfigError(f"{node.path}.inputs", (
                f"reads {node.inputs[0]}, not the node before it ({previous}): alignment needs a chain, each node "
                f"reading only the node before it")))
        if len(readers.get(node.name, [])) > 1:
            problems.append(ConfigError(node.path, (
                f"its output is read by {' and '.join(readers[node.name])}: both would have to follow one "
                f"permutation of its units")))
        previous = node.name
        if node.type in MERGES:
            continue
        trait = _trait(node)
        rank = ranks.get(node.name, 1)
        if trait.kind == "matched" and LAYERS[node.type].width_axis != 0 and rank > 1:
            problems.append(ConfigError(node.path, (
                f"{node.type} acts on each position of a rank-{rank} input: its units lie on the last axis, "
                f"interleaved with the positions, where alignment moves a unit's values as one block")))
        elif trait.kind == "matched":
            layers.append(MatchedLayer(node.name, node.type, node.params, bool(node.params.get("bias", True))))
        elif trait.kind == "per_channel":
            if not layers:
                problems.append(ConfigError(node.path, (
                    f"{node.type} normalises the model's input channels, before any Linear or Conv2d: it has no "
                    f"matched layer whose units it could travel with")))
                continue
            last = layers[-1]
            units = last.params.get(LAYERS[last.type].out_width)
            widths = {shape[0] for shape in LAYERS[node.type].tensors(node.params).values()}
            if widths != {units}:
                problems.append(ConfigError(node.path, (
                    f"{node.type} holds {sorted(widths)} values per tensor, but the layer before it ({last.node}) has "
                    f"{units} units: its values cannot travel with them (after a Flatten, one unit is several "
                    f"features)")))
                continue
            layers[-1] = MatchedLayer(last.node, last.type, last.params, last.bias,
                                      last.norms + (AttachedNorm(node.name, node.type, node.params),))
        elif trait.kind == "input" and node is not nodes[0]:
            problems.append(ConfigError(node.path, f"{node.type} acts on the model's input; alignment needs it first"))
        elif trait.kind == "blocks":
            problems.append(ConfigError(node.path, f"{node.type}: {trait.reason}"))
    if len(layers) < 2 and not problems:
        names = "/".join(name for name, layer_type in LAYERS.items() if layer_type.weighted)
        problems.append(ConfigError("model", f"needs at least one hidden {names} layer to align"))
    return AlignmentPlan(tuple(layers)), problems


def alignment_plan(spec: ModelSpec) -> AlignmentPlan:
    """The plan of a model alignment can take; ConfigError(s) naming each node it cannot."""
    plan, problems = plan_alignment(spec)
    if problems:
        raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
    return plan
