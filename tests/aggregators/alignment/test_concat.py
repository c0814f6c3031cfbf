"""Layer-wise matching of a U-Net (concat skips, BatchNorm fused): permuted copies of one network are realigned
exactly, so the realigned network's outputs equal the original's; a permutation moves both readers of a skip."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedbroker.aggregators.alignment import Layer, fold_batchnorm
from fedbroker.aggregators.alignment.concat import (
    INPUT,
    ConcatGraph,
    class_average,
    match_graph_layer,
    permute_layer,
    scatter_readers,
)
from fedbroker.algorithms.params import MatchingParams

# enc1 (1→4), enc2 (pool, 4→6), up (convT 6→4), dec (concat(up, enc1) → 5), out (1×1, 5→2)
GRAPH = ConcatGraph(reads=((INPUT,), (0,), (1,), (2, 0), (3,)), input_channels=1)
KERNELS = (3, 3, 2, 3, 1)


def _unet(rng: np.random.Generator) -> list[Layer]:
    """A random U-Net with BatchNorm folded into every hidden conv (eval-mode statistics)."""
    shapes = [(4, 1), (6, 4), (4, 6), (5, 8), (2, 5)]
    net = []
    for ell, (out, inp) in enumerate(shapes):
        k = KERNELS[ell]
        w, b = rng.normal(size=(out, inp, k, k)), rng.normal(size=out)
        if ell in (0, 1, 3):  # conv → BatchNorm, folded (NAFI Appendix E)
            w, b = fold_batchnorm(w, b, rng.normal(size=out), rng.normal(size=out), rng.normal(size=out),
                                  rng.uniform(0.1, 2.0, size=out))
        net.append(Layer(w, b))
    return net


def _forward(net: list[Layer], x: np.ndarray) -> np.ndarray:
    t = [torch.as_tensor(layer.weight) for layer in net]
    b = [torch.as_tensor(layer.bias) for layer in net]
    xin = torch.as_tensor(x)
    e1 = F.relu(F.conv2d(xin, t[0], b[0], padding=1))
    e2 = F.relu(F.conv2d(F.max_pool2d(e1, 2), t[1], b[1], padding=1))
    up = F.relu(F.conv_transpose2d(e2, t[2].transpose(0, 1), b[2], stride=2))
    d = F.relu(F.conv2d(torch.cat([up, e1], dim=1), t[3], b[3], padding=1))
    return F.conv2d(d, t[4], b[4]).numpy()


def _permuted(net: list[Layer], rng: np.random.Generator) -> list[Layer]:
    out = list(net)
    for ell in range(GRAPH.n_layers - 1):
        out = permute_layer(GRAPH, out, ell, rng.permutation(out[ell].weight.shape[0]))
    return out


def test_a_permutation_of_an_encoder_conv_moves_both_of_its_readers_and_keeps_the_function():
    rng = np.random.default_rng(0)
    net, x = _unet(rng), rng.normal(size=(2, 1, 8, 8))
    moved = permute_layer(GRAPH, net, 0, np.array([2, 0, 3, 1]))
    assert GRAPH.readers(0) == [1, 3]
    np.testing.assert_allclose(_forward(moved, x), _forward(net, x), atol=1e-10)
    # the decoder's block for enc1 sits behind the 4 channels of `up`
    np.testing.assert_array_equal(moved[3].weight[:, 4 + 2], net[3].weight[:, 4 + 0])
    np.testing.assert_array_equal(moved[3].weight[:, :4], net[3].weight[:, :4])
    wider = permute_layer(GRAPH, net, 0, np.array([5, 0, 3, 1]), width=6)  # silent units where none lands
    np.testing.assert_allclose(_forward(wider, x), _forward(net, x), atol=1e-10)


@pytest.mark.parametrize("lam", [0.0, 0.01])  # PFNM, NAFI
def test_permuted_copies_of_one_unet_are_realigned_exactly(lam):
    rng = np.random.default_rng(1)
    net, x = _unet(rng), rng.normal(size=(3, 1, 8, 8))
    clients = [_permuted(net, rng) for _ in range(4)]
    assert not np.allclose(clients[0][0].weight, clients[1][0].weight)
    params = MatchingParams(lam=lam, sigma2=1.0, sigma0_2=1.0)
    weights = np.array([1.0, 2.0, 3.0, 4.0])
    for ell in range(GRAPH.n_layers - 1):  # one round per layer, in topological order
        clients, match = match_graph_layer(GRAPH, clients, ell, weights=weights, params=params,
                                           rng=np.random.default_rng(ell))
        assert match.width == net[ell].weight.shape[0]
    out = class_average([c[-1] for c in clients], np.ones((4, 2)))
    fused = clients[0][:-1] + [out]
    for c in clients[1:]:
        for a, b in zip(c[:-1], clients[0][:-1]):
            np.testing.assert_array_equal(a.weight, b.weight)
    np.testing.assert_allclose(_forward(fused, x), _forward(net, x), rtol=1e-9, atol=1e-9)


def test_bad_graphs_and_networks_are_named():
    with pytest.raises(ValueError, match="layer 1 reads 2"):
        ConcatGraph(reads=((INPUT,), (2,), (1,)), input_channels=1)
    rng = np.random.default_rng(2)
    net = _unet(rng)
    bad = list(net)
    bad[3] = Layer(net[3].weight[:, :7], net[3].bias)
    with pytest.raises(ValueError, match="layer 3: reads 7 channels"):
        GRAPH.check(bad)
    with pytest.raises(ValueError, match="two units to the same global index"):
        scatter_readers(GRAPH, net, 0, np.array([0, 0, 1, 2]), 4)
    wider = permute_layer(GRAPH, net, 0, np.arange(4), width=5)  # layer 1 now reads 5 channels
    with pytest.raises(ValueError, match="client 1 layer 1: reads"):
        match_graph_layer(GRAPH, [net, wider], 1, weights=np.ones(2), params=MatchingParams(), rng=rng)
