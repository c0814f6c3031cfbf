"""Layer-wise matching of a network whose layers read *concatenations* of earlier layers (a U-Net), pure numpy.

A chain (`permute.py`, `layerwise.py`) has one reader per layer. A U-Net's decoder conv reads
`concat(up-sampled decoder features, encoder skip)`: permuting the units of an encoder conv must move the
matching input channels of *two* readers (the next encoder conv and the decoder conv behind the skip), each at
its own offset inside the reader's input. `ConcatGraph.reads[ℓ]` names, in concat order, the layers whose
outputs layer ℓ reads (`INPUT` = the network input); every node in between (ReLU, pooling, up-sampling, a
per-channel norm already folded in) carries channel i to channel i, so only the weighted layers appear.

Conventions: every weight is `(out, in, *kernel)`, a ConvTranspose's PyTorch `(in, out, *kernel)` weight
transposed by the caller; BatchNorm is folded into its conv first (`bn.fold_batchnorm`, NAFI Appendix E), so
a layer is its fused weight and bias.

The layer-wise scheme (NAFI Appendix D, Algorithm 2) on such a graph, one round per layer in topological
order: when layer ℓ is matched, every layer it reads was matched before and is frozen, so every client reads
ℓ's inputs in one global order and ℓ is matched on its incoming weights and bias (`match_neurons`). Its global
layer is the mean of the clients' units placed on each global unit (Algorithm 2, line 5: Σ_s W_s A_sᵀ, here
weighted by the clients' weights over the clients present at that unit), and every reader of ℓ in every client
has its input block for ℓ moved into the global order (zeros where a client lacks a global unit). The output
layer is the per-class weighted average (line 7).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from fedbroker.aggregators.alignment.base import Layer, Network
from fedbroker.aggregators.alignment.matching import LayerMatch, match_neurons, neuron_vectors
from fedbroker.aggregators.alignment.permute import check_assignment, scatter_outputs
from fedbroker.algorithms.params import MatchingParams

INPUT = -1  # `reads` entry for the network's input


@dataclass(frozen=True)
class ConcatGraph:
    """Which earlier layers each weighted layer reads, concatenated in this order along channels."""

    reads: tuple[tuple[int, ...], ...]
    input_channels: int

    def __post_init__(self) -> None:
        for ell, sources in enumerate(self.reads):
            if not sources:
                raise ValueError(f"layer {ell} reads nothing")
            for src in sources:
                if not (src == INPUT or 0 <= src < ell):
                    raise ValueError(f"layer {ell} reads {src}: a layer reads the input or an earlier layer only")
            if len(set(sources)) != len(sources):
                raise ValueError(f"layer {ell} reads the same layer twice")

    @property
    def n_layers(self) -> int:
        """The number of weighted layers."""
        return len(self.reads)

    def readers(self, source: int) -> list[int]:
        """The layers that read `source`'s outputs."""
        return [ell for ell, sources in enumerate(self.reads) if source in sources]

    def segment(self, net: Sequence[Layer], reader: int, source: int) -> slice:
        """Where `source`'s channels sit inside `reader`'s input channels, with the widths of `net`."""
        start = 0
        for src in self.reads[reader]:
            width = self.input_channels if src == INPUT else int(net[src].weight.shape[0])
            if src == source:
                return slice(start, start + width)
            start += width
        raise ValueError(f"layer {reader} does not read layer {source}")

    def check(self, net: Sequence[Layer], where: str = "network") -> None:
        """A ValueError naming the layer whose input channels do not add up to what it reads."""
        if len(net) != self.n_layers:
            raise ValueError(f"{where}: {len(net)} layers, the graph has {self.n_layers}")
        for ell, layer in enumerate(net):
            if layer.weight.ndim < 3:
                raise ValueError(f"{where} layer {ell}: weight {layer.weight.shape} is not a convolution")
            want = sum(self.input_channels if s == INPUT else int(net[s].weight.shape[0]) for s in self.reads[ell])
            if layer.weight.shape[1] != want:
                raise ValueError(f"{where} layer {ell}: reads {layer.weight.shape[1]} channels, its sources "
                                 f"{list(self.reads[ell])} give {want}")
            if layer.bias is not None and layer.bias.shape != (layer.weight.shape[0],):
                raise ValueError(f"{where} layer {ell}: bias {layer.bias.shape} does not fit its weight")


def _scatter_segment(layer: Layer, seg: slice, assignment: np.ndarray, width: int) -> Layer:
    """`layer` with its input channels `seg` moved to `assignment` inside a block now `width` wide."""
    w = layer.weight
    block = np.zeros((w.shape[0], width) + w.shape[2:], dtype=w.dtype)
    block[:, assignment] = w[:, seg]
    return Layer(np.concatenate([w[:, :seg.start], block, w[:, seg.stop:]], axis=1), layer.bias, layer.channels)


