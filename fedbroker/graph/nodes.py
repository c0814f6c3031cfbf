"""A graph's expanded node, the merge nodes, the names a node may take, and the graph's limits."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, NamedTuple

# a node's or block's name; "input" names the model's input
NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")  # fullmatch
INPUT = "input"
# Names torch's nn.Module and nn.ModuleDict already use as attributes: a node so named could not be a
# submodule of the graph's torch module (tests/kernel/test_graph_names.py checks this list against torch).
TORCH_ATTRIBUTES = frozenset({
    "add_module", "apply", "bfloat16", "buffers", "call_super_init", "children", "clear", "compile", "cpu", "cuda",
    "double", "dump_patches", "eval", "extra_repr", "float", "forward", "get_buffer", "get_extra_state",
    "get_parameter", "get_submodule", "half", "ipu", "items", "keys", "load_state_dict", "modules", "mtia",
    "named_buffers", "named_children", "named_modules", "named_parameters", "parameters", "pop",
    "register_backward_hook", "register_buffer", "register_forward_hook", "register_forward_pre_hook",
    "register_full_backward_hook", "register_full_backward_pre_hook", "register_load_state_dict_post_hook",
    "register_load_state_dict_pre_hook", "register_module", "register_parameter", "register_state_dict_post_hook",
    "register_state_dict_pre_hook", "requires_grad_", "set_extra_state", "set_submodule", "share_memory",
    "state_dict", "to", "to_empty", "train", "training", "type", "update", "values", "xpu", "zero_grad",
})
# merge nodes: several inputs, no parameters. `add`: inputs of one shape; `concat`: along the channel axis
# (axis 0 of a sample's shape), every other axis equal.
MERGES = frozenset({"add", "concat"})

MAX_PARAMETERS = 200_000_000
MAX_NODES = 100_000            # after blocks are expanded; counted before anything is expanded
MAX_BLOCK_DEPTH = 16           # blocks inside blocks
MAX_SHAPE_ELEMENTS = 1 << 28   # one node's output, per sample (1 GiB of float32)
MAX_ACTIVATION_ELEMENTS = 1 << 30  # all nodes' outputs together, per sample (4 GiB of float32)
MAX_PROBLEMS = 100             # problems named in one report; the rest are counted


class NodeSpec(NamedTuple):
    """One node of a model with its blocks expanded: its dotted name ("b1.conv1"), its type (a layer type
    or a merge), its checked parameters and the names of the nodes it reads ("input" for the model's input).
    Immutable (a named tuple: a 10^5-node graph builds in a fraction of a second)."""

    name: str
    type: str
    params: Mapping[str, Any]
    inputs: tuple[str, ...]


def name_problem(name: object) -> str:
    """Why `name` cannot name a node or a block ("" when it can)."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        return "a name must match [a-z][a-z0-9_]{0,63} (lower case letter, then letters, digits, _)"
    if name == INPUT:
        return "'input' is reserved: it names the model's input"
    if name in TORCH_ATTRIBUTES:
        return f"{name!r} is reserved: torch's modules use it as an attribute"
    return ""


def tree_order(names: list[str]) -> list[str]:
    """Dotted names in the order torch enumerates nested modules registered in `names`' order: each
    prefix ("b1") where it first appears, all of its names together (a module's state_dict order)."""
    tree: dict[str, dict] = {}  # type: ignore[type-arg]
    for name in names:
        level = tree
        for part in name.split("."):
            level = level.setdefault(part, {})
    out: list[str] = []
    stack: list[tuple[str, dict]] = [("", tree)]  # type: ignore[type-arg]
    while stack:
        prefix, level = stack.pop()
        if not level:
            out.append(prefix)
        stack.extend((f"{prefix}.{part}" if prefix else part, sub) for part, sub in reversed(level.items()))
    return out
