"""Library nodes (fedbroker.layers.library): a model may name MONAI's networks from an allow-list, with typed and
bounded parameters; the coordinator checks them, their shapes and their size without building real weights, and
every site builds the same network from the same MONAI version, BatchNorm swapped for GroupNorm."""

import json
import resource

import monai
import pytest
import torch
from torch import nn

from fedbroker.errors import ConfigError
from fedbroker.job.model_spec import output_shapes, parameter_shapes, parse_model
from fedbroker.layers import LAYERS
from fedbroker.layers.library import ARCHITECTURES, MAX_LIBRARY_PARAMETERS, MONAI_VERSION, check_params
from fedbroker.layers.monai_nets import build
from fedbroker.model import build_model
from tests.library_examples import LIBRARY_EXAMPLES


def _unet_model(input_shape: list[int], **params: object) -> dict:
    node = {"type": "monai.UNet", "spatial_dims": 2, "in_channels": 1, "out_channels": 2, "channels": [4, 8],
            "strides": [2], **params}
    return {"input_shape": input_shape, "layers": [node, {"type": "AdaptiveAvgPool2d", "output_size": 1},
                                                   {"type": "Flatten"}, {"type": "Linear", "in_features": 2,
                                                                         "out_features": 2}]}


def _problems(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_model(raw)
    return [str(e) for e in getattr(info.value, "errors", [info.value])]


def test_every_library_architecture_is_in_the_layer_table_and_has_an_example():
    assert set(ARCHITECTURES) <= set(LAYERS)
    assert set(LIBRARY_EXAMPLES) == set(ARCHITECTURES)


def test_pinned_monai_is_the_installed_one_and_requirements_pin_the_same():
    assert monai.__version__ == MONAI_VERSION
    from tests.source_roots import ROOT

    assert f"monai=={MONAI_VERSION}" in (ROOT / "requirements.txt").read_text().splitlines()


def test_unknown_parameters_and_values_off_the_list_are_all_named_at_once():
    raw = _unet_model([1, 16, 16], pretrained=True, act="swish", spatial_dims=4, channels=[4, 2000],
                      kwargs={"block": "os.system"})
    assert sorted(_problems(raw)) == sorted([
        "model.layers[0].kwargs: unknown parameter for monai.UNet; allowed: " + ", ".join(ARCHITECTURES["monai.UNet"].params),
        "model.layers[0].pretrained: unknown parameter for monai.UNet; allowed: " + ", ".join(ARCHITECTURES["monai.UNet"].params),
        "model.layers[0].spatial_dims: must be one of 2, 3, got 4",
        "model.layers[0].channels: must be a list of 2 to 6 of integers in [1, 1024], got [4, 2000]",
        'model.layers[0].act: must be one of "relu", "leakyrelu", "prelu", "gelu", "elu", got "swish"',
    ])


def test_an_unknown_architecture_is_refused_naming_the_allowed_types():
    problems = _problems({"input_shape": [1, 16, 16], "layers": [{"type": "monai.SwinUNETR", "spatial_dims": 2}]})
    assert problems[0].startswith("model.layers[0].type: unknown layer type 'monai.SwinUNETR'; allowed: ")
    assert "monai.UNet" in problems[0]


@pytest.mark.parametrize(("raw", "expected"), [
    (_unet_model([1, 16, 16], strides=[2, 2]),
     "model.layers[0].strides: has 2 values; a UNet of 2 channel levels needs 1 (one per step down)"),
    (_unet_model([1, 18, 16], channels=[4, 8, 16], strides=[2, 2]),
     "model.layers[0].strides: go down by 4 in all; every input size must be a multiple of it so that each skip "
     "meets its upsampled path, got [18, 16]"),
    (_unet_model([3, 16, 16]), "model.layers[0].in_channels: is 1 but the input has 3 channels"),
    (_unet_model([1, 16, 16, 16]),
     "model.layers[0].spatial_dims: is 2: monai.UNet needs a (channels, height, width) input but receives [1, 16, 16, 16]"),
    ({"input_shape": [3, 32, 32], "layers": [{"type": "monai.ViT", "spatial_dims": 2, "in_channels": 3, "img_size": 32,
                                               "patch_size": 5, "hidden_size": 100, "num_heads": 3, "num_classes": 2}]},
     "model.layers[0].patch_size: [5, 5] must divide img_size [32, 32]"),
    ({"input_shape": [3, 16, 16], "layers": [{"type": "monai.ViT", "spatial_dims": 2, "in_channels": 3, "img_size": 32,
                                               "patch_size": 8, "hidden_size": 16, "num_heads": 2, "num_classes": 2}]},
     "model.layers[0].img_size: is [32, 32] but the input is [16, 16]: a ViT's position embeddings fix its input size"),
    ({"input_shape": [1, 16, 16], "layers": [{"type": "monai.DenseNet121", "spatial_dims": 2, "in_channels": 1,
                                               "out_channels": 2}]},
     "model.layers[0]: monai.DenseNet121 shrinks its input 32-fold; input sizes [16, 16] must be at least 29 (for "
     "small images use the catalogue's densenet121_small)"),
], ids=["unet strides", "unet sizes", "unet channels", "unet rank", "vit patch", "vit size", "densenet small"])
def test_a_library_node_that_cannot_take_its_input_is_refused_with_the_field_at_fault(raw, expected):
    assert expected in _problems(raw)


def test_a_huge_library_net_is_refused_with_its_count_before_any_real_weight_exists():
    """1.1 billion weights would take 4.4 GB to build: the count comes from a meta-device build, which holds none."""
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    raw = {"input_shape": [1, 64, 64, 64], "layers": [
        {"type": "monai.UNet", "spatial_dims": 3, "in_channels": 1, "out_channels": 2, "channels": [1024] * 6,
         "strides": [2] * 5, "num_res_units": 4}]}
    problems = _problems(raw)
    assert problems == [f"model.layers[0]: monai.UNet with these parameters holds 1,104,419,956 weights, more than a "
                        f"library node's limit of {MAX_LIBRARY_PARAMETERS:,}"]
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 1_000_000  # KiB: far below 4.4 GB


def test_checking_a_library_node_draws_nothing_from_torchs_generator():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    parse_model(LIBRARY_EXAMPLES["monai.ViT"][0])
    assert torch.equal(torch.rand(3), expected)


def test_a_library_node_keeps_its_defaults_and_survives_the_wire_unchanged():
    spec = parse_model(LIBRARY_EXAMPLES["monai.UNet"][0])
    params = spec.layers[0].params
    assert params["version"] == MONAI_VERSION and params["act"] == "relu" and params["num_res_units"] == 0
    again = parse_model(json.loads(spec.to_json()))
    assert again == spec and parameter_shapes(again) == parameter_shapes(spec)


def test_every_batchnorm_becomes_groupnorm_by_opacus_rule():
    """GroupNorm(gcd(num_groups, C), C): always valid, even for widths num_groups does not divide."""
    for name, models in LIBRARY_EXAMPLES.items():
        for raw in models:
            model = build_model(parse_model(raw), seed=0)
            assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()), name
    params, problems = check_params("monai.UNet", {"spatial_dims": 2, "in_channels": 1, "out_channels": 3,
                                                   "channels": [6, 12], "strides": [2], "num_res_units": 1,
                                                   "num_groups": 4})
    assert not problems
    groups = {(m.num_groups, m.num_channels) for m in build("monai.UNet", params).modules() if isinstance(m, nn.GroupNorm)}
    assert groups == {(2, 6), (4, 12), (1, 3)}


