"""A model graph from its YAML/JSON mapping: blocks declared, sized and expanded into dotted nodes.

The size of every block is computed from the declarations before anything is expanded, so a block
instantiation bomb (ten instances of a block of ten instances of ...) or a block recursion is refused at
its path in time proportional to the text, never to what it would expand to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedbroker.graph.checks import Collector, check_param, check_whole, show
from fedbroker.graph.declare import Decl, Scope, declare_nodes, placeholder, signature
from fedbroker.graph.nodes import INPUT, MAX_BLOCK_DEPTH, MAX_NODES, NodeSpec, name_problem
from fedbroker.layers import LAYERS

GRAPH_KEYS = ("input_shape", "blocks", "nodes", "output")


@dataclass(frozen=True)
class Graph:
    """A graph's expanded nodes in topological order, its output node, and the graph as written back
    (every input and output explicit, so the text reads the same whichever order its mappings are in)."""

    nodes: tuple[NodeSpec, ...]
    output: str
    written: Mapping[str, Any]


def parse_graph(raw: Mapping[str, Any], *, errors: Collector, where: str) -> Graph | None:
    """The graph of a model mapping with `nodes`; None when any problem was collected."""
    before = len(errors.errors)
    blocks = _blocks(errors, raw.get("blocks"), where)
    top = Scope(at=where, params=(), inputs=(INPUT,))
    declare_nodes(errors, top, raw.get("nodes"), raw.get("output"), blocks)
    sizes = _block_sizes(errors, blocks)
    if sizes is not None and len(errors.errors) == before:
        total = _size(top, sizes)
        if total > MAX_NODES:
            errors.add(f"{where}.nodes", f"expands to more than {MAX_NODES} nodes with its blocks (counted before "
                                         f"expanding); the limit is {MAX_NODES}")
    if len(errors.errors) != before:
        return None
    nodes: list[NodeSpec] = []
    output = _expand(errors, top, blocks, nodes, prefix="", args={}, bindings={INPUT: INPUT}, where=where, made={})
    if len(errors.errors) != before:
        return None
    written = {"blocks": {name: _written(scope) for name, scope in blocks.items()}, **_written(top)}
    if not blocks:
        del written["blocks"]
    del written["params"], written["inputs"]
    return Graph(tuple(nodes), output, written)


def _blocks(errors: Collector, raw: Any, where: str) -> dict[str, Scope]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        errors.add(f"{where}.blocks", f"must be a mapping of named blocks, got {show(raw)}")
        return {}
    blocks: dict[str, Scope] = {}
    for name, block in raw.items():
        at = f"{where}.blocks.{name}"
        problem = name_problem(name)
        if problem:
            errors.add(at, problem)
            continue
        scope = signature(errors, at, block)
        if scope is not None:
            blocks[name] = scope
    for name, scope in blocks.items():
        declare_nodes(errors, scope, raw[name].get("nodes"), raw[name].get("output"), blocks)
    return blocks


def _children(scope: Scope) -> list[Decl]:
    return [d for d in scope.decls.values() if d.block]


def _block_sizes(errors: Collector, blocks: Mapping[str, Scope]) -> dict[str, int] | None:
    """Each block's expanded node count (capped just above MAX_NODES) and nesting depth, by an iterative
    walk of the block graph: a recursion is named with its path of blocks, a nesting past MAX_BLOCK_DEPTH
    at the block. None when either was found."""
    sizes: dict[str, int] = {}
    depth: dict[str, int] = {}
    ok = True
    for root in blocks:
        if root in sizes:
            continue
        path: list[str] = [root]
        stack: list[tuple[str, int]] = [(root, 0)]
        while stack:
            name, i = stack.pop()
            children = _children(blocks[name])
            if i < len(children):
                stack.append((name, i + 1))
                child = children[i].block
                if child in path:
                    loop = path[path.index(child):]
                    errors.add(f"{children[i].at}.block", "block recursion: " + " → ".join([*loop, child]))
                    ok = False
                elif child not in sizes:
                    path.append(child)
                    stack.append((child, 0))
                continue
            path.pop()
            if not all(c.block in sizes for c in children):
                continue  # inside a recursion (already named)
            depth[name] = 1 + max((depth[c.block] for c in children), default=0)
            sizes[name] = _size(blocks[name], sizes)
            if depth[name] > MAX_BLOCK_DEPTH:
                ok = False
                if depth[name] == MAX_BLOCK_DEPTH + 1:  # named where the nesting first passes the limit
                    errors.add(blocks[name].at, f"nests blocks {depth[name]} deep; the limit is {MAX_BLOCK_DEPTH}")
    return sizes if ok else None


def _size(scope: Scope, sizes: Mapping[str, int]) -> int:
    total = 0
    for decl in scope.decls.values():
        total = min(MAX_NODES + 1, total + (sizes[decl.block] if decl.block else 1))
    return total


def _expand(errors: Collector, scope: Scope, blocks: Mapping[str, Scope], nodes: list[NodeSpec], *, prefix: str,
            args: Mapping[str, Any], bindings: dict[str, str], where: str, made: dict[Any, dict[str, Any]]) -> str:
    """Append the scope's nodes, named `prefix` + name, with its arguments substituted; the name of the node
    that is its output. Recursion is as deep as blocks nest (at most MAX_BLOCK_DEPTH). Instances given the same
    arguments share one parameters mapping (`made`): checked once, and shapes are inferred once per mapping."""
    append, make = nodes.append, NodeSpec
    for decl in scope.order:
        name, fixed, later = decl.name, decl.fixed, decl.later
        inputs = tuple(map(bindings.__getitem__, decl.inputs))
        full = prefix + name
        if decl.block:
            target = blocks[decl.block]
            given = {k: args[placeholder(v)] if placeholder(v) else v for k, v in fixed.items()}
            bindings[name] = _expand(errors, target, blocks, nodes, prefix=full + ".", args=given,
                                     bindings=dict(zip(target.inputs, inputs, strict=True)), where=where, made=made)
            continue
        if later:
            fixed = _substituted(errors, f"{where}.nodes.{full}", decl, args, made)
        append(make(full, decl.type, fixed, inputs))
        bindings[name] = full
    return bindings[scope.output]


def _substituted(errors: Collector, at: str, decl: Decl, args: Mapping[str, Any],
                 made: dict[Any, dict[str, Any]]) -> dict[str, Any]:
    key: Any = (id(decl), *map(args.__getitem__, decl.later.values()))
    try:
        found = made.get(key)
    except TypeError:  # a list-valued argument: not shared
        found, key = None, None
    if found is not None:
        return found
    if LAYERS[decl.type].check_params is not None:  # a library node: checked whole, once its values are given
        params = check_whole(errors, at, decl.type, {**decl.fixed, **{k: args[n] for k, n in decl.later.items()}})
    else:
        table = LAYERS[decl.type].params
        params = {k: _given(errors, f"{at}.{k}", decl, k, args) if k in decl.later else decl.fixed[k]
                  for k in table if k in decl.fixed or k in decl.later}
    if key is not None:
        made[key] = params
    return params


def _given(errors: Collector, at: str, decl: Decl, key: str, args: Mapping[str, Any]) -> Any:
    """A parameter a block instance substitutes, checked at the node's expanded path."""
    param, name = LAYERS[decl.type].params[key], decl.later[key]
    if args[name] is None and param.required:
        errors.add(at, f"is required for {decl.type} (block parameter ${name} is null)")
    return check_param(errors, at, param, args[name])


def _written(scope: Scope) -> dict[str, Any]:
    nodes: dict[str, Any] = {}
    for decl in scope.order:
        if decl.block:
            nodes[decl.name] = {"block": decl.block, **decl.fixed, "inputs": list(decl.inputs)}
        else:
            later = {key: f"${name}" for key, name in decl.later.items()}
            nodes[decl.name] = {"type": decl.type, **decl.fixed, **later, "inputs": list(decl.inputs)}
    return {"params": list(scope.params), "inputs": list(scope.inputs), "nodes": nodes, "output": scope.output}
