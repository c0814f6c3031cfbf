"""Moving a layer's units to new (global) indices, and the companion move of the next layer's inputs.

Units are *scattered*: unit j of the client goes to global index `assignment[j]`; a global index that no
client unit maps to is a silent unit (zero weights, zero bias, zero outgoing weights). With
`width == len(assignment)` this is a plain permutation. Layer ℓ+1 reads layer ℓ in blocks (one column
after a dense layer, the kh·kw taps of a conv input channel, the H·W columns a conv channel becomes after
flatten); the block is `in_columns / width_ℓ`, so reshaping to (out, width_ℓ, block) moves whole blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedbroker.aggregators.alignment.base import Layer, Network


def check_assignment(assignment: np.ndarray, n_units: int, width: int, what: str = "assignment") -> np.ndarray:
    """An injective int map of n_units units into range(width), or a ValueError saying what is wrong."""
    a = np.asarray(assignment)
    if a.shape != (n_units,) or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{what} must be {n_units} integers; got shape {a.shape}, dtype {a.dtype}")
    if n_units and (a.min() < 0 or a.max() >= width):
        raise ValueError(f"{what} maps outside 0..{width - 1}")
    if np.unique(a).size != n_units:
        raise ValueError(f"{what} maps two units to the same global index")
    return a.astype(np.intp)


def scatter_outputs(layer: Layer, assignment: np.ndarray, width: int | None = None) -> Layer:
    """Rows (units) of `layer` moved to `assignment`; `width` defaults to len(assignment)."""
    n = layer.weight.shape[0]
    width = n if width is None else width
    a = check_assignment(assignment, n, width)
    weight = np.zeros((width,) + layer.weight.shape[1:], dtype=layer.weight.dtype)
    weight[a] = layer.weight
    bias = None
    if layer.bias is not None:
        bias = np.zeros(width, dtype=layer.bias.dtype)
        bias[a] = layer.bias
    channels = {}
    for name, value in layer.channels.items():  # an attached norm's scale and shift move with their unit
        moved = np.zeros(width, dtype=value.dtype)
        moved[a] = value
        channels[name] = moved
    return Layer(weight, bias, channels)


def scatter_inputs(layer: Layer, assignment: np.ndarray, width: int | None = None) -> Layer:
    """Input blocks of `layer` moved the same way its predecessor's units were."""
    n_prev = np.asarray(assignment).shape[0]
    width = n_prev if width is None else width
    a = check_assignment(assignment, n_prev, width)
    w = layer.weight
    if w.shape[1] % n_prev:
        raise ValueError(f"layer reads {w.shape[1]} inputs, not a multiple of the {n_prev} units moved")
    blocks = w.reshape(w.shape[0], n_prev, -1)
    moved = np.zeros((w.shape[0], width, blocks.shape[2]), dtype=w.dtype)
    moved[:, a] = blocks
    shape = (w.shape[0], width) + w.shape[2:] if w.ndim > 2 else (w.shape[0], width * blocks.shape[2])
    return Layer(moved.reshape(shape), layer.bias, layer.channels)


def permute_units(network: Sequence[Layer], layer_index: int, assignment: np.ndarray, width: int | None = None) -> Network:
    """Move layer `layer_index`'s units and, as its companion, the next layer's input blocks.

    With a true permutation the network computes the same function; scattered into a wider layer it
    still does (the new units are silent).
    """
    net = list(network)
    net[layer_index] = scatter_outputs(net[layer_index], assignment, width)
    if layer_index + 1 < len(net):
        net[layer_index + 1] = scatter_inputs(net[layer_index + 1], assignment, width)
    return net


def apply_permutations(
    network: Sequence[Layer], assignments: Sequence[np.ndarray], widths: Sequence[int] | None = None
) -> Network:
    """`assignments[ℓ]` applied to hidden layer ℓ (ℓ = 0, 1, …), each with its companion."""
    net = list(network)
    for ell, a in enumerate(assignments):
        net = permute_units(net, ell, a, None if widths is None else widths[ell])
    return net
