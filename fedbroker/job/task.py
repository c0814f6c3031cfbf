"""A job's `task:` section: what the model predicts, so what its output must be, which loss trains it and
which scores federated evaluation reports (docs/models.md, "Tasks and losses").

- `classification` (the default, so a job without the section is unchanged): one class per sample, softmax
  cross-entropy over an output of k scores; optional `class_weights` (k numbers) and `label_smoothing`.
- `multilabel`: `labels` independent yes/no findings per sample, binary cross-entropy with logits per label;
  the output is `labels` scores.
- `regression`: one or k real targets per sample, `loss` mse or huber (`huber_delta`); the output is (k,).
- `segmentation`: one class per pixel (voxel), `classes` scores per pixel, per-pixel cross-entropy plus
  `dice_weight` × soft Dice; the output is (classes, *the input's spatial size*).

No torch here: the kernel checks a task at submission; the losses are `fedbroker.tasks.losses`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.model_spec import MAX_WIDTH, ModelSpec, is_int, output_shapes, show

TASK_TYPES = ("classification", "multilabel", "regression", "segmentation")
REGRESSION_LOSSES = ("mse", "huber")
# The fields each task type takes (besides `type`); any other is refused, naming it.
_FIELDS: Mapping[str, tuple[str, ...]] = {
    "classification": ("class_weights", "label_smoothing"),
    "multilabel": ("labels",),
    "regression": ("loss", "huber_delta"),
    "segmentation": ("classes", "dice_weight"),
}
MAX_CLASS_WEIGHT = 1e4   # a class weight scales a sample's gradient before clipping: bounded, positive


@dataclass(frozen=True)
class TaskConfig:
    """The task, checked (`task_problems`); the fields of the other types keep their defaults."""

    type: str = "classification"
    class_weights: tuple[float, ...] = ()
    label_smoothing: float = 0.0
    labels: int = 0
    loss: str = "mse"
    huber_delta: float = 1.0
    classes: int = 0
    dice_weight: float = 1.0

    def __post_init__(self) -> None:
        problems = task_problems(self)
        if problems:
            raise problems[0] if len(problems) == 1 else ConfigErrors(problems)

    def to_dict(self) -> dict[str, Any]:
        """The section as a job writes it: the type and its own fields only."""
        out: dict[str, Any] = {"type": self.type}
        for name in _FIELDS[self.type]:
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @property
    def metric(self) -> str:
        """The headline score's name, as tables and plots show it (higher is better except for `mae`)."""
        return {"classification": "accuracy", "multilabel": "macro_f1", "regression": "mae",
                "segmentation": "dice"}[self.type]

    @property
    def higher_is_better(self) -> bool:
        """Whether a larger headline score is a better model (MAE: lower is better)."""
        return self.type != "regression"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def task_problems(task: TaskConfig) -> list[ConfigError]:
    """Every problem of the section on its own, each naming its field (`task.<field>`)."""
    if task.type not in TASK_TYPES:
        return [ConfigError("task.type", f"must be {' or '.join(repr(t) for t in TASK_TYPES)}, got {show(task.type)}")]
    out: list[ConfigError] = []

    def bad(name: str, problem: str) -> None:
        out.append(ConfigError(f"task.{name}", problem))

    if task.type == "classification":
        weights = task.class_weights
        if not isinstance(weights, tuple) or len(weights) > MAX_WIDTH:
            bad("class_weights", f"must be a list of at most {MAX_WIDTH} numbers, got {show(weights)}")
        else:
            for i, w in enumerate(weights):
                if not (_number(w) and 0 < w <= MAX_CLASS_WEIGHT):
                    bad(f"class_weights[{i}]", f"must be a number in (0, {MAX_CLASS_WEIGHT:g}], got {show(w)}")
        if not (_number(task.label_smoothing) and 0.0 <= task.label_smoothing < 1.0):
            bad("label_smoothing", f"must be a number in [0, 1), got {show(task.label_smoothing)}")
    elif task.type == "multilabel":
        if not (is_int(task.labels) and 1 <= task.labels <= MAX_WIDTH):
            bad("labels", f"is required for multilabel: an integer in [1, {MAX_WIDTH}], got {show(task.labels)}")
    elif task.type == "regression":
        if task.loss not in REGRESSION_LOSSES:
            bad("loss", f"must be 'mse' or 'huber', got {show(task.loss)}")
        if not (_number(task.huber_delta) and 0 < task.huber_delta <= 1e6):
            bad("huber_delta", f"must be a number in (0, 1e6], got {show(task.huber_delta)}")
    else:
        if not (is_int(task.classes) and 2 <= task.classes <= 1024):
            bad("classes", f"is required for segmentation: an integer in [2, 1024] (background included), "
                           f"got {show(task.classes)}")
        if not (_number(task.dice_weight) and 0.0 <= task.dice_weight <= 100.0):
            bad("dice_weight", f"must be a number in [0, 100], got {show(task.dice_weight)}")
    return out


