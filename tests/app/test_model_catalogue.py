"""The model catalogue (examples/models, `fedbroker models list|show`): every model builds, and each matches the
reference implementation it names — parameter counts exactly, and the same outputs once the reference's weights
are copied in by a name map. torchvision does not install here, so ResNet-18 and DenseNet-121 are written out in
torch below as torchvision defines them (GroupNorm(32, C) for every BatchNorm, the catalogue's stems); the U-Nets
are compared with MONAI's UNet, the LSTM and the Transformer encoder with torch's own modules, ViT-tiny with
ViT-Ti's weight formula and MONAI's ViT."""

import json
import math
import re

import pytest
import torch
from torch import nn

from fedbroker.app.cli import main
from fedbroker.app.models import catalogue_folder, entries
from fedbroker.errors import ConfigError
from fedbroker.job.model_spec import model_bounds, parameter_shapes, parse_model
from fedbroker.layers.library import check_params
from fedbroker.layers.monai_nets import build as build_library
from fedbroker.model import build_model

NAMES = ["densenet121", "densenet121_small", "lstm_classifier", "resnet18", "text_transformer", "unet2d",
         "unet3d_small", "vit_tiny"]


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _ours(name: str, seed: int = 0) -> nn.Module:
    return build_model(entries()[name].spec, seed=seed).eval()


def _copy(ours: nn.Module, reference: nn.Module, name_map) -> None:
    """The reference takes our weights, tensor by tensor, under the mapped name (every tensor on both sides)."""
    own = ours.state_dict()
    mapped = {name_map(k): v for k, v in own.items()}
    theirs = reference.state_dict()
    assert set(mapped) == set(theirs), (sorted(set(mapped) ^ set(theirs)))[:6]
    for key, value in mapped.items():
        assert value.shape == theirs[key].shape, key
    reference.load_state_dict(mapped)


