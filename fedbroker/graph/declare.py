"""A graph's scopes as declared: the model's `nodes` and each block's, every node's names, type or block,
parameters and inputs checked where it is written, every problem collected with its path.

A scope is checked once however often it is instantiated: names, references (a dangling input), the
order of its nodes (a cycle, a node that does not reach the scope's output, an input nothing reads), and
the parameters it fixes. What a block instance substitutes ("$cin") is checked at expansion.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedbroker.graph.checks import Collector, layer_params, show
from fedbroker.graph.nodes import INPUT, MERGES, name_problem
from fedbroker.layers import LAYERS

NODE_KEYS = frozenset({"type", "inputs"})
INSTANCE_KEYS = frozenset({"block", "inputs"})


@dataclass
class Decl:
    """One node as a scope writes it: a layer or merge (`type`) or a block instance (`block`)."""

    name: str
    at: str
    type: str = ""
    block: str = ""
    fixed: dict[str, Any] = field(default_factory=dict)   # checked parameters, or an instance's raw arguments
    later: dict[str, str] = field(default_factory=dict)   # parameter -> the block parameter ("$cin") it takes
    inputs: tuple[str, ...] = ()


@dataclass
class Scope:
    """The model's nodes, or one block's: its parameters and inputs, its nodes, its output."""

    at: str
    params: tuple[str, ...]
    inputs: tuple[str, ...]
    decls: dict[str, Decl] = field(default_factory=dict)
    output: str = ""
    order: list[Decl] = field(default_factory=list)     # topological, ending at the output


def placeholder(value: Any) -> str:
    """The block parameter a value written exactly "$name" stands for ("" for any other value)."""
    return value[1:] if isinstance(value, str) and value.startswith("$") else ""


def _names(errors: Collector, at: str, raw: Any, *, default: list[str]) -> tuple[str, ...]:
    """A list of distinct names (a block's params or inputs)."""
    if raw is None:
        return tuple(default)
    if not isinstance(raw, list):
        errors.add(at, f"must be a list of names, got {show(raw)}")
        return ()
    out: list[str] = []
    for i, name in enumerate(raw):
        problem = name_problem(name)
        if problem:
            errors.add(f"{at}[{i}]", f"{show(name)}: {problem}")
        elif name in out:
            errors.add(f"{at}[{i}]", f"{name!r} is named twice")
        else:
            out.append(name)
    return tuple(out)


def signature(errors: Collector, at: str, raw: Any) -> Scope | None:
    """A block's parameters and inputs (its nodes are read by `declare_nodes` once every block is known)."""
    if not isinstance(raw, Mapping):
        errors.add(at, f"a block must be a mapping with nodes (and params, inputs, output), got {show(raw)}")
        return None
    for key in sorted(set(raw) - {"params", "inputs", "nodes", "output"}):
        errors.add(f"{at}.{key}", "unknown field; known: params, inputs, nodes, output")
    params = _names(errors, f"{at}.params", raw.get("params"), default=[])
    inputs = _names(errors, f"{at}.inputs", raw.get("inputs"), default=["x"])
    if not inputs:
        errors.add(f"{at}.inputs", "a block needs at least one input")
    return Scope(at=at, params=params, inputs=inputs)


def declare_nodes(errors: Collector, scope: Scope, raw_nodes: Any, raw_output: Any,
                  blocks: Mapping[str, Scope]) -> None:
    """Fill `scope` with its nodes, checked; then its references and its order."""
    at_nodes = f"{scope.at}.nodes"
    if not isinstance(raw_nodes, Mapping) or not raw_nodes:
        errors.add(at_nodes, f"must be a non-empty mapping of named nodes, got {show(raw_nodes)}")
        return
    previous: tuple[str, ...] = scope.inputs
    for name, raw in raw_nodes.items():
        at = f"{at_nodes}.{name}"
        problem = name_problem(name)
        if problem:
            errors.add(at, problem)
            continue
        if name in scope.inputs:
            errors.add(at, f"{name!r} is also the name of an input of this block")
            continue
        decl = _declare(errors, scope, at, name, raw, previous, blocks)
        if decl is not None:
            scope.decls[name] = decl
        previous = (name,)
    last = next(reversed(raw_nodes)) if raw_nodes else ""
    output = last if raw_output is None else raw_output
    if not isinstance(output, str) or output not in raw_nodes:
        errors.add(f"{scope.at}.output", f"must name one of the nodes, got {show(output)}")
    elif output in scope.decls:
        scope.output = output
    _check_references(errors, scope, raw_nodes)


def _declare(errors: Collector, scope: Scope, at: str, name: str, raw: Any, previous: tuple[str, ...],
             blocks: Mapping[str, Scope]) -> Decl | None:
    if not isinstance(raw, Mapping):
        errors.add(at, f"a node must be a mapping with a type (or a block) and its parameters, got {show(raw)}")
        return None
    inputs = _inputs(errors, f"{at}.inputs", raw.get("inputs"), previous)
    kind, block = raw.get("type"), raw.get("block")
    if (kind is None) == (block is None):
        errors.add(at, "a node needs exactly one of 'type' (a layer or merge) and 'block' (a block's name)")
        return None
    if block is not None:
        return _instance(errors, scope, at, name, raw, block, inputs, blocks)
    if not isinstance(kind, str) or (kind not in LAYERS and kind not in MERGES):
        errors.add(f"{at}.type", f"unknown node type {show(kind)}; allowed: {', '.join(sorted(LAYERS))}, "
                                 f"{', '.join(sorted(MERGES))} (or 'block: <name>')")
        return None
    if kind in MERGES:
        for key in sorted(set(raw) - NODE_KEYS):
            errors.add(f"{at}.{key}", f"unknown parameter for {kind}; it has none")
        if inputs and len(inputs) < 2:
            errors.add(f"{at}.inputs", f"{kind} merges two or more inputs, got {len(inputs)}")
        return Decl(name, at, type=kind, inputs=inputs)
    if inputs and len(inputs) != 1:
        errors.add(f"{at}.inputs", f"{kind} takes one input, got {len(inputs)}")
    if LAYERS[kind].first_only and (scope.params or inputs != (INPUT,)):
        errors.add(f"{at}.type", f"{kind} describes the model's input: it must read 'input' directly, in model.nodes")
    later = {}
    for key, value in raw.items():
        wanted = placeholder(value)
        if wanted and key not in NODE_KEYS:
            _placeholder_ok(errors, scope, f"{at}.{key}", wanted)  # a bad one is named here, and not again below
            later[key] = wanted
    fixed = {k: v for k, v in raw.items() if k not in later}
    params = layer_params(errors, at, kind, fixed, skip=NODE_KEYS, later=frozenset(later))
    return Decl(name, at, type=kind, fixed=params, later=later, inputs=inputs)


def _instance(errors: Collector, scope: Scope, at: str, name: str, raw: Mapping[str, Any], block: Any,
              inputs: tuple[str, ...], blocks: Mapping[str, Scope]) -> Decl | None:
    if not isinstance(block, str) or block not in blocks:
        errors.add(f"{at}.block", f"unknown block {show(block)}; declared: {', '.join(sorted(blocks)) or 'none'}")
        return None
    target = blocks[block]
    args = {k: v for k, v in raw.items() if k not in INSTANCE_KEYS}
    for key in sorted(set(args) - set(target.params)):
        errors.add(f"{at}.{key}", f"block {block} has no parameter {key!r}; its params: "
                                  f"{', '.join(target.params) or 'none'}")
    for key in target.params:
        if key not in args:
            errors.add(f"{at}.{key}", f"is required by block {block}")
        elif placeholder(args[key]):
            _placeholder_ok(errors, scope, f"{at}.{key}", placeholder(args[key]))
    if inputs and len(inputs) != len(target.inputs):
        errors.add(f"{at}.inputs", f"block {block} takes {len(target.inputs)} input(s) "
                                   f"({', '.join(target.inputs)}), got {len(inputs)}")
    return Decl(name, at, block=block, fixed=args, inputs=inputs)


def _placeholder_ok(errors: Collector, scope: Scope, at: str, wanted: str) -> bool:
    if wanted not in scope.params:
        where = f"a parameter of this block (its params: {', '.join(scope.params) or 'none'})" if scope.params \
            else "a block parameter, and model.nodes is not inside a block"
        errors.add(at, f"'${wanted}' must name {where}")
        return False
    return True


def _inputs(errors: Collector, at: str, raw: Any, previous: tuple[str, ...]) -> tuple[str, ...]:
    if raw is None:
        return previous
    if not isinstance(raw, list) or not raw or not all(isinstance(x, str) for x in raw):
        errors.add(at, f"must be a non-empty list of node names, got {show(raw)}")
        return ()
    return tuple(raw)


def _check_references(errors: Collector, scope: Scope, raw_nodes: Mapping[str, Any]) -> None:
    """Dangling inputs; then cycles, nodes that do not reach the output and inputs nothing reads."""
    known = set(scope.inputs) | set(raw_nodes)
    for decl in scope.decls.values():
        for i, ref in enumerate(decl.inputs):
            if ref not in known:
                names = sorted(known)
                listed = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
                errors.add(f"{decl.at}.inputs[{i}]", f"unknown node {show(ref)}; known here: {listed}")
    if _cycles(errors, scope):
        return
    # a node that failed to parse would make the nodes only it reads look unused: name those only when all parsed
    _order(errors, scope, complete=len(scope.decls) == len(raw_nodes))


def _cycles(errors: Collector, scope: Scope) -> bool:
    """Report each cycle once, as a path of names (Kahn's algorithm leaves exactly the nodes on or after one)."""
    decls = scope.decls
    pending = {name: sum(1 for r in d.inputs if r in decls) for name, d in decls.items()}
    readers: dict[str, list[str]] = {name: [] for name in decls}
    for name, d in decls.items():
        for r in d.inputs:
            if r in decls:
                readers[r].append(name)
    ready = [name for name, n in pending.items() if n == 0]
    while ready:
        for reader in readers[ready.pop()]:
            pending[reader] -= 1
            if pending[reader] == 0:
                ready.append(reader)
    left = {name for name, n in pending.items() if n > 0}
    reported: set[str] = set()
    for start in decls:
        if start not in left or start in reported:
            continue
        walk: list[str] = []
        seen: dict[str, int] = {}
        node = start
        while node not in seen:  # every node left has an input left: walking inputs must close a loop
            seen[node] = len(walk)
            walk.append(node)
            node = next(r for r in decls[node].inputs if r in left)
        loop = walk[seen[node]:]
        if not reported.intersection(loop):
            first = decls[loop[0]]
            index = first.inputs.index(loop[1] if len(loop) > 1 else loop[0])
            errors.add(f"{first.at}.inputs[{index}]", "cycle: " + " → ".join([*loop, loop[0]]) + " (a graph must not "
                                                      "feed a node's output back into it)")
        reported.update(walk)
    return bool(left)


def _order(errors: Collector, scope: Scope, *, complete: bool) -> None:
    """Post-order from the output, inputs in their written order: the scope's topological order, the same
    whichever order its mapping lists the nodes in."""
    if not scope.output:
        return
    done: set[str] = set()
    stack: list[tuple[str, int]] = [(scope.output, 0)]
    while stack:
        name, i = stack.pop()
        decl = scope.decls[name]
        while i < len(decl.inputs) and (decl.inputs[i] in done or decl.inputs[i] not in scope.decls):
            i += 1
        if i < len(decl.inputs):
            stack.extend([(name, i + 1), (decl.inputs[i], 0)])
        elif name not in done:
            done.add(name)
            scope.order.append(decl)
    if not complete:
        return
    for name, decl in scope.decls.items():
        if name not in done:
            errors.add(decl.at, f"does not reach the output {scope.output!r}: every node must feed the output")
    read = {r for d in scope.order for r in d.inputs}
    for i, name in enumerate(scope.inputs):
        if name not in read:
            where = f"{scope.at}.inputs[{i}]" if scope.params or name != INPUT else f"{scope.at}.nodes"
            errors.add(where, f"input {name!r} is read by no node that reaches the output")