def test_the_same_seed_builds_the_same_library_net():
    spec = parse_model(LIBRARY_EXAMPLES["monai.UNet"][1])
    a, b = build_model(spec, seed=3).state_dict(), build_model(spec, seed=3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert output_shapes(spec)[0] == (3, 8, 8, 8)


def test_a_node_naming_another_monai_version_is_refused_at_submission():
    raw = _unet_model([1, 16, 16], version="1.5.0")
    assert _problems(raw) == [f'model.layers[0].version: must be one of "{MONAI_VERSION}", got "1.5.0"']


def test_a_site_with_another_monai_refuses_to_build_the_model(monkeypatch):
    spec = parse_model(LIBRARY_EXAMPLES["monai.UNet"][0])
    monkeypatch.setattr(monai, "__version__", "1.7.0")
    with pytest.raises(ConfigError) as info:
        build_model(spec, seed=0)
    assert str(info.value) == (f"monai.UNet.version: the model names MONAI {MONAI_VERSION}; this site has MONAI 1.7.0 "
                               f"and fedbroker pins {MONAI_VERSION}: install monai=={MONAI_VERSION} (requirements.txt)")


def test_a_coordinator_with_another_monai_refuses_the_node_naming_it(monkeypatch):
    monkeypatch.setattr(monai, "__version__", "1.7.0")
    raw = _unet_model([1, 32, 32], num_groups=5)  # parameters not checked before: the meta build runs now
    [problem] = _problems(raw)
    assert problem.startswith(f"model.layers[0]: the model names MONAI {MONAI_VERSION}; this site has MONAI 1.7.0")
