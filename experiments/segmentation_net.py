"""The segmentation experiment's U-Net (2 levels, 13 weighted layers), its concat graph, and its conversion to the
alignment package's `Layer`s (BatchNorm folded, ConvTranspose weights as (out, in, k, k)) and back.

Layers, in the layer-wise scheme's order (each reads the layers named; `pool` = 2×2 max-pool first):

    0 conv c1 ← input        1 conv c1 ← 0          2 conv c2 ← pool(1)    3 conv c2 ← 2
    4 conv c3 ← pool(3)      5 conv c3 ← 4          6 up c2 ← 5 (ConvTranspose 2×2, stride 2)
    7 conv c2 ← concat(6, 3) 8 conv c2 ← 7          9 up c1 ← 8
    10 conv c1 ← concat(9, 1) 11 conv c1 ← 10       12 out (1×1, 2 classes) ← 11

Every 3×3 conv is followed by its norm (BatchNorm, GroupNorm for the DP arm, or none once its BatchNorm is
folded in) and a ReLU; the up-convs and the output conv have neither (Ronneberger et al.'s up-conv).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fedbroker.aggregators.alignment import Layer, fold_batchnorm
from fedbroker.aggregators.alignment.concat import INPUT, ConcatGraph

READS: tuple[tuple[int, ...], ...] = ((INPUT,), (0,), (1,), (2,), (3,), (4,), (5,), (6, 3), (7,), (8,), (9, 1), (10,),
                                      (11,))
POOLED = (2, 4)      # layers whose input is max-pooled first
UPS = (6, 9)         # ConvTranspose layers
OUT = 12
GRAPH = ConcatGraph(reads=READS, input_channels=1)
N_LAYERS = len(READS)
BN_EPS = 1e-5


def widths_for(channels: Sequence[int], classes: int = 2) -> list[int]:
    """Each layer's output width for level channels (c1, c2, c3)."""
    c1, c2, c3 = channels
    return [c1, c1, c2, c2, c3, c3, c2, c2, c2, c1, c1, c1, classes]


def has_norm(layer: int) -> bool:
    """Whether the layer is a 3×3 conv followed by a norm."""
    return layer not in UPS and layer != OUT


class UNet(nn.Module):
    """The 2-level U-Net above; `norms[i]` is "bn", "gn" or "none" for each layer (ignored where no norm)."""

    def __init__(self, widths: Sequence[int], norms: Sequence[str]) -> None:
        super().__init__()
        self.widths = list(widths)
        convs: list[nn.Module] = []
        norm_mods: list[nn.Module] = []
        for i, sources in enumerate(READS):
            c_in = sum(1 if s == INPUT else self.widths[s] for s in sources)
            out = self.widths[i]
            if i in UPS:
                convs.append(nn.ConvTranspose2d(c_in, out, 2, stride=2))
            else:
                convs.append(nn.Conv2d(c_in, out, 1 if i == OUT else 3, padding=0 if i == OUT else 1))
            kind = norms[i] if has_norm(i) else "none"
            norm_mods.append(nn.BatchNorm2d(out, eps=BN_EPS) if kind == "bn" else
                             nn.GroupNorm(_groups(out), out) if kind == "gn" else nn.Identity())
        self.convs = nn.ModuleList(convs)
        self.norms = nn.ModuleList(norm_mods)
        self.act = nn.ReLU()
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        for i, sources in enumerate(READS):
            parts = [x if s == INPUT else outs[s] for s in sources]
            h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            if i in POOLED:
                h = self.pool(h)
            h = self.norms[i](self.convs[i](h))
            outs.append(self.act(h) if has_norm(i) else h)
        return outs[-1]


def _groups(width: int) -> int:
    return max(g for g in (1, 2, 4) if width % g == 0)


@dataclass
class Client:
    """One site's U-Net as the matching sees it: layers (weight (out, in, k, k), bias) and each layer's
    BatchNorm tensors (None once folded in, or for a layer without one)."""

    layers: list[Layer]
    bns: list[dict[str, np.ndarray] | None]

    def folded(self, layer: int) -> Client:
        """This client with `layer`'s BatchNorm folded into its conv (NAFI Appendix E)."""
        bn = self.bns[layer]
        if bn is None:
            return Client(list(self.layers), list(self.bns))
        w, b = fold_batchnorm(self.layers[layer].weight, self.layers[layer].bias, bn["weight"], bn["bias"],
                              bn["running_mean"], bn["running_var"], eps=BN_EPS)
        layers, bns = list(self.layers), list(self.bns)
        layers[layer], bns[layer] = Layer(w, b), None
        return Client(layers, bns)


