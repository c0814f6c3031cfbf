"""Job specs: declarative JSON/YAML validated once, at the edge, into frozen objects.

A model is a list of layers from an allow-list (never code). Validation infers every layer's output
shape from the input shape, so a Linear whose `in_features` does not match what the previous layer
produces is refused at submission, naming the field, rather than crashing a worker in round 1.
All problems are reported at once.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from fedbroker.errors import ConfigError, ConfigErrors

MAX_WIDTH = 65_536
MAX_LAYERS = 128
MAX_PARAMETERS = 200_000_000
MAX_SPEC_BYTES = 256 * 1024
MAX_ROUNDS = 100_000
MAX_DEPTH = 32
# A job's name becomes part of its id, which names a checkpoint folder and a metric label: no path tricks.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_PLAIN_SCALARS = (str, int, float, bool, type(None))

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 80
_short.maxlist = _short.maxdict = _short.maxtuple = 6
_short.maxlevel = 3


def _show(value: Any) -> str:
    """A bounded repr for error messages: a hostile value is never echoed back in full."""
    return _short.repr(value)

# layer type -> {parameter: (kind, required, default)}; kinds: "width", "kernel", "bool", "prob", "int0"
LAYER_PARAMS: dict[str, dict[str, tuple[str, bool, Any]]] = {
    "Linear": {"in_features": ("width", True, None), "out_features": ("width", True, None), "bias": ("bool", False, True)},
    "Conv2d": {
        "in_channels": ("width", True, None),
        "out_channels": ("width", True, None),
        "kernel_size": ("kernel", True, None),
        "stride": ("kernel", False, 1),
        "padding": ("int0", False, 0),
        "bias": ("bool", False, True),
    },
    "MaxPool2d": {"kernel_size": ("kernel", True, None), "stride": ("kernel", False, None)},
    "AvgPool2d": {"kernel_size": ("kernel", True, None), "stride": ("kernel", False, None)},
    "Flatten": {},
    "ReLU": {},
    "Tanh": {},
    "Sigmoid": {},
    "Dropout": {"p": ("prob", False, 0.5)},
    "GroupNorm": {"num_groups": ("width", True, None), "num_channels": ("width", True, None)},
}


@dataclass(frozen=True)
class LayerSpec:
    type: str
    params: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, **self.params}


@dataclass(frozen=True)
class ModelSpec:
    input_shape: tuple[int, ...]
    layers: tuple[LayerSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"input_shape": list(self.input_shape), "layers": [layer.to_dict() for layer in self.layers]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @property
    def num_outputs(self) -> int:
        return output_shapes(self)[-1][-1]


@dataclass(frozen=True)
class TrainingConfig:
    rounds: int = 5
    local_epochs: int = 1
    batch_size: int = 32
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    proximal_mu: float = 0.0


@dataclass(frozen=True)
class AggregationConfig:
    alignment: str = "none"
    alignment_params: Mapping[str, Any] = field(default_factory=dict)
    weighting: str = "fedavg"
    weighting_params: Mapping[str, Any] = field(default_factory=dict)
    selection: str = "all"
    selection_params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ScheduleConfig:
    clients_per_round: int = 0      # 0 = every registered worker of the category
    quorum: int = 0                 # uploads that close a round early; 0 = every selected worker
    min_clients: int = 1            # the fewest uploads a round may close with at its deadline
    min_workers: int = 1            # registered workers needed before round 1 starts
    round_timeout_s: float = 600.0
    wait_for_workers_s: float = 120.0


@dataclass(frozen=True)
class EvaluationConfig:
    dataset: str = ""               # "" = the coordinator holds no evaluation set
    test_fraction: float = 0.2
    split_seed: int = 0


@dataclass(frozen=True)
class JobSpec:
    name: str
    category: str
    model: ModelSpec
    training: TrainingConfig
    aggregation: AggregationConfig
    schedule: ScheduleConfig
    evaluation: EvaluationConfig
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["model"] = self.model.to_dict()
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


class _Collector:
    def __init__(self) -> None:
        self.errors: list[ConfigError] = []

    def add(self, field_name: str, problem: str) -> None:
        self.errors.append(ConfigError(field_name, problem))

    def raise_if_any(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigErrors(self.errors)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_param(errors: _Collector, where: str, kind: str, value: Any) -> Any:
    if kind == "width":
        if not _is_int(value) or not 1 <= value <= MAX_WIDTH:
            errors.add(where, f"must be an integer in [1, {MAX_WIDTH}], got {_show(value)}")
    elif kind == "kernel":
        if value is not None and (not _is_int(value) or not 1 <= value <= 64):
            errors.add(where, f"must be an integer in [1, 64], got {_show(value)}")
    elif kind == "int0":
        if not _is_int(value) or not 0 <= value <= 64:
            errors.add(where, f"must be an integer in [0, 64], got {_show(value)}")
    elif kind == "bool":
        if not isinstance(value, bool):
            errors.add(where, f"must be true or false, got {_show(value)}")
    elif kind == "prob":
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
            errors.add(where, f"must be a number in [0, 1), got {_show(value)}")
    return value


def _check_plain(raw: Any, where: str) -> None:
    """Refuse, before anything else reads it, a value that is not plain JSON data (text keys; no dates,
    bytes or sets from YAML), nests deeper than MAX_DEPTH, or would encode to more than MAX_SPEC_BYTES.
    The walk is iterative and stops at the size limit, so a YAML alias bomb (a few KiB of text that expand
    to billions of nodes) costs at most MAX_SPEC_BYTES steps."""
    size = 0
    stack: list[tuple[Any, str, int]] = [(raw, where, 0)]
    while stack:
        value, at, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(at, f"nests deeper than {MAX_DEPTH} levels")
        if isinstance(value, Mapping):
            size += 2
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ConfigError(f"{at}.{_show(key)}", f"keys must be text, got {type(key).__name__}")
                size += len(key) + 4
                stack.append((item, f"{at}.{key}", depth + 1))
        elif isinstance(value, (list, tuple)):
            size += 2
            stack.extend((item, f"{at}[{i}]", depth + 1) for i, item in enumerate(value))
            size += len(value)
        elif isinstance(value, str):
            size += len(value) + 2
        elif isinstance(value, _PLAIN_SCALARS):
            size += 8
        else:
            raise ConfigError(at, f"must be plain data (text, number, boolean, list, mapping), got "
                                  f"{type(value).__name__} {_show(value)}")
        if size > MAX_SPEC_BYTES:
            raise ConfigError(where, f"is larger than {MAX_SPEC_BYTES} bytes")


def parse_model(raw: Any, *, errors: _Collector | None = None, where: str = "model") -> ModelSpec:
    own = errors is None
    errors = errors or _Collector()
    errors_before = len(errors.errors)
    if not isinstance(raw, Mapping):
        errors.add(where, f"must be a mapping with input_shape and layers, got {type(raw).__name__}")
        errors.raise_if_any()
    if own:
        _check_plain(raw, where)
    unknown = sorted(set(raw) - {"input_shape", "layers"})
    for key in unknown:
        errors.add(f"{where}.{key}", "unknown field; known: input_shape, layers")
    shape = raw.get("input_shape")
    if not isinstance(shape, (list, tuple)) or not 1 <= len(shape) <= 3 or not all(
        _is_int(d) and 1 <= d <= MAX_WIDTH for d in shape
    ):
        errors.add(f"{where}.input_shape", f"must be a list of 1 to 3 integers in [1, {MAX_WIDTH}], got {_show(shape)}")
        shape = None
    layers_raw = raw.get("layers")
    layers: list[LayerSpec] = []
    if not isinstance(layers_raw, list) or not layers_raw:
        errors.add(f"{where}.layers", f"must be a non-empty list of layers, got {_show(layers_raw)}")
    elif len(layers_raw) > MAX_LAYERS:
        errors.add(f"{where}.layers", f"has {len(layers_raw)} layers, more than the limit of {MAX_LAYERS}")
    else:
        for i, layer in enumerate(layers_raw):
            at = f"{where}.layers[{i}]"
            if not isinstance(layer, Mapping) or not isinstance(layer.get("type"), str):
                errors.add(f"{at}.type", f"each layer must be a mapping with a string 'type', got {_show(layer)}")
                continue
            kind = layer["type"]
            if kind not in LAYER_PARAMS:
                errors.add(f"{at}.type", f"unknown layer type {_show(kind)}; allowed: {', '.join(sorted(LAYER_PARAMS))}")
                continue
            allowed = LAYER_PARAMS[kind]
            params: dict[str, Any] = {}
            for key in sorted(set(layer) - {"type"} - set(allowed)):
                errors.add(f"{at}.{key}", f"unknown parameter for {kind}; allowed: {', '.join(allowed) or 'none'}")
            for key, (pkind, required, default) in allowed.items():
                if key not in layer:
                    if required:
                        errors.add(f"{at}.{key}", f"is required for {kind}")
                        continue
                    params[key] = default
                else:
                    params[key] = _check_param(errors, f"{at}.{key}", pkind, layer[key])
            layers.append(LayerSpec(kind, params))
    if own:
        errors.raise_if_any()
    spec = ModelSpec(tuple(shape or ()), tuple(layers))
    if len(errors.errors) == errors_before:  # shapes are only meaningful once every layer parsed cleanly
        _check_shapes(spec, errors, where)
    if own:
        errors.raise_if_any()
    return spec


def output_shapes(spec: ModelSpec) -> list[tuple[int, ...]]:
    """The output shape (without the batch axis) after every layer; raises ConfigError on a mismatch."""
    errors = _Collector()
    shapes = _check_shapes(spec, errors, "model")
    errors.raise_if_any()
    return shapes


def _check_shapes(spec: ModelSpec, errors: _Collector, where: str) -> list[tuple[int, ...]]:
    shape = tuple(spec.input_shape)
    shapes: list[tuple[int, ...]] = []
    params_total = 0
    for i, layer in enumerate(spec.layers):
        at = f"{where}.layers[{i}]"
        p = layer.params
        t = layer.type
        if t == "Linear":
            if len(shape) != 1:
                errors.add(at, f"Linear needs a flat input but receives shape {list(shape)}; add a Flatten before it")
                return shapes
            if p["in_features"] != shape[0]:
                errors.add(f"{at}.in_features", f"is {p['in_features']} but the previous layer outputs {shape[0]}")
                return shapes
            params_total += p["in_features"] * p["out_features"] + (p["out_features"] if p["bias"] else 0)
            shape = (p["out_features"],)
        elif t == "Conv2d":
            if len(shape) != 3:
                errors.add(at, f"Conv2d needs a (channels, height, width) input but receives {list(shape)}")
                return shapes
            if p["in_channels"] != shape[0]:
                errors.add(f"{at}.in_channels", f"is {p['in_channels']} but the input has {shape[0]} channels")
                return shapes
            k, s, pad = p["kernel_size"], p["stride"], p["padding"]
            h, w = (shape[1] + 2 * pad - k) // s + 1, (shape[2] + 2 * pad - k) // s + 1
            if h < 1 or w < 1:
                errors.add(f"{at}.kernel_size", f"{k} is larger than the padded input {list(shape[1:])}")
                return shapes
            params_total += p["out_channels"] * p["in_channels"] * k * k + (p["out_channels"] if p["bias"] else 0)
            shape = (p["out_channels"], h, w)
        elif t in ("MaxPool2d", "AvgPool2d"):
            if len(shape) != 3:
                errors.add(at, f"{t} needs a (channels, height, width) input but receives {list(shape)}")
                return shapes
            k = p["kernel_size"]
            s = p["stride"] or k
            h, w = (shape[1] - k) // s + 1, (shape[2] - k) // s + 1
            if h < 1 or w < 1:
                errors.add(f"{at}.kernel_size", f"{k} is larger than the input {list(shape[1:])}")
                return shapes
            shape = (shape[0], h, w)
        elif t == "Flatten":
            shape = (math.prod(shape),)
        elif t == "GroupNorm":
            if p["num_channels"] != shape[0]:
                errors.add(f"{at}.num_channels", f"is {p['num_channels']} but the input has {shape[0]} channels")
                return shapes
            if p["num_channels"] % p["num_groups"]:
                errors.add(f"{at}.num_groups", f"{p['num_groups']} does not divide num_channels {p['num_channels']}")
                return shapes
            params_total += 2 * p["num_channels"]
        shapes.append(shape)
        if params_total > MAX_PARAMETERS:
            errors.add(where, f"has more than {MAX_PARAMETERS} parameters")
            return shapes
    if shapes and len(shapes[-1]) != 1:
        errors.add(f"{where}.layers", f"the last layer must output class scores (a flat vector), not {list(shapes[-1])}")
    return shapes


def parameter_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The tensors an nn.Sequential built from `spec` holds, by state_dict name, without importing torch."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i, layer in enumerate(spec.layers):
        p = layer.params
        if layer.type == "Linear":
            shapes[f"{i}.weight"] = (p["out_features"], p["in_features"])
            if p["bias"]:
                shapes[f"{i}.bias"] = (p["out_features"],)
        elif layer.type == "Conv2d":
            k = p["kernel_size"]
            shapes[f"{i}.weight"] = (p["out_channels"], p["in_channels"], k, k)
            if p["bias"]:
                shapes[f"{i}.bias"] = (p["out_channels"],)
        elif layer.type == "GroupNorm":
            shapes[f"{i}.weight"] = (p["num_channels"],)
            shapes[f"{i}.bias"] = (p["num_channels"],)
    return shapes


_SECTIONS = ("name", "category", "model", "training", "aggregation", "schedule", "evaluation", "seed")


def _section(errors: _Collector, raw: Mapping[str, Any], name: str, cls: type) -> Any:
    values = raw.get(name, {})
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        errors.add(name, f"must be a mapping, got {type(values).__name__}")
        return cls()
    defaults = cls()
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in defaults.__dataclass_fields__:  # not hasattr: "__doc__" is an attribute, not a field
            known = ", ".join(f for f in defaults.__dataclass_fields__)
            errors.add(f"{name}.{key}", f"unknown field; known: {known}")
            continue
        expected = type(getattr(defaults, key))
        if expected is float and _is_int(value):
            value = float(value)
        if expected in (dict,) or isinstance(getattr(defaults, key), Mapping):
            if not isinstance(value, Mapping):
                errors.add(f"{name}.{key}", f"must be a mapping, got {type(value).__name__}")
                continue
        elif (expected is int and not _is_int(value)) or (expected is not int and not isinstance(value, expected)):
            errors.add(f"{name}.{key}", f"must be {expected.__name__}, got {type(value).__name__} {_show(value)}")
            continue
        kwargs[key] = value
    return cls(**{**{k: getattr(defaults, k) for k in defaults.__dataclass_fields__}, **kwargs})


def _range(errors: _Collector, field_name: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi) or (isinstance(value, float) and not math.isfinite(value)):
        errors.add(field_name, f"must be in [{lo}, {hi}], got {_show(value)}")


def parse_job(raw: Any) -> JobSpec:
    """Validate a job given as a mapping (parsed YAML/JSON); raise ConfigError(s) naming each bad field."""
    errors = _Collector()
    if not isinstance(raw, Mapping):
        raise ConfigError("job", f"must be a mapping, got {type(raw).__name__}")
    _check_plain(raw, "job")
    for key in sorted(set(raw) - set(_SECTIONS)):
        errors.add(key, f"unknown field; known: {', '.join(_SECTIONS)}")
    for key in ("name", "category"):
        value = raw.get(key)
        if not isinstance(value, str) or not _NAME.match(value):
            errors.add(key, f"is required: a non-empty string of 1-128 letters, digits, '_', '.' or '-' starting "
                            f"with a letter or digit, got {_show(value)}")
    if "model" not in raw:
        errors.add("model", "is required")
        model = ModelSpec((), ())
    else:
        model = parse_model(raw["model"], errors=errors)
    training = _section(errors, raw, "training", TrainingConfig)
    aggregation = _section(errors, raw, "aggregation", AggregationConfig)
    schedule = _section(errors, raw, "schedule", ScheduleConfig)
    evaluation = _section(errors, raw, "evaluation", EvaluationConfig)
    seed = raw.get("seed", 0)
    if not _is_int(seed) or not 0 <= seed < 2**32:
        errors.add("seed", f"must be an integer in [0, 2^32), got {_show(seed)}")
        seed = 0

    _range(errors, "training.rounds", training.rounds, 1, MAX_ROUNDS)
    _range(errors, "training.local_epochs", training.local_epochs, 1, 1000)
    _range(errors, "training.batch_size", training.batch_size, 1, 65_536)
    _range(errors, "training.lr", training.lr, 1e-8, 10.0)
    _range(errors, "training.momentum", training.momentum, 0.0, 0.999)
    _range(errors, "training.proximal_mu", training.proximal_mu, 0.0, 100.0)
    if training.optimizer not in ("sgd", "adam"):
        errors.add("training.optimizer", f"must be 'sgd' or 'adam', got {_show(training.optimizer)}")
    _range(errors, "schedule.clients_per_round", schedule.clients_per_round, 0, 100_000)
    _range(errors, "schedule.quorum", schedule.quorum, 0, 100_000)
    _range(errors, "schedule.min_clients", schedule.min_clients, 1, 100_000)
    _range(errors, "schedule.min_workers", schedule.min_workers, 1, 100_000)
    _range(errors, "schedule.round_timeout_s", schedule.round_timeout_s, 0.1, 7 * 86400)
    _range(errors, "schedule.wait_for_workers_s", schedule.wait_for_workers_s, 0.0, 7 * 86400)
    if schedule.clients_per_round and schedule.min_clients > schedule.clients_per_round:
        errors.add("schedule.min_clients", f"{schedule.min_clients} exceeds clients_per_round {schedule.clients_per_round}")
    _range(errors, "evaluation.test_fraction", evaluation.test_fraction, 0.01, 0.9)
    _check_algorithms(errors, aggregation, model)
    errors.raise_if_any()
    return JobSpec(
        name=raw["name"], category=raw["category"], model=model, training=training,
        aggregation=aggregation, schedule=schedule, evaluation=evaluation, seed=seed,
    )


def _check_algorithms(errors: _Collector, aggregation: AggregationConfig, model: ModelSpec) -> None:
    """Build each named algorithm once, so an unknown name or bad parameter fails at submission."""
    from fedbroker.aggregators.network import alignment_problems
    from fedbroker.aggregators.registries import build_algorithms

    try:
        build_algorithms(aggregation)
    except ConfigErrors as exc:
        errors.errors.extend(exc.errors)
    except ConfigError as exc:
        errors.errors.append(exc)
    if aggregation.alignment != "none" and model.layers:
        for problem in alignment_problems(model):
            errors.add("aggregation.alignment", f"{aggregation.alignment} cannot align this model: {problem}")


def job_from_text(text: str) -> JobSpec:
    """Parse YAML or JSON text (YAML's safe loader: no object construction) into a JobSpec."""
    import yaml

    if len(text) > MAX_SPEC_BYTES:
        raise ConfigError("job", f"is larger than {MAX_SPEC_BYTES} bytes")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError("job", f"is not valid YAML/JSON: {_short.repr(str(exc))[:300]}") from None
    except ValueError as exc:  # a YAML timestamp that is no date (2024-02-30)
        raise ConfigError("job", f"is not valid YAML/JSON: {exc}") from None
    except RecursionError:
        raise ConfigError("job", f"nests deeper than {MAX_DEPTH} levels") from None
    return parse_job(raw)


def job_from_json(text: str) -> JobSpec:
    return parse_job(json.loads(text))