def parse_task(raw: Any, errors: list[ConfigError]) -> TaskConfig:
    """The `task` section (absent or null: classification; a bare type name: that type with its defaults);
    every problem goes to `errors` and the default comes back."""
    if raw is None:
        return TaskConfig()
    if isinstance(raw, str):
        raw = {"type": raw}
    if not isinstance(raw, Mapping):
        errors.append(ConfigError("task", f"must be a task type or a mapping with `type`, got {type(raw).__name__}"))
        return TaskConfig()
    kind = raw.get("type", "classification")
    if kind not in TASK_TYPES:
        errors.append(ConfigError("task.type", f"must be {' or '.join(repr(t) for t in TASK_TYPES)}, got {show(kind)}"))
        return TaskConfig()
    problems = [ConfigError(f"task.{key}", f"unknown field for {kind}; known: type, {', '.join(_FIELDS[kind])}")
                for key in sorted(set(raw) - {"type", *_FIELDS[kind]})]
    values = {key: raw[key] for key in _FIELDS[kind] if key in raw}
    if "class_weights" in values:
        weights = values["class_weights"]
        values["class_weights"] = (tuple(weights) if isinstance(weights, Sequence) and not isinstance(weights, str)
                                   else weights)
    for key in ("label_smoothing", "huber_delta", "dice_weight"):
        if key in values and is_int(values[key]):
            values[key] = float(values[key])
    candidate = object.__new__(TaskConfig)
    for name, default in TaskConfig().__dict__.items():
        object.__setattr__(candidate, name, values.get(name, default))
    object.__setattr__(candidate, "type", kind)
    problems.extend(task_problems(candidate))
    errors.extend(problems)
    return TaskConfig() if problems else TaskConfig(**{**values, "type": kind})


def stored_task(spec_json: str) -> TaskConfig:
    """The task section alone of a job as its record stores it (the job's JSON): a site's evaluation report needs
    the task to be checked, not a second parse of the whole job per report."""
    try:
        raw = json.loads(spec_json)
    except ValueError as exc:
        raise ConfigError("task", f"the stored job is not JSON: {exc}") from None
    errors: list[ConfigError] = []
    task = parse_task(raw.get("task") if isinstance(raw, dict) else None, errors)
    if errors:
        raise errors[0]
    return task


def expected_output(task: TaskConfig, output: tuple[int, ...], input_shape: tuple[int, ...]) -> str:
    """Why a model whose output (without the batch axis) is `output` cannot serve `task` ("" when it can)."""
    got = list(output)
    if task.type == "classification":
        if len(output) != 1:
            return f"classification needs class scores, a flat vector, not {got}"
        if task.class_weights and len(task.class_weights) != output[0]:
            return (f"task.class_weights has {len(task.class_weights)} weights but the model outputs "
                    f"{output[0]} class scores")
    elif task.type == "multilabel":
        if tuple(output) != (task.labels,):
            return f"multilabel with task.labels {task.labels} needs an output of [{task.labels}], not {got}"
    elif task.type == "regression":
        if len(output) != 1:
            return f"regression needs a flat output of k targets ([1] for one), not {got}"
    else:
        want = (task.classes, *input_shape[1:])
        if len(input_shape) < 2:
            return f"segmentation needs an image input (channels and a spatial size), not {list(input_shape)}"
        if tuple(output) != want:
            return (f"segmentation with task.classes {task.classes} needs one score per class and pixel, "
                    f"{list(want)} (the input's spatial size {list(input_shape[1:])}), not {got}")
    return ""


def output_problems(task: TaskConfig, model: ModelSpec) -> list[ConfigError]:
    """The task's rule on the model's output at submission, naming the model's last layer (or output node)."""
    try:
        shapes = output_shapes(model)
    except ConfigError:  # the model's own problems are reported where it is parsed
        return []
    if not shapes:
        return []
    problem = expected_output(task, shapes[-1], tuple(model.input_shape))
    if not problem:
        return []
    where = f"model.layers[{len(model.layers) - 1}]" if model.layers else "model.output"
    return [ConfigError(where, f"the model outputs {list(shapes[-1])}: {problem} (task.type {task.type})")]
