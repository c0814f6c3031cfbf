"""A job's model plan: where its weights start and which of them train (`model.initial_weights`,
`model.from_job`, `model.freeze`, `model.adapters`), parsed and checked without torch.

A tensor belongs to the node its name starts with (`head.weight` to `head`, `b1.conv1.weight` to the block
instance `b1` and to its node `b1.conv1`; a chain's `0.weight` to node `0`). Freezing a node freezes every
tensor under it. With LoRA adapters every tensor trains that is an adapter's (`<target>.lora_a.weight`,
`<target>.lora_b.weight`) or under a node `adapters.train` names; everything else is frozen. What is frozen
is never uploaded, noised or aggregated: the global model keeps it as the start weights gave it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.model_spec import PLAN_FIELDS as PLAN_FIELDS
from fedbroker.job.model_spec import Collector, ModelSpec, is_int, parameter_shapes, show

ADAPTER_TYPES = ("lora",)
ADAPTABLE = ("Linear",)      # node types a LoRA adapter may target
MAX_RANK = 1024
MAX_NAMES = 4096
_SHA256 = re.compile(r"[0-9a-f]{64}")
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}")
_PATH = re.compile(r"[^\x00-\x1f]{1,4096}")


@dataclass(frozen=True)
class StartFile:
    """A safetensors file of starting weights and the SHA-256 of its bytes the job pins."""

    path: str
    sha256: str


@dataclass(frozen=True)
class Adapters:
    """LoRA: each target Linear's weight frozen, low-rank A (rank×in) and B (out×rank, zero at the start)
    trained; the target computes base(x) + (alpha/rank)·B(A(x)). `train` names the nodes (heads) that train
    in full beside the adapters."""

    type: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    train: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        """The factor alpha/rank on the adapters' output."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        """The adapters as a job writes them."""
        return {"type": self.type, "rank": self.rank, "alpha": self.alpha, "targets": list(self.targets),
                "train": list(self.train)}


@dataclass(frozen=True)
class ModelPlan:
    """Where a job's weights start (a pinned file, an earlier job, else the seeded random draw) and what trains."""

    initial_weights: StartFile | None = None
    from_job: str = ""
    freeze: tuple[str, ...] = ()
    adapters: Adapters | None = None

    @property
    def restricts_training(self) -> bool:
        """Whether some of the model's tensors do not train."""
        return bool(self.freeze) or self.adapters is not None

    def to_dict(self) -> dict[str, Any]:
        """The plan's fields as a job writes them in its model section (only those it sets)."""
        out: dict[str, Any] = {}
        if self.initial_weights is not None:
            out["initial_weights"] = {"path": self.initial_weights.path, "sha256": self.initial_weights.sha256}
        if self.from_job:
            out["from_job"] = self.from_job
        if self.freeze:
            out["freeze"] = list(self.freeze)
        if self.adapters is not None:
            out["adapters"] = self.adapters.to_dict()
        return out

    def to_json(self) -> str:
        """The plan's wire form (sorted keys; "{}" for a plan that changes nothing)."""
        return json.dumps(self.to_dict(), sort_keys=True)


def plan_from_json(text: str) -> ModelPlan:
    """A plan from its wire form ("" or "{}": the default plan); ConfigError(s) naming each bad field."""
    if not text:
        return ModelPlan()
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise ConfigError("model", f"the model plan is not JSON: {exc}") from None
    errors = Collector()
    plan = parse_plan(raw, errors=errors)
    errors.raise_if_any()
    return plan


def parse_plan(raw: Any, *, errors: Collector, where: str = "model") -> ModelPlan:
    """The plan fields of a model section (other fields are the model's own); problems go to `errors`."""
    if not isinstance(raw, Mapping):
        return ModelPlan()
    start = _start_file(raw.get("initial_weights"), errors, f"{where}.initial_weights")
    from_job = raw.get("from_job", "")
    if from_job is None:
        from_job = ""
    if not isinstance(from_job, str) or (from_job and not _JOB_ID.fullmatch(from_job)):
        errors.add(f"{where}.from_job", f"must be a job id (letters, digits, '_', '.', ':', '-'), got {show(from_job)}")
        from_job = ""
    if start is not None and from_job:
        errors.add(f"{where}.from_job", "a model starts from initial_weights or from_job, not both")
    freeze = _names(raw.get("freeze"), errors, f"{where}.freeze")
    adapters = _adapters(raw.get("adapters"), errors, f"{where}.adapters")
    return ModelPlan(initial_weights=start, from_job=from_job, freeze=freeze, adapters=adapters)


