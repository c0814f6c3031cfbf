"""What a downloaded model's README says about its input: exactly what to feed the model, read from its spec.

A model whose first layer is `standardize` (the job's `data.standardize: federated`) takes raw features in
the sites' units and standardises them itself; any other model takes its input exactly as the sites' loaders
produced it for training, which the README spells out per loader (`LOADER_SCALING`, held equal to
`fedbroker.datasets` by tests/app/test_model_readme.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from fedbroker.errors import ConfigError
from fedbroker.job.pipeline import FIELDS as PIPELINE_FIELDS
from fedbroker.job.pipeline import DataPipeline, parse_pipeline
from fedbroker.job.spec_data import STANDARDIZE_LAYER

# How each of fedbroker.datasets' loaders scales what it reads (the bundled sets' scaling is fixed per set).
LOADER_SCALING: dict[str, str] = {
    "digits": "pixel values 0-16 divided by 16 (to [0, 1]), shape [1, 8, 8]",
    "mnist": "pixel bytes 0-255 divided by 255 (to [0, 1]), shape [1, 28, 28]",
    "fashion_mnist": "pixel bytes 0-255 divided by 255 (to [0, 1]), shape [1, 28, 28]",
    "breast_cancer": "each of the 30 features z-scored with the whole bundled set's mean and std (ddof 0)",
    "wine": "each of the 13 features z-scored with the whole bundled set's mean and std (ddof 0)",
    "iris": "each of the 4 features z-scored with the whole bundled set's mean and std (ddof 0)",
}
OWN_FILES = ("a site's own CSV, Parquet or .npz file (`worker.dataset` csv/parquet/npz): the feature columns as the "
             "file holds them, as float32; own IDX files (`worker.idx_dir`): bytes divided by 255")


def input_section(model_spec_json: str, job_spec_json: str) -> str:
    """The README's section on the model's input (markdown), for this model spec and job."""
    spec: dict[str, Any] = json.loads(model_spec_json)
    job: dict[str, Any] = json.loads(job_spec_json or "{}")
    shape = list(spec.get("input_shape") or [])
    features = math.prod(shape) if shape else 0
    layers = spec.get("layers") or []
    evaluation = (job.get("evaluation") or {}).get("dataset") or ""
    if job_pipeline(job_spec_json).preprocess:
        return ("## What the model takes\n\n"
                f"One sample of shape {shape}, **a raw file as the job's data pipeline prepares it**: the steps and "
                "the code that applies them are in the next section. The model applies no preprocessing of its own "
                f"(its first layer is {_first_layers(spec)}).\n")
    if layers and layers[0].get("type") == STANDARDIZE_LAYER:
        bounds = (job.get("data") or {}).get("bounds")
        return (
            "## What the model takes\n\n"
            f"One sample of shape {shape} ({features} features once flattened) of **raw features in the sites' "
            "own units**, as their loaders read them (" + OWN_FILES + "; for a bundled set, its fixed scaling: "
            + _bundled(evaluation) + ").\n\n"
            f"The model standardises them itself: its first layer (layer 0 of `model_spec.json`, type "
            f"`{STANDARDIZE_LAYER}`) computes (x - mean) / std per flattened feature with the `mean` and `std` it "
            "holds, the statistics the sites agreed on before round 1 (`data.standardize: federated` in `job.json`"
            + (f"; computed on values clipped to the bounds {json.dumps(bounds)}" if bounds else "") + "). "
            "The snippet below builds the model from the spec, so it applies them: give it raw rows, never "
            "standardised ones.\n")
    return (
        "## What the model takes\n\n"
        f"One sample of shape {shape} ({features} features once flattened), **exactly as the sites' loaders "
        "produced it for training**: the model applies no preprocessing of its own (its first layer is "
        f"{_first_layers(spec)}).\n\n"
        f"- {OWN_FILES}. A site with `worker.data.standardize: site` z-scored its data with its own mean and std, "
        "which never left it: such a model cannot be applied to raw rows reproducibly (a job with "
        "`data.standardize: federated` carries its standardisation in the model).\n"
        f"- The bundled sets: {_bundled(evaluation)}.\n")


def _first_layers(spec: dict[str, Any]) -> str:
    """The layer(s) reading the model's input, by type (and node name in a graph); for an Embedding, what its
    input values are. A spec this release cannot read gives its first written layer's type, or '-'."""
    from fedbroker.job.spec import parse_model

    try:
        model = parse_model(spec)
    except ValueError:
        layers = spec.get("layers") or []
        return f"`{layers[0].get('type') if layers else '-'}`"
    first = [n for n in model.nodes if "input" in n.inputs]
    if not first:
        return "`-`"
    named = ", ".join(f"`{n.type}`" if model.layers else f"`{n.type}` (node `{n.name}`)" for n in first)
    tokens = [n for n in first if n.type == "Embedding"]
    if tokens:
        named += (f"; an Embedding reads **token ids**: whole numbers in [0, {tokens[0].params['num_embeddings']}), "
                  "as float32 (exact below 2^24) or as an integer tensor")
    return named


def _bundled(evaluation: str) -> str:
    if evaluation in LOADER_SCALING:
        return f"this job's evaluation set `{evaluation}`: {LOADER_SCALING[evaluation]}"
    return "; ".join(f"`{name}`: {how}" for name, how in LOADER_SCALING.items())


