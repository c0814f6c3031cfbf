"""The companion permutation: moving layer ℓ's units and layer ℓ+1's input blocks keeps the function."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.aggregators.alignment import Layer, apply_permutations, permute_units, scatter_inputs, scatter_outputs


def forward(net: list[Layer], x: np.ndarray) -> np.ndarray:
    """ReLU network in float64: conv (padding 'same'), flatten before the first dense after a conv."""
    h = torch.from_numpy(x)
    for ell, layer in enumerate(net):
        w = torch.from_numpy(layer.weight)
        b = None if layer.bias is None else torch.from_numpy(layer.bias)
        h = F.conv2d(h, w, b, padding="same") if layer.weight.ndim == 4 else F.linear(h.flatten(1), w, b)
        if ell < len(net) - 1:
            h = torch.relu(h)
    return h.numpy()


def dense(rng: np.random.Generator, n_out: int, n_in: int) -> Layer:
    return Layer(rng.normal(size=(n_out, n_in)), rng.normal(size=n_out))


def conv(rng: np.random.Generator, n_out: int, n_in: int, k: int = 3) -> Layer:
    return Layer(rng.normal(size=(n_out, n_in, k, k)), rng.normal(size=n_out))


def test_companion_permutation_keeps_dense_to_dense_function() -> None:
    rng = np.random.default_rng(0)
    net = [dense(rng, 7, 5), dense(rng, 6, 7), dense(rng, 3, 6)]
    x = rng.normal(size=(11, 5))
    moved = apply_permutations(net, [rng.permutation(7), rng.permutation(6)])
    assert not np.allclose(moved[0].weight, net[0].weight)
    np.testing.assert_allclose(forward(moved, x), forward(net, x), rtol=0, atol=1e-12)


def test_companion_permutation_keeps_conv_to_conv_function() -> None:
    rng = np.random.default_rng(1)
    net = [conv(rng, 4, 2), conv(rng, 5, 4), conv(rng, 3, 5, k=1)]
    x = rng.normal(size=(3, 2, 6, 6))
    moved = apply_permutations(net, [rng.permutation(4), rng.permutation(5)])
    np.testing.assert_allclose(forward(moved, x), forward(net, x), rtol=0, atol=1e-12)


def test_companion_permutation_keeps_conv_flatten_dense_function() -> None:
    rng = np.random.default_rng(2)
    hw = 5 * 5
    net = [conv(rng, 4, 1), dense(rng, 6, 4 * hw), dense(rng, 2, 6)]
    x = rng.normal(size=(3, 1, 5, 5))
    perm = rng.permutation(4)
    moved = permute_units(net, 0, perm)
    # blocks of H·W columns travel whole: channel j's block is now channel perm[j]'s
    for j in range(4):
        np.testing.assert_array_equal(moved[1].weight[:, perm[j] * hw : (perm[j] + 1) * hw], net[1].weight[:, j * hw : (j + 1) * hw])
    np.testing.assert_allclose(forward(moved, x), forward(net, x), rtol=0, atol=1e-12)


def test_scattering_into_a_wider_layer_adds_silent_units() -> None:
    rng = np.random.default_rng(3)
    net = [dense(rng, 4, 3), dense(rng, 2, 4)]
    x = rng.normal(size=(5, 3))
    wide = permute_units(net, 0, np.array([5, 0, 2, 3]), width=7)
    assert wide[0].weight.shape == (7, 3) and wide[1].weight.shape == (2, 7)
    np.testing.assert_array_equal(wide[0].weight[[1, 4, 6]], 0.0)
    np.testing.assert_allclose(forward(wide, x), forward(net, x), rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        (np.array([0, 0, 1]), "same global index"),
        (np.array([0, 1, 3]), "outside"),
        (np.array([0, 1]), "must be 3 integers"),
        (np.array([0.0, 1.0, 2.0]), "must be 3 integers"),
    ],
)
def test_invalid_assignment_is_rejected(assignment: np.ndarray, message: str) -> None:
    layer = dense(np.random.default_rng(4), 3, 2)
    with pytest.raises(ValueError, match=message):
        scatter_outputs(layer, assignment)


def test_inputs_not_a_multiple_of_the_moved_units_are_rejected() -> None:
    layer = dense(np.random.default_rng(5), 2, 7)
    with pytest.raises(ValueError, match="not a multiple"):
        scatter_inputs(layer, np.arange(3))


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_permutations_round_trip_and_keep_the_function(sizes: list[int], seed: int) -> None:
    rng = np.random.default_rng(seed)
    net = [dense(rng, o, i) for i, o in itertools.pairwise(sizes)]
    perms = [rng.permutation(n) for n in sizes[1:-1]]
    moved = apply_permutations(net, perms)
    x = rng.normal(size=(4, sizes[0]))
    np.testing.assert_allclose(forward(moved, x), forward(net, x), rtol=1e-12, atol=1e-12)
    back = moved
    for ell in reversed(range(len(perms))):
        back = permute_units(back, ell, np.argsort(perms[ell]))
    for a, b in zip(back, net):
        np.testing.assert_array_equal(a.weight, b.weight)
        np.testing.assert_array_equal(a.bias, b.bias)
