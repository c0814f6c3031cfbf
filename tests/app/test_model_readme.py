"""A downloaded model's README says exactly what input the model takes: the scalings it states are the loaders'
own (checked against fedbroker.datasets), and a model that standardises itself says where its statistics are."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from fedbroker.app.jobs import README_FILE, write_model
from fedbroker.app.model_readme import LOADER_SCALING, OWN_FILES, input_section
from fedbroker.datasets import DATASETS, load_dataset
from fedbroker.proto import fedbroker_pb2 as pb

PLAIN = {"input_shape": [1, 8, 8], "layers": [{"type": "Flatten"}, {"type": "Linear", "in_features": 64,
                                                                      "out_features": 10}]}


def idx_bytes(array: np.ndarray) -> bytes:
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def test_the_scaling_table_names_every_bundled_set() -> None:
    assert set(LOADER_SCALING) == set(DATASETS)


@pytest.mark.parametrize("name", ["breast_cancer", "wine", "iris"])
def test_the_tabular_sets_are_z_scored_over_the_whole_set_as_stated(name: str) -> None:
    ds = load_dataset(name)
    assert f"each of the {ds.x.shape[1]} features z-scored" in LOADER_SCALING[name]
    np.testing.assert_allclose(ds.x.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(ds.x.std(axis=0), 1.0, atol=1e-4)


def test_digits_are_pixel_values_over_16_as_stated() -> None:
    from sklearn.datasets import load_digits

    ds = load_dataset("digits")
    assert "divided by 16" in LOADER_SCALING["digits"] and "[1, 8, 8]" in LOADER_SCALING["digits"]
    assert ds.x.shape[1:] == (1, 8, 8)
    np.testing.assert_array_equal(ds.x.reshape(len(ds.x), -1), load_digits().data.astype(np.float32) / 16.0)


@pytest.mark.parametrize("name", ["mnist", "fashion_mnist"])
def test_the_idx_sets_are_bytes_over_255_as_stated(tmp_path: Path, name: str) -> None:
    rng = np.random.default_rng(0)
    for images, labels in (("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                           ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")):
        (tmp_path / images).write_bytes(idx_bytes(rng.integers(0, 256, size=(3, 28, 28), dtype=np.uint8)))
        (tmp_path / labels).write_bytes(idx_bytes(np.array([0, 1, 9], np.uint8)))
    ds = load_dataset(name, idx_dir=str(tmp_path))
    raw = np.frombuffer((tmp_path / "train-images-idx3-ubyte").read_bytes()[16:], np.uint8).reshape(3, 28, 28)
    np.testing.assert_array_equal(ds.x[:3, 0], raw.astype(np.float32) / np.float32(255.0))
    assert "divided by 255" in LOADER_SCALING[name] and "[1, 28, 28]" in LOADER_SCALING[name]
    assert "divided by 255" in OWN_FILES


def test_a_model_without_its_own_preprocessing_says_the_loaders_scaling(tmp_path: Path) -> None:
    job = {"name": "j", "evaluation": {"dataset": "digits"}, "data": {"standardize": "none"}}
    section = input_section(json.dumps(PLAIN), json.dumps(job))
    assert "exactly as the sites' loaders produced it" in section
    assert "this job's evaluation set `digits`: pixel values 0-16 divided by 16" in section
    assert "cannot be applied to raw rows reproducibly" in section  # a site's own `standardize: site`
    header = pb.ModelHeader(job_id="j-1", round=2, version=3, model_spec_json=json.dumps(PLAIN))
    write_model(tmp_path, header, {}, json.dumps(job))
    readme = (tmp_path / README_FILE).read_text()
    assert section in readme and len(re.findall(r"```python\n", readme)) == 1


def test_a_model_that_standardises_itself_says_raw_features_and_where_its_statistics_are() -> None:
    spec = {"input_shape": [2], "layers": [{"type": "standardize", "mean": [1.0, 2.0], "std": [0.5, 4.0]},
                                           {"type": "Linear", "in_features": 2, "out_features": 2}]}
    job = {"name": "j", "data": {"standardize": "federated", "bounds": [0, 10]}}
    section = input_section(json.dumps(spec), json.dumps(job))
    assert "raw features in the sites' own units" in section
    assert "layer 0 of `model_spec.json`, type `standardize`) computes (x - mean) / std" in section
    assert "clipped to the bounds [0, 10]" in section and "never standardised ones" in section


def test_the_readmes_snippet_applies_the_models_own_standardisation_to_raw_rows(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    import torch

    from fedbroker.job.spec import parse_model
    from fedbroker.model import build_model, initial_weights
    from tests.source_roots import PYTHONPATH

    mean, std = [1.0, -2.0, 30.0], [0.5, 4.0, 10.0]
    spec = parse_model({"input_shape": [3], "layers": [{"type": "standardize", "mean": mean, "std": std},
                                                       {"type": "Linear", "in_features": 3, "out_features": 2}]})
    tensors = initial_weights(spec, seed=3)
    header = pb.ModelHeader(job_id="j-1", round=1, version=2, model_spec_json=spec.to_json())
    write_model(tmp_path, header, tensors, json.dumps({"name": "j", "data": {"standardize": "federated",
                                                                            "bounds": [-100, 100]}}))
    raw = np.random.default_rng(1).normal(10.0, 20.0, size=(8, 3)).astype(np.float32)
    np.save(tmp_path / "raw.npy", raw)
    (snippet,) = re.findall(r"```python\n(.*?)```", (tmp_path / README_FILE).read_text(), flags=re.S)
    script = snippet + ("import numpy as np, torch\n"
                        "np.save('out.npy', model(torch.from_numpy(np.load('raw.npy'))).detach().numpy())\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert run.returncode == 0, run.stderr
    linear = build_model(parse_model({"input_shape": [3], "layers": [
        {"type": "Linear", "in_features": 3, "out_features": 2}]}))
    linear.load_state_dict({"0.weight": torch.from_numpy(tensors["1.weight"]), "0.bias": torch.from_numpy(tensors["1.bias"])})
    standardised = (raw - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    expected = linear(torch.from_numpy(standardised)).detach().numpy()
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=1e-5, atol=1e-5)


def test_a_graph_model_names_the_nodes_reading_its_input_and_an_embedding_says_it_takes_token_ids() -> None:
    graph = {"input_shape": [12], "nodes": {
        "embed": {"type": "Embedding", "num_embeddings": 300, "embedding_dim": 8},
        "flat": {"type": "Flatten"}, "head": {"type": "Linear", "in_features": 96, "out_features": 2}}}
    section = input_section(json.dumps(graph), "{}")
    assert "its first layer is `Embedding` (node `embed`)" in section
    assert "token ids" in section and "[0, 300)" in section
    assert "its first layer is `Flatten`)" in input_section(json.dumps(PLAIN), "{}")


@pytest.mark.parametrize(("task", "outputs", "expected"), [
    ({"type": "segmentation", "classes": 3}, 3, ["3 class scores (logits) per pixel", "shape [3, 8, 8]",
                                                 "`model(x).argmax(dim=1)` (shape [batch, 8, 8])"]),
    ({"type": "multilabel", "labels": 4}, 4, ["4 scores (logits), one per label", "sigmoid()"]),
    ({"type": "regression", "loss": "huber"}, 1, ["1 predicted value(s)", "Huber loss"]),
])
def test_each_task_says_how_to_read_the_models_outputs(task: dict[str, object], outputs: int,
                                                       expected: list[str]) -> None:
    from fedbroker.app.model_readme import output_section

    if task["type"] == "segmentation":
        spec = {"input_shape": [1, 8, 8], "nodes": {"conv": {"type": "Conv2d", "in_channels": 1, "out_channels": 3,
                                                             "kernel_size": 3, "padding": 1}}}
    else:
        spec = {"input_shape": [5], "layers": [{"type": "Linear", "in_features": 5, "out_features": outputs}]}
    section = output_section(json.dumps(spec), json.dumps({"task": task}))
    for phrase in expected:
        assert phrase in section, section