def _same_outputs(ours: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    with torch.no_grad():
        torch.testing.assert_close(ours(x), reference.eval()(x), rtol=1e-4, atol=1e-5)


# ----- the catalogue and its command -------------------------------------------------------------------

def test_the_catalogue_holds_every_model_the_issue_names_and_each_is_a_valid_graph():
    assert list(entries()) == NAMES
    for entry in entries().values():
        assert entry.spec.is_graph
        assert entry.task in ("classification", "multilabel", "segmentation", "regression")


def test_models_list_prints_each_models_task_input_and_figures(capsys):
    assert main(["models", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == NAMES
    for row in rows:
        bounds = model_bounds(entries()[row["name"]].spec)
        assert (row["parameters"], row["flops"]) == (bounds.parameters, bounds.flops)
    assert main(["models", "list"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["name", "task", "input", "parameters", "FLOPs", "description"]
    assert table[2].split()[:5] == ["densenet121", "multilabel", "3×224×224", "7.0", "M"]


def test_models_show_prints_the_yaml_to_paste_and_its_figures(capsys):
    assert main(["models", "show", "unet2d"]) == 0
    out = capsys.readouterr().out
    assert out.startswith((catalogue_folder() / "unet2d.yaml").read_text().rstrip())
    assert "# parameters: 661,490 (661.5 k)" in out and "input 1×64×64; output 2×64×64" in out


def test_models_show_of_an_unknown_name_names_the_known_ones(capsys):
    assert main(["models", "show", "resnet50"]) == 2
    assert "no catalogue model 'resnet50'; known: densenet121, " in capsys.readouterr().err


def test_a_catalogue_file_with_a_stray_field_is_refused(tmp_path):
    from fedbroker.app.models import read_entry

    text = (catalogue_folder() / "lstm_classifier.yaml").read_text() + "\nhook: os.system\n"
    (tmp_path / "lstm_classifier.yaml").write_text(text)
    with pytest.raises(ConfigError, match="a catalogue file holds exactly name, task, reference, description, model"):
        read_entry(tmp_path / "lstm_classifier.yaml")


# ----- ResNet-18 against torchvision's, written out ----------------------------------------------------

class _Basic(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.GroupNorm(32, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.GroupNorm(32, cout)
        self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(32, cout))
                           if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (self.downsample(x) if self.downsample is not None else x))


class _ResNet18(nn.Module):
    """torchvision.models.resnet18's modules and names; GroupNorm(32, C) for BatchNorm2d; the CIFAR stem."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.GroupNorm(32, 64)
        widths = [(64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)]
        for i, (cin, cout, stride) in enumerate(widths, start=1):
            setattr(self, f"layer{i}", nn.Sequential(_Basic(cin, cout, stride), _Basic(cout, cout, 1)))
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
        return self.fc(x.mean((2, 3)))


def _resnet_name(ours: str) -> str:
    name = re.sub(r"^layer(\d)_(\d)\.", r"layer\1.\2.", ours)
    return name.replace(".proj_bn.", ".downsample.1.").replace(".proj.", ".downsample.0.")


def test_resnet18_is_torchvisions_resnet18_with_groupnorm():
    ours, reference = _ours("resnet18"), _ResNet18()
    assert _count(ours) == _count(reference) == 11_173_962
    _copy(ours, reference, _resnet_name)
    _same_outputs(ours, reference, torch.randn(2, 3, 32, 32))


# ----- DenseNet-121 against torchvision's, written out, and MONAI's count -----------------------------

class _DenseLayer(nn.Module):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(32, cin), nn.Conv2d(cin, 128, 1, bias=False)
        self.norm2, self.conv2 = nn.GroupNorm(32, 128), nn.Conv2d(128, 32, 3, 1, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        new = self.conv2(torch.relu(self.norm2(self.conv1(torch.relu(self.norm1(x))))))
        return torch.cat([x, new], 1)


class _DenseNet121(nn.Module):
    """torchvision.models.densenet121's modules and names (features.denseblockN.denselayerM, transitionN,
    norm5, classifier); GroupNorm(32, C); the stem is the catalogue's (`small`: a 3×3 convolution and no pool)."""

    def __init__(self, classes: int, *, small: bool) -> None:
        super().__init__()
        stem: list[tuple[str, nn.Module]] = [("conv0", nn.Conv2d(3, 64, 3, 1, 1, bias=False))] if small else [
            ("conv0", nn.Conv2d(3, 64, 7, 2, 3, bias=False)), ("norm0", nn.GroupNorm(32, 64)), ("relu0", nn.ReLU()),
            ("pool0", nn.MaxPool2d(2))]
        self.features = nn.Sequential()
        for name, module in stem:
            self.features.add_module(name, module)
        c = 64
        for stage, count in enumerate((6, 12, 24, 16), start=1):
            block = nn.Sequential()
            for i in range(count):
                block.add_module(f"denselayer{i + 1}", _DenseLayer(c + 32 * i))
            self.features.add_module(f"denseblock{stage}", block)
            c += 32 * count
            if stage < 4:
                self.features.add_module(f"transition{stage}", nn.Sequential(
                    nn.GroupNorm(32, c), nn.ReLU(), nn.Conv2d(c, c // 2, 1, bias=False), nn.AvgPool2d(2)))
                c //= 2
        self.features.add_module("norm5", nn.GroupNorm(32, c))
        self.classifier = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.relu(self.features(x)).mean((2, 3)))


def _densenet_name(ours: str) -> str:
    four = re.match(r"^dense(\d)_(\d+)\.l(\d)\.(.*)$", ours)
    if four:
        stage, group, index, rest = four.groups()
        return f"features.denseblock{stage}.denselayer{int(group) * 4 + int(index) + 1}.{rest}"
    single = re.match(r"^dense(\d)_l(\d+)\.(.*)$", ours)
    if single:
        stage, index, rest = single.groups()
        return f"features.denseblock{stage}.denselayer{int(index) + 1}.{rest}"
    transition = re.match(r"^(transition\d)\.(norm|conv)\.(.*)$", ours)
    if transition:
        name, part, rest = transition.groups()
        return f"features.{name}.{0 if part == 'norm' else 2}.{rest}"
    return ours if ours.startswith("classifier.") else f"features.{ours}"


@pytest.mark.parametrize(("name", "classes", "small", "size"), [
    ("densenet121", 14, False, 64), ("densenet121_small", 10, True, 32)])
def test_densenet121_is_torchvisions_densenet121_with_groupnorm(name, classes, small, size):
    ours, reference = _ours(name), _DenseNet121(classes, small=small)
    assert _count(ours) == _count(reference)
    _copy(ours, reference, _densenet_name)
    _same_outputs(ours, reference, torch.randn(1, 3, size, size))  # 64×64 for the 224 model: same weights, less time


def test_densenet121_has_the_weights_of_monais_densenet121():
    params, problems = check_params("monai.DenseNet121", {"spatial_dims": 2, "in_channels": 3, "out_channels": 14})
    assert not problems
    with torch.device("meta"):
        monai_net = build_library("monai.DenseNet121", params)
    assert sum(p.numel() for p in monai_net.parameters()) == _count(_ours("densenet121")) == 6_968_206


# ----- the U-Nets against MONAI's UNet -----------------------------------------------------------------

@pytest.mark.parametrize(("name", "dims", "channels", "size"), [
    ("unet2d", 2, [16, 32, 64, 128, 256], 64), ("unet3d_small", 3, [8, 16, 32, 64], 32)])
def test_the_unets_are_monais_unet_node_for_node(name, dims, channels, size):
    params, problems = check_params("monai.UNet", {
        "spatial_dims": dims, "in_channels": 1, "out_channels": 2, "channels": channels,
        "strides": [2] * (len(channels) - 1), "num_groups": 8, "act": "relu"})
    assert not problems
    ours, reference = _ours(name), build_library("monai.UNet", params)
    assert _count(ours) == _count(reference)
    # the map: both hold their tensors in the same order (down the levels, the bottom, up again), shape for shape
    names = dict(zip(ours.state_dict(), reference.state_dict(), strict=True))
    _copy(ours, reference, names.__getitem__)
    x = torch.randn(1, 1, *([size] * dims))
    _same_outputs(ours, reference, x)
    assert tuple(ours(x).shape) == (1, 2, *([size] * dims))


# ----- the LSTM and the Transformer encoder against torch's modules ------------------------------------

class _LSTMClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x.long()))
        return self.head(out[:, -1])


def test_the_lstm_classifier_is_torchs_lstm():
    ours, reference = _ours("lstm_classifier"), _LSTMClassifier()
    assert _count(ours) == _count(reference) == 295_682
    _copy(ours, reference, lambda name: name)
    tokens = torch.randint(0, 1000, (3, 50)).float()  # a site's data holds token ids as numbers
    _same_outputs(ours, reference, tokens)


class _TextTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(2000, 64)
        self.enc1, self.enc2 = (nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, activation="gelu",
                                                           norm_first=True, batch_first=True) for _ in range(2))
        self.head = nn.Linear(64 * 64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc2(self.enc1(self.embed(x.long()))).flatten(1))


def test_the_text_transformer_is_torchs_transformer_encoder():
    ours, reference = _ours("text_transformer"), _TextTransformer()
    assert _count(ours) == _count(reference) == 203_138
    own = ours.state_dict()
    mapped = {}
    for key, value in own.items():  # Opacus's DP attention keeps q, k and v apart; torch stacks them
        m = re.match(r"^(enc\d)\.layer\.self_attn\.([qkv])linear\.(weight|bias)$", key)
        if not m:
            mapped[key.replace(".layer.", ".")] = value
    for enc in ("enc1", "enc2"):
        for part in ("weight", "bias"):
            mapped[f"{enc}.self_attn.in_proj_{part}"] = torch.cat(
                [own[f"{enc}.layer.self_attn.{q}linear.{part}"] for q in "qkv"])
    reference.load_state_dict(mapped)
    _same_outputs(ours, reference, torch.randint(0, 2000, (3, 64)).float())


# ----- ViT-tiny: ViT-Ti's weights, and MONAI's ViT ----------------------------------------------------

def test_vit_tiny_has_vit_tis_weights_and_gives_monais_class_scores():
    from monai.networks.nets.vit import ViT

    d, mlp, layers, classes, patches = 192, 768, 12, 10, (32 // 4) ** 2
    # per block: two norms, qkv (no bias), the projection, the MLP, and the cross-attention norm MONAI's
    # TransformerBlock holds even without cross-attention (its weights get no gradient)
    per_layer = 2 * 2 * d + 3 * d * d + (d * d + d) + (d * mlp + mlp) + (mlp * d + d) + 2 * d
    # the patch embedding, the class token, one position embedding per patch, the blocks, the final norm, the head
    formula = (3 * 4 * 4 * d + d) + d + patches * d + layers * per_layer + 2 * d + (d * classes + classes)
    ours = _ours("vit_tiny")
    assert _count(ours) == formula == 5_360_266
    assert sum(math.prod(s) for s in parameter_shapes(entries()["vit_tiny"].spec).values()) == formula
    monai_vit = ViT(in_channels=3, img_size=32, patch_size=4, hidden_size=d, mlp_dim=mlp, num_layers=layers,
                    num_heads=3, classification=True, num_classes=classes, spatial_dims=2, post_activation=None)
    monai_vit.load_state_dict({k.removeprefix("vit."): v for k, v in ours.state_dict().items()})
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), monai_vit.eval()(x)[0])


def test_every_catalogue_model_parses_again_from_its_wire_form():
    for entry in entries().values():
        assert parse_model(json.loads(entry.spec.to_json())) == entry.spec
