"""Benchmark 10: validating a model graph at submission, and refusing hostile ones.

What the coordinator does with a job's model: the text read by the bounded YAML loader
(`fedbroker.job.yamltext`), then `parse_model` (blocks declared, sized and expanded, names and references,
cycles, shapes, bounds: `fedbroker.graph`). Timed on a 10^5-node model (the node limit, written with nested
blocks) and on each hostile graph of issue 32 (a cycle, a dangling input, an unused node, 10^6 nodes, a block
instantiation bomb, a block recursion, blocks nested too deep, a shape that explodes). Each hostile row
records the first problem named, so a row that was refused for another reason than the one it tests shows it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from bench.harness import Goal, Section, Stat, repeat

GOAL_SECONDS = 1.0


def _nested(levels: list[int], leaf: dict[str, Any], *, width: int = 16) -> dict[str, Any]:
    """A model whose top holds levels[-1] instances of a block of levels[-2] instances ... of `leaf`."""
    blocks: dict[str, Any] = {"leaf": leaf}
    below = "leaf"
    for k, fan in enumerate(levels[:-1]):
        blocks[f"l{k}"] = {"params": ["w"], "nodes": {f"i{i}": {"block": below, "w": "$w"} for i in range(fan)}}
        below = f"l{k}"
    return {"input_shape": [width], "blocks": blocks,
            "nodes": {f"s{i}": {"block": below, "w": width} for i in range(levels[-1])}}


RESIDUAL = {"params": ["w"], "nodes": {
    "lin": {"type": "Linear", "in_features": "$w", "out_features": "$w", "inputs": ["x"]},
    "act": {"type": "ReLU"},
    "lin2": {"type": "Linear", "in_features": "$w", "out_features": "$w"},
    "sum": {"type": "add", "inputs": ["lin2", "x"]}}}
RELU = {"params": ["w"], "nodes": {"r": {"type": "ReLU"}}}


def _flat(n: int) -> dict[str, Any]:
    nodes: dict[str, Any] = {"n0": {"type": "Linear", "in_features": 8, "out_features": 8}}
    nodes.update({f"n{i}": {"type": "ReLU"} for i in range(1, n)})
    return {"input_shape": [8], "nodes": nodes}


def hostile() -> dict[str, dict[str, Any]]:
    """Each hostile graph, as a data scientist (or a server relaying one) could send it."""
    cycle = _flat(4000)
    cycle["nodes"]["n0"]["inputs"] = ["n3999"]
    dangling = _flat(4000)
    dangling["nodes"]["n3999"]["inputs"] = ["nowhere"]
    unused = _flat(4000)
    unused["nodes"]["spare"] = {"type": "ReLU", "inputs": ["n10"]}
    unused["output"] = "n3999"
    recursion = _nested([10, 10], RELU, width=8)
    recursion["blocks"]["leaf"] = {"params": ["w"], "nodes": {"again": {"block": "l0", "w": "$w"}}}
    deep = _nested([1] * 40, RELU, width=8)
    explode: dict[str, Any] = {"input_shape": [1, 64, 64], "nodes": {
        "c0": {"type": "Conv2d", "in_channels": 1, "out_channels": 64, "kernel_size": 1}}}
    explode["nodes"].update({f"c{i}": {"type": "concat", "inputs": [f"c{i - 1}", f"c{i - 1}"]} for i in range(1, 3000)})
    return {
        "cycle (4,000 nodes)": cycle,
        "dangling input (4,000 nodes)": dangling,
        "unused node (4,000 nodes)": unused,
        "10^6 nodes (blocks)": _nested([10, 10, 10, 10, 10, 10], RELU),
        "instantiation bomb (10^16 nodes)": _nested([100] * 8, RELU),
        "block recursion": recursion,
        "blocks nested 40 deep": deep,
        "shape that explodes (concat ×2, 3,000 nodes)": explode,
    }


def _validate(raw: Any) -> Callable[[], str]:
    from fedbroker.errors import ConfigError
    from fedbroker.job.model_spec import parse_model

    def call() -> str:
        try:
            spec = parse_model(raw)
        except ConfigError as exc:
            return "refused: " + str(getattr(exc, "errors", [exc])[0])[:110]
        return f"accepted: {len(spec.nodes):,} nodes"

    return call


def _read(text: str) -> Callable[[], Any]:
    from fedbroker.job.model_spec import MAX_SPEC_BYTES
    from fedbroker.job.yamltext import load_yaml

    return lambda: load_yaml(text, where="model", max_bytes=4 * MAX_SPEC_BYTES)


def run(*, quick: bool) -> Section:
    started = time.perf_counter()
    section = Section(
        "graph_validation", "10. Model graph validation at submission",
        "Seconds to validate a model (`parse_model`: blocks sized before expansion, expanded, references, cycles, "
        "shapes and bounds) as the coordinator does at submission, and, apart, to read its text with the bounded "
        "YAML loader (pure-Python PyYAML: it grows with the text, not with the expanded graph). "
        "`accepted` is a 10^5-node model (the node limit, 25 × 10 × 10 × 10 instances of a 4-node residual block of "
        "Linear 16→16); the other rows are hostile graphs, each refused (the first problem named is shown).",
    )
    cases = {"10^5-node model (nested residual blocks)": _nested([10, 10, 10, 25], RESIDUAL), **hostile()}
    repeats = 1 if quick else 5  # quick (the test suite's smoke run): one timing each, no warm-up
    hostile_medians: list[float] = []
    accepted_median = float("nan")
    for name, raw in cases.items():
        text = json.dumps(raw)
        call = _validate(json.loads(text))
        verdict = call()
        stat = Stat.of(repeat(call, repeats=repeats, warmup=0 if quick else 1), "s")
        read = Stat.of(repeat(_read(text), repeats=1 if quick else 3, warmup=0), "s")
        section.rows.append({"model": name, "text (KiB)": round(len(text) / 1024, 1), "validate (s)": stat,
                             "read YAML (s)": read, "verdict": verdict})
        if name.startswith("10^5-node"):
            accepted_median = stat.median
            assert verdict.startswith("accepted: 100,000 nodes"), verdict
        else:
            assert verdict.startswith("refused"), (name, verdict)
            hostile_medians.append(stat.median)
    section.goals.append(Goal("10^5-node model validated (s)", round(accepted_median, 3), f"≤ {GOAL_SECONDS}",
                              accepted_median <= GOAL_SECONDS))
    worst = max(hostile_medians)
    section.goals.append(Goal("slowest hostile graph refused (s)", round(worst, 3), f"≤ {GOAL_SECONDS}",
                              worst <= GOAL_SECONDS, f"{len(hostile_medians)} hostile graphs"))
    section.seconds = time.perf_counter() - started
    return section
