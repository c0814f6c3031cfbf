"""Small chain models for each library architecture (fedbroker.layers.library), each ending in class scores: the
kernel's table tests build them for real and check that the table's shapes and tensors (a meta-device build)
are what MONAI builds."""

from __future__ import annotations

from typing import Any

FLAT = {"type": "Flatten"}


def _lin(i: int, o: int = 3) -> dict[str, Any]:
    return {"type": "Linear", "in_features": i, "out_features": o}


LIBRARY_EXAMPLES: dict[str, list[dict[str, Any]]] = {
    "monai.UNet": [
        {"input_shape": [1, 16, 16], "layers": [
            {"type": "monai.UNet", "spatial_dims": 2, "in_channels": 1, "out_channels": 2, "channels": [4, 8, 16],
             "strides": [2, 2], "num_groups": 2},
            {"type": "AdaptiveAvgPool2d", "output_size": 1}, FLAT, _lin(2)]},
        {"input_shape": [1, 8, 8, 8], "layers": [
            {"type": "monai.UNet", "spatial_dims": 3, "in_channels": 1, "out_channels": 3, "channels": [2, 4],
             "strides": [2], "num_res_units": 2, "act": "prelu", "kernel_size": 5, "up_kernel_size": 1},
            {"type": "AdaptiveAvgPool3d", "output_size": 1}, FLAT, _lin(3)]},
    ],
    "monai.DenseNet121": [{"input_shape": [1, 32, 32], "layers": [
        {"type": "monai.DenseNet121", "spatial_dims": 2, "in_channels": 1, "out_channels": 3, "init_features": 8,
         "growth_rate": 4}]}],
    "monai.ResNet": [{"input_shape": [3, 16, 16], "layers": [
        {"type": "monai.ResNet", "depth": 18, "spatial_dims": 2, "n_input_channels": 3, "num_classes": 4,
         "conv1_t_size": 3, "conv1_t_stride": 1, "no_max_pool": True}]}],
    "monai.ViT": [{"input_shape": [3, 8, 8], "layers": [
        {"type": "monai.ViT", "spatial_dims": 2, "in_channels": 3, "img_size": 8, "patch_size": [4, 4],
         "hidden_size": 16, "mlp_dim": 32, "num_layers": 1, "num_heads": 2, "num_classes": 3}]}],
}