def _start_file(raw: Any, errors: Collector, where: str) -> StartFile | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        errors.add(where, f"must be a mapping with path and sha256, got {show(raw)}")
        return None
    for key in sorted(set(raw) - {"path", "sha256"}):
        errors.add(f"{where}.{key}", "unknown field; known: path, sha256")
    path, digest = raw.get("path"), raw.get("sha256")
    ok = True
    if not isinstance(path, str) or not _PATH.fullmatch(path) or not path.endswith(".safetensors"):
        errors.add(f"{where}.path", f"must be the path of a .safetensors file, got {show(path)}")
        ok = False
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        errors.add(f"{where}.sha256", f"must be the file's SHA-256 as 64 lower-case hex digits, got {show(digest)}")
        ok = False
    return StartFile(path, digest) if ok else None  # type: ignore[arg-type]


def _names(raw: Any, errors: Collector, where: str) -> tuple[str, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_NAMES:
        errors.add(where, f"must be a list of at most {MAX_NAMES} node names, got {show(raw)}")
        return ()
    out: list[str] = []
    for i, name in enumerate(raw):
        if not isinstance(name, str) or not name or len(name) > 256:
            errors.add(f"{where}[{i}]", f"must be a node name, got {show(name)}")
        elif name in out:
            errors.add(f"{where}[{i}]", f"names {name!r} twice")
        else:
            out.append(name)
    return tuple(out)


def _adapters(raw: Any, errors: Collector, where: str) -> Adapters | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        errors.add(where, f"must be a mapping (type, rank, alpha, targets, train), got {show(raw)}")
        return None
    before = len(errors.errors)
    for key in sorted(set(raw) - {"type", "rank", "alpha", "targets", "train"}):
        errors.add(f"{where}.{key}", "unknown field; known: type, rank, alpha, targets, train")
    kind, rank, alpha = raw.get("type", "lora"), raw.get("rank"), raw.get("alpha")
    rank_ok = is_int(rank) and 1 <= int(str(rank)) <= MAX_RANK
    if kind not in ADAPTER_TYPES:
        errors.add(f"{where}.type", f"must be one of {', '.join(ADAPTER_TYPES)}, got {show(kind)}")
    if not rank_ok:
        errors.add(f"{where}.rank", f"must be an integer in [1, {MAX_RANK}], got {show(rank)}")
    if alpha is None:
        alpha = rank if rank_ok else 1.0  # scale 1 unless asked
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1e4:
        errors.add(f"{where}.alpha", f"must be a number in (0, 10000], got {show(alpha)}")
    targets = _names(raw.get("targets"), errors, f"{where}.targets")
    if not targets and len(errors.errors) == before:
        errors.add(f"{where}.targets", "must name at least one Linear node")
    train = _names(raw.get("train"), errors, f"{where}.train")
    if len(errors.errors) != before:
        return None
    return Adapters(str(kind), int(str(rank)), float(str(alpha)), targets, train)


def _nodes(spec: ModelSpec) -> dict[str, tuple[str, Mapping[str, Any]]]:
    """Node name → (type, params): a graph's nodes (blocks expanded), or a chain's layers named "0", "1", ..."""
    nodes = getattr(spec, "nodes", ())
    if nodes:
        return {n.name: (n.type, n.params) for n in nodes}
    return {str(i): (layer.type, layer.params) for i, layer in enumerate(spec.layers)}


def _owns(node: str, tensor: str) -> bool:
    return tensor.startswith(node + ".")


def plan_problems(plan: ModelPlan, spec: ModelSpec, *, where: str = "model", alignment: str = "none",
                  secure: bool = False, mode: str = "sync", standardize: str = "none") -> list[ConfigError]:
    """What the plan asks of the model that the model does not have, each named: a frozen or trained node that
    is not one, an adapter on a node that is not a Linear, a node both frozen and trained; and what the plan
    cannot be combined with (an alignment matches every layer's units; a secure or asynchronous round, not yet)."""
    out: list[ConfigError] = []
    nodes = _nodes(spec)
    tensors = list(parameter_shapes(spec))

    def check_node(name: str, at: str, *, weighted: bool = True) -> bool:
        if name not in nodes and not any(n.startswith(name + ".") for n in nodes):
            out.append(ConfigError(at, f"{name!r} is not a node of the model; nodes: {show(sorted(nodes))}"))
            return False
        if weighted and not any(_owns(name, t) for t in tensors):
            out.append(ConfigError(at, f"node {name!r} has no weights to freeze or train"))
            return False
        return True

    for i, name in enumerate(plan.freeze):
        check_node(name, f"{where}.freeze[{i}]")
    adapters = plan.adapters
    if adapters is not None:
        for i, name in enumerate(adapters.targets):
            at = f"{where}.adapters.targets[{i}]"
            if check_node(name, at) and nodes.get(name, ("", {}))[0] not in ADAPTABLE:
                kind = nodes[name][0] if name in nodes else "a block"
                out.append(ConfigError(at, f"node {name!r} is {kind}; LoRA adapters target {', '.join(ADAPTABLE)} "
                                           f"nodes"))
        for i, name in enumerate(adapters.train):
            at = f"{where}.adapters.train[{i}]"
            if check_node(name, at):
                if name in plan.freeze:
                    out.append(ConfigError(at, f"node {name!r} is also in {where}.freeze"))
                if name in adapters.targets:
                    out.append(ConfigError(at, f"node {name!r} carries an adapter: its base weight stays frozen"))
    if standardize != "none":  # its layer in front of the model would rename a chain's nodes and tensors
        out.append(ConfigError("data.standardize", f"{standardize!r} puts a layer in front of the model; not with "
                                                   f"{where}.{next(iter(plan.to_dict()))}"))
    if plan.restricts_training:
        if out:
            return out
        if not trainable_names(spec, plan):
            out.append(ConfigError(f"{where}.freeze", "freezes every tensor of the model: nothing would train"))
        named = f"{where}.adapters" if adapters is not None else f"{where}.freeze"
        if alignment != "none":
            out.append(ConfigError("aggregation.alignment", f"{alignment!r} matches the units of every layer; it "
                                                            f"cannot be used with {named}"))
        if secure:
            out.append(ConfigError("aggregation.secure", f"a secure round masks the whole model; not yet with {named}"))
        if mode != "sync":
            out.append(ConfigError("schedule.mode", f"only sync rounds aggregate a trainable subset so far, not "
                                                    f"{mode!r} with {named}"))
    return out


def adapter_shapes(spec: ModelSpec, adapters: Adapters) -> dict[str, tuple[int, ...]]:
    """The adapters' tensors by wire name: `<target>.lora_a.weight` (rank × in), `<target>.lora_b.weight`
    (out × rank)."""
    base = parameter_shapes(spec)
    out: dict[str, tuple[int, ...]] = {}
    for target in adapters.targets:
        features_out, features_in = base[f"{target}.weight"]
        out[f"{target}.lora_a.weight"] = (adapters.rank, features_in)
        out[f"{target}.lora_b.weight"] = (features_out, adapters.rank)
    return out


def all_shapes(spec: ModelSpec, plan: ModelPlan) -> dict[str, tuple[int, ...]]:
    """Every tensor a global model of the job holds: the model's, then its adapters'."""
    shapes = parameter_shapes(spec)
    if plan.adapters is not None:
        shapes.update(adapter_shapes(spec, plan.adapters))
    return shapes


def trainable_names(spec: ModelSpec, plan: ModelPlan) -> list[str]:
    """The tensors that train, in `all_shapes` order: what a site uploads and the service aggregates."""
    names = list(all_shapes(spec, plan))
    adapters = plan.adapters
    if adapters is not None:
        adapter = set(adapter_shapes(spec, adapters))
        names = [n for n in names if n in adapter or any(_owns(node, n) for node in adapters.train)]
    return [n for n in names if not any(_owns(node, n) for node in plan.freeze)]


def trainable_shapes(spec: ModelSpec, plan: ModelPlan) -> dict[str, tuple[int, ...]]:
    """`trainable_names` with their shapes."""
    shapes = all_shapes(spec, plan)
    return {name: shapes[name] for name in trainable_names(spec, plan)}


def frozen_owner(name: str, spec: ModelSpec, plan: ModelPlan) -> str:
    """Why a tensor does not train, in words naming its node ("" when it trains or is no tensor of the job)."""
    if name not in all_shapes(spec, plan) or name in trainable_names(spec, plan):
        return ""
    for node in plan.freeze:
        if _owns(node, name):
            return f"node {node!r} is frozen (model.freeze)"
    return f"{name!r} is neither an adapter nor under a node model.adapters.train names"


def merge_adapters(state: Mapping[str, np.ndarray], adapters: Adapters) -> dict[str, np.ndarray]:
    """A plain model's weights from a model with adapters: each target's W + (alpha/rank)·B·A (computed in
    float64, kept as float32), the adapters' tensors dropped."""
    out = {name: np.asarray(value, dtype=np.float32) for name, value in state.items() if ".lora_" not in name}
    for target in adapters.targets:
        a = np.asarray(state[f"{target}.lora_a.weight"], dtype=np.float64)
        b = np.asarray(state[f"{target}.lora_b.weight"], dtype=np.float64)
        merged = np.asarray(state[f"{target}.weight"], dtype=np.float64) + adapters.scale * (b @ a)
        out[f"{target}.weight"] = merged.astype(np.float32)
    return out


def raise_all(problems: Sequence[ConfigError]) -> None:
    """Raise the problems as one ConfigError, several as ConfigErrors, or nothing."""
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise ConfigErrors(list(problems))
