"""Job and model specs: every bad spec is refused with an error naming the field."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.spec import job_from_text, output_shapes, parameter_shapes, parse_job, parse_model
from fedbroker.job.submission import accept_job, accept_job_text
from fedbroker.layers import LAYERS
from fedbroker.model import build_model
from tests.layer_examples import NEW_LAYER_EXAMPLES
from tests.library_examples import LIBRARY_EXAMPLES

GOOD = {
    "name": "digits-mlp",
    "category": "digits",
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 32}, {"type": "ReLU"},
        {"type": "Dropout", "p": 0.1}, {"type": "Linear", "in_features": 32, "out_features": 10}]},
    "training": {"rounds": 3, "local_epochs": 1, "batch_size": 16, "lr": 0.1},
    "aggregation": {"alignment": "none", "weighting": "fedavg", "selection": "all"},
}
CNN = {"input_shape": [1, 8, 8], "layers": [
    {"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": 3, "padding": 1},
    {"type": "GroupNorm", "num_groups": 2, "num_channels": 4}, {"type": "Tanh"},
    {"type": "MaxPool2d", "kernel_size": 2}, {"type": "Conv2d", "in_channels": 4, "out_channels": 6, "kernel_size": 3},
    {"type": "AvgPool2d", "kernel_size": 2}, {"type": "Flatten"},
    {"type": "Linear", "in_features": 6, "out_features": 10}]}


def test_good_job_parses_with_defaults():
    job = parse_job(GOOD)
    assert job.training.rounds == 3 and job.training.optimizer == "sgd"
    assert job.schedule.min_clients == 1 and job.model.num_outputs == 10
    assert parse_job(json.loads(job.to_json())) == job


def test_yaml_text_is_accepted_and_safe_loaded():
    text = "name: j\ncategory: digits\nmodel:\n  input_shape: [4]\n  layers:\n  - {type: Linear, in_features: 4, out_features: 3}\n"
    assert job_from_text(text).model.num_outputs == 3
    with pytest.raises(ConfigError, match="job"):
        job_from_text("!!python/object/apply:os.system ['true']")


def test_cnn_shapes_are_inferred_and_match_torch():
    spec = parse_model(CNN)
    assert output_shapes(spec)[-1] == (10,)
    model = build_model(spec, seed=0)
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == parameter_shapes(spec)


def _mutate(path, value):
    job = copy.deepcopy(GOOD)
    target = job
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return job


BAD = [
    (("model", "layers", 1, "type"), "Transformer", "model.layers[1].type", "unknown layer type"),
    (("model", "layers", 1, "out_features"), -3, "model.layers[1].out_features", "[1, 65536]"),
    (("model", "layers", 1, "out_features"), 10**9, "model.layers[1].out_features", "[1, 65536]"),
    (("model", "layers", 1, "out_features"), "32", "model.layers[1].out_features", "integer"),
    (("model", "layers", 1, "in_features"), KeyError, "model.layers[1].in_features", "required"),
    (("model", "layers", 4, "in_features"), 31, "model.layers[4].in_features", "previous layer outputs 32"),
    (("model", "layers", 3, "p"), 1.5, "model.layers[3].p", "[0, 1)"),
    (("model", "layers", 1, "activation"), "gelu", "model.layers[1].activation", "unknown parameter"),
    (("model", "input_shape"), [], "model.input_shape", "1 to 4 integers"),
    (("model", "layers"), [], "model.layers", "non-empty"),
    (("model",), KeyError, "model", "required"),
    (("name",), KeyError, "name", "required"),
    (("category",), "", "category", "non-empty"),
    (("training", "rounds"), 0, "training.rounds", "[1, 100000]"),
    (("training", "rounds"), "five", "training.rounds", "must be int"),
    (("training", "lr"), -0.1, "training.lr", "must be in"),
    (("training", "optimizer"), "lbfgs", "training.optimizer", "sgd"),
    (("training", "epochs"), 3, "training.epochs", "unknown field"),
    (("aggregation", "weighting"), "median", "aggregation.weighting", "unknown weighting algorithm"),
    (("aggregation", "selection"), "best", "aggregation.selection", "unknown selection algorithm"),
    (("aggregation", "alignment"), "magic", "aggregation.alignment", "unknown alignment algorithm"),
    (("aggregation", "weighting_params"), {"ish_form": "x"}, "aggregation.weighting_params", "unknown parameter"),
    (("schedule",), {"min_clients": 0}, "schedule.min_clients", "must be in"),
    (("seed",), -1, "seed", "2^32"),
    (("extra",), 1, "extra", "unknown field"),
]


@pytest.mark.parametrize("path, value, field, text", BAD, ids=[b[2] + ":" + b[3] for b in BAD])
def test_each_bad_spec_gets_an_error_naming_the_field(path, value, field, text):
    with pytest.raises(ConfigError) as info:
        accept_job(_mutate(path, value))
    message = str(info.value)
    assert field in message and text in message, message


def test_all_problems_are_reported_at_once():
    job = _mutate(("training", "rounds"), 0)
    job["model"]["layers"][1]["type"] = "Nope"
    with pytest.raises(ConfigError) as info:
        parse_job(job)
    assert "training.rounds" in str(info.value) and "model.layers[1].type" in str(info.value)


def test_an_async_jobs_alignment_is_refused_along_with_every_other_problem():
    job = _mutate(("training", "rounds"), 0)
    job["model"]["layers"][1]["type"] = "Nope"
    job["aggregation"]["alignment"] = "feddna"
    job["schedule"] = {"mode": "async"}
    with pytest.raises(ConfigError) as info:
        accept_job(job)
    message = str(info.value)
    assert "training.rounds" in message and "model.layers[1].type" in message
    assert "aggregation.alignment: must be 'none' with schedule.mode async" in message, message


def test_parse_and_algorithm_problems_are_reported_together():
    job = _mutate(("training", "rounds"), 0)
    job["aggregation"]["weighting"] = "median"
    with pytest.raises(ConfigError) as info:
        accept_job(job)
    assert "training.rounds" in str(info.value) and "aggregation.weighting" in str(info.value)
    text = "name: j\ncategory: digits\nmodel: {input_shape: [4], layers: [{type: Linear, in_features: 4, " \
           "out_features: 3}]}\naggregation: {selection: best}\n"
    with pytest.raises(ConfigError, match="unknown selection algorithm"):
        accept_job_text(text)


def test_the_kernel_parser_leaves_algorithm_names_to_the_registries():
    assert parse_job(_mutate(("aggregation", "weighting"), "median")).aggregation.weighting == "median"


# One minimal model per layer type in fedbroker.layers.LAYERS (a new type needs an entry here too).
LAYER_EXAMPLES = {
    "Linear": [{"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 3}]},
               {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 3, "bias": False}]}],
    "Conv2d": [{"input_shape": [2, 5, 5], "layers": [
                   {"type": "Conv2d", "in_channels": 2, "out_channels": 3, "kernel_size": 3}, {"type": "Flatten"}]},
               {"input_shape": [2, 5, 5], "layers": [
                   {"type": "Conv2d", "in_channels": 2, "out_channels": 3, "kernel_size": 2, "stride": 2, "padding": 1,
                    "bias": False}, {"type": "Flatten"}]}],
    "MaxPool2d": [{"input_shape": [2, 5, 5], "layers": [{"type": "MaxPool2d", "kernel_size": 2}, {"type": "Flatten"}]},
                  {"input_shape": [2, 5, 5], "layers": [{"type": "MaxPool2d", "kernel_size": 3, "stride": 1},
                                                        {"type": "Flatten"}]}],
    "AvgPool2d": [{"input_shape": [2, 5, 5], "layers": [{"type": "AvgPool2d", "kernel_size": 2}, {"type": "Flatten"}]}],
    "Flatten": [{"input_shape": [2, 3], "layers": [{"type": "Flatten"}]}],
    "ReLU": [{"input_shape": [4], "layers": [{"type": "ReLU"}]}],
    "Tanh": [{"input_shape": [4], "layers": [{"type": "Tanh"}]}],
    "Sigmoid": [{"input_shape": [4], "layers": [{"type": "Sigmoid"}]}],
    "Dropout": [{"input_shape": [4], "layers": [{"type": "Dropout", "p": 0.25}]}],
    "GroupNorm": [{"input_shape": [4, 3, 3], "layers": [{"type": "GroupNorm", "num_groups": 2, "num_channels": 4},
                                                        {"type": "Flatten"}]}],
    "standardize": [{"input_shape": [4], "layers": [{"type": "standardize", "mean": [1, 2, 3, 4], "std": 0.5}]},
                    {"input_shape": [2, 1, 2], "layers": [{"type": "standardize", "mean": 3, "std": [1, 2, 4, 8]},
                                                          {"type": "Flatten"}]}],
}
for _kind, _models in NEW_LAYER_EXAMPLES.items():  # "Linear on a sequence" is more Linear
    LAYER_EXAMPLES.setdefault(_kind.split()[0], []).extend(_models)
LAYER_EXAMPLES.update(LIBRARY_EXAMPLES)


def test_every_layer_type_has_an_example():
    assert set(LAYER_EXAMPLES) == set(LAYERS)


@pytest.mark.parametrize("raw", [m for ms in LAYER_EXAMPLES.values() for m in ms],
                         ids=[f"{t}-{i}" for t, ms in LAYER_EXAMPLES.items() for i in range(len(ms))])
def test_the_layer_table_agrees_with_torch(raw):
    """Shapes, parameter tensors and the builder read one table: what validation infers is what torch builds."""
    spec = parse_model(raw)
    model = build_model(spec, seed=0).eval()
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == parameter_shapes(spec)
    out = model(torch.zeros(2, *spec.input_shape))
    assert tuple(out.shape[1:]) == output_shapes(spec)[-1]
    for layer in spec.layers:  # alignment reads a matched layer's widths from its weight's first two axes
        layer_type = LAYERS[layer.type]
        if layer_type.weighted:
            weight = layer_type.tensors(layer.params)["weight"]
            assert weight[:2] == (layer.params[layer_type.out_width], layer.params[layer_type.in_width])


def test_an_unknown_layer_type_is_refused_naming_the_allowed_list():
    with pytest.raises(ConfigError) as info:
        parse_model({"input_shape": [4], "layers": [{"type": "Lambda", "fn": "os.system"}]})
    assert str(info.value) == (f"model.layers[0].type: unknown layer type 'Lambda'; allowed: "
                               f"{', '.join(sorted(LAYERS))}")


def test_linear_after_conv_without_flatten_is_refused():
    model = copy.deepcopy(CNN)
    del model["layers"][6]
    with pytest.raises(ConfigError, match=r"model.layers\[6\]: Linear needs a flat input"):
        parse_model(model)


def test_group_norm_must_divide_channels():
    model = copy.deepcopy(CNN)
    model["layers"][1]["num_groups"] = 3
    with pytest.raises(ConfigError, match=r"layers\[1\].num_groups"):
        parse_model(model)


def test_oversized_spec_is_refused():
    job = copy.deepcopy(GOOD)
    job["name"] = "x" * 100
    job["training"]["padding"] = "y" * 300_000
    with pytest.raises(ConfigError, match="larger than"):
        parse_job(job)


def test_a_required_layer_parameter_given_as_null_is_refused_not_taken_as_its_default():
    """Found by the fuzzer: `kernel_size: null` on a pool passed validation and crashed shape inference."""
    model = {"input_shape": [1, 8, 8], "layers": [{"type": "MaxPool2d", "kernel_size": None}, {"type": "Flatten"}]}
    with pytest.raises(ConfigError, match=r"model\.layers\[0\]\.kernel_size: is required for MaxPool2d"):
        parse_model(model)


def test_a_standardize_layer_applies_its_mean_and_std_per_feature_and_holds_no_weights():
    spec = parse_model(LAYER_EXAMPLES["standardize"][1])
    model = build_model(spec)
    assert model.state_dict() == {}  # mean and std travel in the spec, never as weights
    x = torch.arange(8.0).reshape(2, 2, 1, 2)
    want = ((x.reshape(2, 4) - 3.0) / torch.tensor([1.0, 2.0, 4.0, 8.0])).reshape(2, 2, 1, 2)
    torch.testing.assert_close(model[0](x), want)
    assert json.loads(spec.to_json())["layers"][0] == {"type": "standardize", "mean": 3.0, "std": [1.0, 2.0, 4.0, 8.0]}
    assert parse_model(json.loads(spec.to_json())) == spec  # the wire form parses back to the same model


def test_every_problem_of_a_standardize_layer_is_named_with_its_path():
    layers = [{"type": "standardize", "mean": [0, 1, 2], "std": [1, 0, -2, float("inf")]},
              {"type": "Linear", "in_features": 4, "out_features": 2}, {"type": "standardize", "mean": 0, "std": 1}]
    with pytest.raises(ConfigErrors) as info:
        parse_model({"input_shape": [4], "layers": layers})
    assert [str(e) for e in info.value.errors] == [
        "model.layers[0].std[1]: must be a number > 0 within float32's range [1.2e-38, 3.4e+38], got 0",
        "model.layers[2].type: standardize must be the first layer: it describes the model's input"]
    with pytest.raises(ConfigError, match=r"model.layers\[0\].mean: has 3 values but the model's input has 4 "
                                          r"features \(input_shape \[4\] flattened\)"):
        parse_model({"input_shape": [4], "layers": [{"type": "standardize", "mean": [0, 1, 2], "std": 1}]})
    for bad, message in (({"mean": "0", "std": 1}, r"mean: must be a number \(finite\), got '0'"),
                         ({"mean": [], "std": 1}, "mean: must be a number or a non-empty list of them"),
                         ({"mean": 0, "std": [1, float("nan")]}, r"std\[1\]: must be a number > 0 \(finite\)"),
                         ({"mean": 1e39, "std": 1}, "mean: must be a number within float32's range"),
                         ({"std": 1}, "mean: is required for standardize")):
        with pytest.raises(ConfigError, match=r"model\.layers\[0\]\." + message):
            parse_model({"input_shape": [4], "layers": [{"type": "standardize", **bad}]})