def scatter_readers(graph: ConcatGraph, net: Sequence[Layer], source: int, assignment: np.ndarray,
                    width: int) -> Network:
    """Every reader of `source` with its input block for `source` moved as `source`'s units are moved
    (unit j → global index assignment[j]); `source` itself unchanged."""
    graph.check(net)
    out = list(net)
    n_units = int(net[source].weight.shape[0])
    a = check_assignment(assignment, n_units, width, what=f"layer {source}'s assignment")
    for reader in graph.readers(source):
        out[reader] = _scatter_segment(out[reader], graph.segment(net, reader, source), a, width)
    return out


def permute_layer(graph: ConcatGraph, net: Sequence[Layer], layer: int, assignment: np.ndarray,
                  width: int | None = None) -> Network:
    """Layer `layer`'s units moved to `assignment` and every reader's matching input channels with them: the
    network computes the same function (a wider layer's new units are silent)."""
    width = int(net[layer].weight.shape[0]) if width is None else width
    out = scatter_readers(graph, net, layer, assignment, width)
    out[layer] = scatter_outputs(net[layer], assignment, width)
    return out


def _placed_mean(layers: Sequence[Layer], match: LayerMatch, weights: np.ndarray) -> Layer:
    """Each global unit as the weighted mean of the client units placed on it (Algorithm 2, line 5)."""
    width = match.width
    w_sum = np.zeros((width,) + layers[0].weight.shape[1:])
    b_sum = None if layers[0].bias is None else np.zeros(width)
    mass = np.zeros(width)
    for k, layer in enumerate(layers):
        a = match.assignments[k]
        w_sum[a] += weights[k] * layer.weight
        if b_sum is not None and layer.bias is not None:
            b_sum[a] += weights[k] * layer.bias
        mass[a] += weights[k]
    if np.any(mass <= 0):
        raise ValueError("a global unit holds no client unit")  # match_neurons never leaves one empty
    shape = (width,) + (1,) * (w_sum.ndim - 1)
    return Layer(w_sum / mass.reshape(shape), None if b_sum is None else b_sum / mass)


def match_graph_layer(graph: ConcatGraph, nets: Sequence[Sequence[Layer]], layer: int, *, weights: np.ndarray,
                      params: MatchingParams, rng: np.random.Generator) -> tuple[list[Network], LayerMatch]:
    """One round of the layer-wise scheme on a concat graph: match `layer` across the clients (its inputs must
    already be in one global order: the layers it reads were matched before), and return every client's
    network with `layer` replaced by the global layer and its readers' input blocks moved into the global
    order, plus the match. `weights`: the clients' aggregation weights (normalised here)."""
    w = _weights(weights, len(nets))
    for k, net in enumerate(nets):
        graph.check(net, f"client {k}")
        if net[layer].weight.shape[1:] != nets[0][layer].weight.shape[1:]:
            raise ValueError(f"client {k} layer {layer}: reads {net[layer].weight.shape[1:]}, client 0 "
                             f"{nets[0][layer].weight.shape[1:]}; the layers it reads must be matched first")
    layers = [Layer(net[layer].weight, net[layer].bias) for net in nets]
    vectors = [neuron_vectors(x) for x in layers]
    dim = vectors[0].shape[1]
    prior_mean = np.zeros(dim)
    if layers[0].bias is not None:
        prior_mean[-1] = params.bias_prior_mean
    match = match_neurons(vectors, precisions=[np.full(dim, 1.0 / params.sigma2)] * len(vectors),
                          prior_mean=prior_mean, prior_precision=np.full(dim, 1.0 / params.sigma0_2),
                          params=params, rng=rng)
    global_layer = _placed_mean(layers, match, w)
    out: list[Network] = []
    for k, net in enumerate(nets):
        moved = scatter_readers(graph, net, layer, match.assignments[k], match.width)
        moved[layer] = global_layer
        out.append(moved)
    return out, match


def class_average(layers: Sequence[Layer], shares: np.ndarray) -> Layer:
    """The output layer as the per-class weighted average (Algorithm 2, line 7): row c of client k weighs
    shares[k, c], each column normalised over the clients."""
    p = np.asarray(shares, dtype=np.float64)
    n_out = int(layers[0].weight.shape[0])
    if p.shape != (len(layers), n_out) or not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError(f"shares must be finite, non-negative, of shape ({len(layers)}, {n_out}); got {p.shape}")
    totals = p.sum(axis=0)
    if np.any(totals <= 0):
        raise ValueError("an output class has no share at any client")
    p = p / totals
    shape = (n_out,) + (1,) * (layers[0].weight.ndim - 1)
    weight = sum(p[k].reshape(shape) * x.weight for k, x in enumerate(layers))
    bias = None
    if layers[0].bias is not None:
        bias = np.asarray(sum(p[k] * x.bias for k, x in enumerate(layers) if x.bias is not None))
    return Layer(np.asarray(weight), bias)


def with_width_cap(params: MatchingParams, cap: int) -> MatchingParams:
    """`params` with the matched layer's global width bounded by `cap` (the engine still places every unit)."""
    return replace(params, max_global_width=int(cap))


def _weights(weights: np.ndarray, n: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"weights must be {n} finite non-negative numbers with a positive sum")
    return np.asarray(w / float(w.sum()))


__all__ = ["INPUT", "ConcatGraph", "class_average", "match_graph_layer", "permute_layer", "scatter_readers",
           "with_width_cap"]
