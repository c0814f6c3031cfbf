"""The torch side of library nodes: MONAI's networks built from checked parameters (fedbroker.layers.library).

Only MONAI's constructors run, with the parameters the allow-list admits, then one fix that every network
gets: each BatchNorm becomes GroupNorm(gcd(num_groups, C), C), Opacus's ModuleValidator rule, so that
per-sample clipping is possible. `pretrained` is never passed: nothing is downloaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import monai
import torch
from monai.networks.nets.densenet import DenseNet121
from monai.networks.nets.resnet import ResNet
from monai.networks.nets.unet import UNet
from monai.networks.nets.vit import ViT
from torch import nn

from fedbroker.errors import ConfigError
from fedbroker.layers.monai_pins import MONAI_VERSION, RESNET_LAYERS, RESNET_WIDTHS

Shape = tuple[int, ...]


class ViTLogits(ViT):
    """MONAI's ViT whose forward returns only the class scores (MONAI's returns them with every block's
    hidden states); the weights and their names are MONAI's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class scores, one row per sample."""
        scores: torch.Tensor = super().forward(x)[0]  # type: ignore[no-untyped-call]  # MONAI's forward is untyped
        return scores


def _unet(p: Mapping[str, Any]) -> nn.Module:
    net: nn.Module = UNet(
        spatial_dims=p["spatial_dims"], in_channels=p["in_channels"], out_channels=p["out_channels"],
        channels=tuple(p["channels"]), strides=tuple(p["strides"]), kernel_size=p["kernel_size"],
        up_kernel_size=p["up_kernel_size"], num_res_units=p["num_res_units"], act=p["act"], norm="batch",
        dropout=p["dropout"], bias=p["bias"])
    return net


def _densenet121(p: Mapping[str, Any]) -> nn.Module:
    net: nn.Module = DenseNet121(
        spatial_dims=p["spatial_dims"], in_channels=p["in_channels"], out_channels=p["out_channels"],
        init_features=p["init_features"], growth_rate=p["growth_rate"], dropout_prob=p["dropout_prob"],
        pretrained=False, norm="batch", act="relu")  # relu not in place: per-sample hooks need the input kept
    return net


def _resnet(p: Mapping[str, Any]) -> nn.Module:
    net: nn.Module = ResNet(
        block="basic", layers=list(RESNET_LAYERS[p["depth"]]), block_inplanes=list(RESNET_WIDTHS),
        spatial_dims=p["spatial_dims"], n_input_channels=p["n_input_channels"], conv1_t_size=p["conv1_t_size"],
        conv1_t_stride=p["conv1_t_stride"], no_max_pool=p["no_max_pool"], shortcut_type=p["shortcut_type"],
        num_classes=p["num_classes"], norm="batch", act="relu")
    return net


def _vit(p: Mapping[str, Any]) -> nn.Module:
    net: nn.Module = ViTLogits(
        in_channels=p["in_channels"], img_size=p["img_size"], patch_size=p["patch_size"],
        hidden_size=p["hidden_size"], mlp_dim=p["mlp_dim"], num_layers=p["num_layers"], num_heads=p["num_heads"],
        proj_type=p["proj_type"], pos_embed_type="learnable", classification=True, num_classes=p["num_classes"],
        dropout_rate=p["dropout_rate"], spatial_dims=p["spatial_dims"], post_activation=None,
        qkv_bias=p["qkv_bias"])
    return net


BUILDERS: Mapping[str, Callable[[Mapping[str, Any]], nn.Module]] = {
    "monai.UNet": _unet, "monai.DenseNet121": _densenet121, "monai.ResNet": _resnet, "monai.ViT": _vit,
}


def batch_norm_to_group_norm(module: nn.Module, *, num_groups: int) -> nn.Module:
    """`module` with every BatchNorm replaced by GroupNorm(gcd(num_groups, C), C) (affine as the BatchNorm
    was), on the BatchNorm's device: Opacus's ModuleValidator.fix rule, without Opacus."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        channels = module.num_features
        device = module.weight.device if module.weight is not None else None
        return nn.GroupNorm(math.gcd(num_groups, channels), channels, affine=module.affine, device=device)
    for name, child in module.named_children():
        setattr(module, name, batch_norm_to_group_norm(child, num_groups=num_groups))
    return module


def check_version(type_name: str, params: Mapping[str, Any]) -> None:
    """Refuse to build when this site's MONAI is not the version the node names (and this fedbroker pins)."""
    wanted = params.get("version", MONAI_VERSION)
    if monai.__version__ != wanted or wanted != MONAI_VERSION:
        raise ConfigError(f"{type_name}.version", f"the model names MONAI {wanted}; this site has MONAI "
                                                  f"{monai.__version__} and fedbroker pins {MONAI_VERSION}: install "
                                                  f"monai=={MONAI_VERSION} (requirements.txt)")


def build(type_name: str, params: Mapping[str, Any]) -> nn.Module:
    """MONAI's network for a checked library node, its BatchNorms swapped for GroupNorm; weights drawn from
    torch's global generator (the caller seeds it)."""
    check_version(type_name, params)
    net = BUILDERS[type_name](params)
    groups = params.get("num_groups") or 32
    return batch_norm_to_group_norm(net, num_groups=groups)


def meta_tensors(type_name: str, params: Mapping[str, Any]) -> dict[str, Shape]:
    """The state_dict names and shapes of `build(type_name, params)`, built on the meta device: no memory,
    no weights drawn, torch's generator untouched."""
    with torch.device("meta"):
        net = build(type_name, params)
    return {name: tuple(t.shape) for name, t in net.state_dict().items()}


def meta_flops(type_name: str, params: Mapping[str, Any], shape: Shape) -> int:
    """FLOPs of one sample's forward pass (a multiply-add counts 2), counted on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        net = build(type_name, params).eval()
        sample = torch.zeros(1, *shape)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        net(sample)
    return int(counter.get_total_flops())