def client_of(model: UNet) -> Client:
    """The model's layers and BatchNorm tensors as float64 numpy."""
    layers, bns = [], []
    for i in range(N_LAYERS):
        w = model.convs[i].weight.detach().double().numpy()
        layers.append(Layer(w.transpose(1, 0, 2, 3).copy() if i in UPS else w.copy(),
                            model.convs[i].bias.detach().double().numpy().copy()))
        norm = model.norms[i]
        bns.append({k: v.detach().double().numpy().copy() for k, v in norm.state_dict().items()
                    if k != "num_batches_tracked"} if isinstance(norm, nn.BatchNorm2d) else None)
    return Client(layers, bns)


def model_of(client: Client) -> UNet:
    """A UNet holding the client's tensors (layers whose BatchNorm is folded have none)."""
    widths = [int(x.weight.shape[0]) for x in client.layers]
    model = UNet(widths, ["bn" if bn is not None else "none" for bn in client.bns])
    state: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(client.layers):
        w = layer.weight.transpose(1, 0, 2, 3) if i in UPS else layer.weight
        state[f"convs.{i}.weight"] = torch.as_tensor(np.ascontiguousarray(w), dtype=torch.float32)
        state[f"convs.{i}.bias"] = torch.as_tensor(layer.bias, dtype=torch.float32)
        bn = client.bns[i]
        if bn is not None:
            for k, v in bn.items():
                state[f"norms.{i}.{k}"] = torch.as_tensor(v, dtype=torch.float32)
            state[f"norms.{i}.num_batches_tracked"] = torch.tensor(0)
    model.load_state_dict(state)
    return model


def mean_client(clients: Sequence[Client], weights: np.ndarray) -> Client:
    """The weighted mean of clients of equal shapes (layers and BatchNorm tensors alike)."""
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    layers = [Layer(sum(wk * c.layers[i].weight for wk, c in zip(w, clients)),  # type: ignore[misc]
                    sum(wk * c.layers[i].bias for wk, c in zip(w, clients)))  # type: ignore[misc]
              for i in range(N_LAYERS)]
    bns: list[dict[str, np.ndarray] | None] = []
    for i in range(N_LAYERS):
        first = clients[0].bns[i]
        bns.append(None if first is None else {
            k: np.asarray(sum(wk * c.bns[i][k] for wk, c in zip(w, clients)))  # type: ignore[index]
            for k in first})
    return Client(layers, bns)


def average_states(states: Sequence[Mapping[str, np.ndarray]], weights: np.ndarray) -> dict[str, torch.Tensor]:
    """FedAvg of state_dicts (buffers included; the BatchNorm step counter keeps the first client's)."""
    w = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    out: dict[str, torch.Tensor] = {}
    for key in states[0]:
        if key.endswith("num_batches_tracked"):
            out[key] = torch.as_tensor(np.asarray(states[0][key]))
            continue
        out[key] = torch.as_tensor(sum(wk * np.asarray(s[key], dtype=np.float64) for wk, s in zip(w, states)),
                                   dtype=torch.float32)
    return out


def frozen_names(upto: int) -> list[str]:
    """The parameter names of layers 0..upto (their BatchNorm is folded: no norm tensors)."""
    return [f"convs.{i}.{p}" for i in range(upto + 1) for p in ("weight", "bias")]


def dice(model: nn.Module, x: np.ndarray, y: np.ndarray, batch: int = 128) -> float:
    """Foreground Dice pooled over every test pixel: 2·Σ(pred ∧ true) / (Σ pred + Σ true), in percent."""
    model.eval()
    inter = pred_sum = true_sum = 0
    with torch.no_grad():
        for start in range(0, len(x), batch):
            pred = model(torch.as_tensor(x[start:start + batch])).argmax(dim=1).numpy() == 1
            true = y[start:start + batch] == 1
            inter += int(np.sum(pred & true))
            pred_sum += int(pred.sum())
            true_sum += int(true.sum())
    return 100.0 * 2.0 * inter / max(pred_sum + true_sum, 1)