def _classification_outputs(outputs: list[int], task: Any) -> str:
    classes = outputs[-1] if outputs else 0
    return (f"The head is the model's output node: a vector of **{classes} class scores (logits)** per sample. "
            "The predicted class is the index of the largest score, `model(x).argmax(dim=1)`; class "
            "probabilities are `model(x).softmax(dim=1)` (single-label classification, trained with "
            "cross-entropy).\n")


def _multilabel_outputs(outputs: list[int], task: Any) -> str:
    labels = outputs[-1] if outputs else 0
    return (f"The head is the model's output node: **{labels} scores (logits), one per label**, per sample, each "
            "independent of the others. A label's probability is `model(x).sigmoid()`; a label is present where "
            "it is above your threshold (0.5 matches the training loss; multilabel, trained with binary "
            "cross-entropy with logits, averaged over the labels).\n")


def _regression_outputs(outputs: list[int], task: Any) -> str:
    loss = (task.get("loss") if isinstance(task, dict) else None) or "mse"
    return (f"The head is the model's output node: **{outputs[-1] if outputs else 0} predicted value(s)** per "
            "sample, `model(x)`, in the units of the sites' targets as their files held them (regression, "
            f"trained with {'Huber loss' if loss == 'huber' else 'squared error'}; no output scaling).\n")


def _segmentation_outputs(outputs: list[int], task: Any) -> str:
    classes, spatial = (outputs[0], outputs[1:]) if outputs else (0, [])
    return (f"The head is the model's output node: **{classes} class scores (logits) per pixel**, shape "
            f"{outputs} per sample ({classes} classes, class 0 the background, over the input's spatial size "
            f"{spatial}). The predicted mask is `model(x).argmax(dim=1)` (shape [batch, {', '.join(map(str, spatial))}]"
            "); per-pixel class probabilities are `model(x).softmax(dim=1)` (segmentation, trained with per-pixel "
            "cross-entropy plus soft Dice per image).\n")


# How to read a model's outputs, per task (a job's `task:` section; none: single-label classification). A task
# gets its README text by adding one function here: (output shape without the batch axis, the job's task
# section as the job wrote it) -> markdown.
OUTPUT_SECTIONS: dict[str, Callable[[list[int], Any], str]] = {
    "classification": _classification_outputs, "multilabel": _multilabel_outputs,
    "regression": _regression_outputs, "segmentation": _segmentation_outputs}


def output_section(model_spec_json: str, job_spec_json: str) -> str:
    """The README's section on the model's head and how to read its outputs (markdown)."""
    from fedbroker.job.spec import output_shapes, parse_model

    job: dict[str, Any] = json.loads(job_spec_json or "{}")
    task = job.get("task") or "classification"
    name = task if isinstance(task, str) else str((task or {}).get("type", "classification"))
    try:
        shapes = output_shapes(parse_model(json.loads(model_spec_json)))
        outputs = list(shapes[-1]) if shapes else []
    except ValueError:  # a spec this release cannot read: the section says only what the job says
        outputs = []
    describe = OUTPUT_SECTIONS.get(name)
    text = describe(outputs, task) if describe is not None else (
        f"The job's task is `{name}`; its output has shape {outputs} per sample.\n")
    return "## What the model outputs\n\n" + text


PREPARE_SNIPPET = '''\
import json

import numpy as np
import torch

from fedbroker.datasets.transforms import prepare
from fedbroker.job.pipeline import parse_pipeline

with open("{job}", encoding="utf-8") as fh:
    pipeline = parse_pipeline(json.load(fh)["data"])
# raw: one file as the sites' readers decode it, float32 (C, H, W) or (C, D, H, W) (docs/data.md); e.g.
raw = np.load("raw.npy", allow_pickle=False)
x = prepare(pipeline, raw)              # the model's input, shape {shape}
with torch.no_grad():
    scores = model(torch.from_numpy(x)[None])   # a batch of one
'''


def job_pipeline(job_spec_json: str) -> DataPipeline:
    """The data pipeline of a stored job (empty when it has none, or when this release cannot read it)."""
    try:
        data = json.loads(job_spec_json or "{}").get("data") or {}
        return parse_pipeline({k: v for k, v in data.items() if k in PIPELINE_FIELDS})
    except (ConfigError, ValueError, AttributeError):
        return DataPipeline()


def data_section(model_spec_json: str, job_spec_json: str, *, job_file: str) -> str:
    """The README's section on what a raw file goes through (markdown; "" for a job without a data pipeline): the
    pipeline's own sentences, and the few lines of Python that apply it (after the model is loaded)."""
    pipeline = job_pipeline(job_spec_json)
    if pipeline == DataPipeline():
        return ""
    shape = list(json.loads(model_spec_json).get("input_shape") or [])
    steps = "\n".join(f"{i}. {line}" if not line.startswith("- ") else f"   {line}"
                      for i, line in enumerate(pipeline.describe(), start=1))
    return ("## What a raw file goes through\n\n"
            f"Every site applied the job's data pipeline (`data` in `{job_file}`, digest "
            f"`{pipeline.digest()[:16]}`) to every raw file before the model saw it; apply the same steps:\n\n"
            f"{steps}\n\n"
            "Once the model is loaded (the snippet above), this prepares a raw file and scores it "
            "(`fedbroker.datasets.transforms.prepare` runs the steps above with MONAI, exactly as the sites did; "
            "the training-only augmentation is not applied):\n\n"
            f"```python\n{PREPARE_SNIPPET.format(job=job_file, shape=shape)}```\n")
