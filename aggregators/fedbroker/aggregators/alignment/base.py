"""Shared types of the alignment algorithms, the checks every one runs first, and FedAvg (`none`).

A network is a list of `Layer`s, input → output. A dense weight is `(out, in)` as in PyTorch, a conv
weight `(out, c_in, *kernel)` (Conv1d, 2d or 3d). Layer ℓ+1 reads layer ℓ's outputs in *blocks*: one column per unit after a
dense layer, `kh·kw` taps after a conv feeding a conv, `H·W` columns after a conv feeding flatten→dense.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from numbers import Integral
from typing import Any, Protocol

import numpy as np

from fedbroker.algorithms.params import NoAlignmentParams


@dataclass(frozen=True)
class Layer:
    """One weighted layer of a client's network, as the alignment algorithms see it.

    `channels` holds per-unit tensors that travel with the layer's units: the scale and shift of a
    per-channel norm after it (a BatchNorm trained as GroupNorm with one channel per group), by tensor name,
    each of shape (out,). They are permuted with the units and averaged with them (NAFI Appendix E attaches
    BatchNorm to its conv; see fedbroker.job.alignment_plan)."""

    weight: np.ndarray  # dense (out, in) like PyTorch; conv (out, c_in, kh, kw)
    bias: np.ndarray | None  # (out,)
    channels: Mapping[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class AlignmentResult:
    """The aligned global network, how each client's units map into it, and numbers for the close's stats."""

    layers: list[Layer]  # the global network, input → output
    permutations: list[list[np.ndarray]]  # per client, per aligned hidden layer (the first ones, in order)
    widths: list[int]  # output width of every layer of the global network
    stats: dict[str, float]


Network = list[Layer]


@dataclass(frozen=True)
class AlignInput:
    """One round's alignment problem, as one object so every algorithm takes one argument.

    `clients`: each client's network, input → output. `weights`: one coefficient per client. `class_shares`:
    (clients × classes) label histograms for the output layer (PFNM/NAFI). `spatial`: the `H·W` block of each
    layer's outputs where a conv feeds flatten→dense. `deadline` (a time.monotonic() value) is cooperative:
    an alignment checks it inside its loops and raises `DeadlinePassed`; the service then falls back to the
    plain weighted mean. `current`: the global network the round's clients started from (the layer-wise mode
    keeps its frozen layers and matches the next one).
    """

    clients: Sequence[Sequence[Layer]]
    weights: np.ndarray
    rng: np.random.Generator
    round_index: int = 1
    class_shares: np.ndarray | None = None
    spatial: Sequence[int | None] | None = None
    deadline: float | None = None
    current: Sequence[Layer] | None = None

    def checked(self, *, same_widths: bool) -> CheckedInput:
        """float64 copies of the networks and the weights normalised to sum 1, or a ValueError naming the
        client and layer at fault (`same_widths=False`, PFNM/NAFI, still requires the same input, output,
        kernels and blocks)."""
        nets = validate_clients(self.clients, same_widths=same_widths, spatial=self.spatial)
        return CheckedInput(nets=nets, weights=validate_weights(self.weights, len(nets)),
                            class_shares=self.class_shares)

    def with_clients(self, clients: Sequence[Sequence[Layer]]) -> AlignInput:
        """The same problem over other networks (layer-wise matching's retrained clients)."""
        return replace(self, clients=clients)


@dataclass(frozen=True)
class CheckedInput:
    """An `AlignInput` past its checks: what the arithmetic reads."""

    nets: list[Network]
    weights: np.ndarray
    class_shares: np.ndarray | None

    def shares(self) -> np.ndarray:
        """(clients × classes) shares of each output class, each column normalised over clients."""
        return validate_class_shares(self.class_shares, self.weights, self.nets[0][-1].weight.shape[0])


class Alignment(Protocol):
    """What the aggregation service calls; every registered alignment extends its parameters' frozen kw-only
    dataclass (`fedbroker.algorithms.params`)."""

    def align(self, problem: AlignInput) -> AlignmentResult:
        """The global network of the clients' networks, aggregated with the problem's weights."""


class DeadlinePassed(RuntimeError):
    """An alignment ran past its cooperative deadline and stopped; the caller falls back (see combine)."""


def check_deadline(deadline: float | None, what: str) -> None:
    """Raise DeadlinePassed when `deadline` (a time.monotonic() value) has passed: the algorithms call this
    inside their loops, so a close stops within one step of its time limit."""
    if deadline is not None and time.monotonic() > deadline:
        raise DeadlinePassed(f"{what} passed its time limit")


# ---------------------------------------------------------------- input checks


def _as_layer(layer: Any, k: int, ell: int) -> Layer:
    where = f"client {k} layer {ell}"
    try:
        weight = np.asarray(layer.weight, dtype=np.float64)
        bias = None if layer.bias is None else np.asarray(layer.bias, dtype=np.float64)
    except AttributeError:
        raise ValueError(f"{where}: expected a Layer with .weight and .bias, got {type(layer).__name__}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: weights are not numeric ({exc})") from None
    if not 2 <= weight.ndim <= 5:
        raise ValueError(f"{where}: weight must be 2-D (dense) or 3- to 5-D (Conv1d/2d/3d); got shape {weight.shape}")
    if weight.size == 0:
        raise ValueError(f"{where}: weight is empty (shape {weight.shape})")
    if not np.all(np.isfinite(weight)):
        raise ValueError(f"{where}: weight contains NaN or infinite values")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"{where}: bias shape {bias.shape} does not match {weight.shape[0]} outputs")
        if not np.all(np.isfinite(bias)):
            raise ValueError(f"{where}: bias contains NaN or infinite values")
    channels = {}
    for name, value in dict(getattr(layer, "channels", {}) or {}).items():
        arr = np.asarray(value, dtype=np.float64)
        if arr.shape != (weight.shape[0],):
            raise ValueError(f"{where}: {name} has shape {arr.shape}; it must hold one value per each of the "
                             f"{weight.shape[0]} units")
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{where}: {name} contains NaN or infinite values")
        channels[name] = arr
    return Layer(weight, bias, channels)


def _check_chain(net: Network, k: int, spatial: Sequence[int | None] | None) -> None:
    """Layer ℓ+1 must read exactly layer ℓ's outputs (in blocks), or permuting ℓ cannot be compensated."""
    for ell in range(1, len(net)):
        prev, cur = net[ell - 1], net[ell]
        n_prev, where = prev.weight.shape[0], f"client {k} layer {ell}"
        if cur.weight.ndim > 2:
            if prev.weight.ndim == 2:
                raise ValueError(f"{where}: a convolution cannot follow a dense layer")
            if cur.weight.shape[1] != n_prev:
                raise ValueError(f"{where}: reads {cur.weight.shape[1]} channels, layer {ell - 1} has {n_prev}")
            continue
        n_in = cur.weight.shape[1]
        block = spatial[ell - 1] if spatial is not None else None
        if prev.weight.ndim == 2 or block is None:
            ok = n_in == n_prev if prev.weight.ndim == 2 else n_in % n_prev == 0
        else:
            ok = n_in == n_prev * block
        if not ok:
            raise ValueError(
                f"{where}: {n_in} inputs do not match layer {ell - 1}'s {n_prev} outputs"
                + (f" × spatial {block}" if block is not None else "")
            )


def validate_clients(
    clients: Sequence[Sequence[Layer]],
    *,
    same_widths: bool,
    spatial: Sequence[int | None] | None = None,
) -> list[Network]:
    """float64 copies of the clients' networks, or a ValueError naming the client and layer at fault.

    `same_widths=False` (PFNM/NAFI) still requires the same input, output, kernels and blocks.
    """
    if len(clients) == 0:
        raise ValueError("no clients to align")
    nets: list[Network] = []
    for k, client in enumerate(clients):
        net = [_as_layer(layer, k, ell) for ell, layer in enumerate(client)]
        if not net:
            raise ValueError(f"client {k}: network has no layers")
        if nets and len(net) != len(nets[0]):
            raise ValueError(f"client {k}: has {len(net)} layers, client 0 has {len(nets[0])}")
        nets.append(net)
    n_layers = len(nets[0])
    if spatial is not None:
        if len(spatial) != n_layers:
            raise ValueError(f"spatial has {len(spatial)} entries; the network has {n_layers} layers")
        for ell, hw in enumerate(spatial):
            if hw is not None and (not isinstance(hw, Integral) or hw < 1):
                raise ValueError(f"spatial[{ell}] must be a positive integer or None; got {hw!r}")
    for k, net in enumerate(nets):
        _check_chain(net, k, spatial)
    ref = nets[0]
    for k, net in enumerate(nets[1:], start=1):
        for ell, (a, b) in enumerate(zip(ref, net)):
            where = f"client {k} layer {ell}"
            if (a.bias is None) != (b.bias is None):
                raise ValueError(f"{where}: bias presence differs from client 0")
            if sorted(a.channels) != sorted(b.channels):
                raise ValueError(f"{where}: per-unit tensors {sorted(b.channels)} differ from client 0's "
                                 f"{sorted(a.channels)}")
            if same_widths:
                if a.weight.shape != b.weight.shape:
                    raise ValueError(
                        f"{where}: weight shape {b.weight.shape} differs from client 0's {a.weight.shape}"
                        " (this alignment needs equal widths)"
                    )
                continue
            if a.weight.ndim != b.weight.ndim or a.weight.shape[2:] != b.weight.shape[2:]:
                raise ValueError(f"{where}: layer kind or kernel {b.weight.shape} differs from client 0's {a.weight.shape}")
            if ell == 0 and a.weight.shape[1:] != b.weight.shape[1:]:
                raise ValueError(f"{where}: input shape {b.weight.shape[1:]} differs from client 0's {a.weight.shape[1:]}")
            if ell > 0 and a.weight.shape[1] // ref[ell - 1].weight.shape[0] != b.weight.shape[1] // net[ell - 1].weight.shape[0]:
                raise ValueError(f"{where}: spatial block of its inputs differs from client 0's")
            if ell == n_layers - 1 and a.weight.shape[0] != b.weight.shape[0]:
                raise ValueError(f"{where}: {b.weight.shape[0]} outputs, client 0 has {a.weight.shape[0]}")
    return nets


def validate_weights(weights: Any, n_clients: int) -> np.ndarray:
    """Aggregation coefficients, renormalised to sum to 1."""
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (n_clients,):
        raise ValueError(f"weights has shape {w.shape}; expected ({n_clients},), one per client")
    if not np.all(np.isfinite(w)) or np.any(w < 0):
        raise ValueError("weights must be finite and non-negative")
    total = float(w.sum())
    if total <= 0:
        raise ValueError("weights sum to zero")
    return w / total


def validate_class_shares(class_shares: Any, weights: np.ndarray, n_classes: int) -> np.ndarray:
    """(clients × classes), each column normalised over clients; `weights` stand in where none are given."""
    n_clients = weights.shape[0]
    if class_shares is None:
        return np.repeat(weights[:, None], n_classes, axis=1)
    p = np.asarray(class_shares, dtype=np.float64)
    if p.shape != (n_clients, n_classes):
        raise ValueError(f"class_shares has shape {p.shape}; expected ({n_clients}, {n_classes})")
    if not np.all(np.isfinite(p)) or np.any(p < 0):
        raise ValueError("class_shares must be finite and non-negative")
    totals = p.sum(axis=0)
    empty = totals <= 0
    p = np.where(empty[None, :], weights[:, None], p / np.where(empty, 1.0, totals)[None, :])
    return p


# ---------------------------------------------------------------- FedAvg


def weighted_mean_layers(nets: Sequence[Network], weights: np.ndarray) -> Network:
    """Σ_k w_k·layer_k as a running sum: one global-sized accumulator, whatever the number of clients."""
    acc_w = [np.zeros_like(layer.weight) for layer in nets[0]]
    acc_b = [None if layer.bias is None else np.zeros_like(layer.bias) for layer in nets[0]]
    acc_c = [{name: np.zeros_like(value) for name, value in layer.channels.items()} for layer in nets[0]]
    for net, w in zip(nets, weights):
        for ell, layer in enumerate(net):
            acc_w[ell] += w * layer.weight
            b = acc_b[ell]
            if b is not None and layer.bias is not None:
                b += w * layer.bias
            for name, value in layer.channels.items():
                acc_c[ell][name] += w * value
    return [Layer(w_, b_, c_) for w_, b_, c_ in zip(acc_w, acc_b, acc_c)]


def identity_permutations(nets: Sequence[Network], n_aligned: int) -> list[list[np.ndarray]]:
    """Every client keeps its unit order: the alignment of a round that matches nothing."""
    return [[np.arange(net[ell].weight.shape[0]) for ell in range(n_aligned)] for net in nets]


def widths_of(layers: Sequence[Layer]) -> list[int]:
    """The output width of each layer (a matched layer may grow)."""
    return [int(layer.weight.shape[0]) for layer in layers]


class NoAlignment(NoAlignmentParams):
    """`none`: the plain weighted mean (FedAvg) of every layer; unit i of every client is unit i."""

    def align(self, problem: AlignInput) -> AlignmentResult:
        """The weighted mean of every layer."""
        given = problem.checked(same_widths=True)
        layers = weighted_mean_layers(given.nets, given.weights)  # one pass, no loop worth a deadline
        return AlignmentResult(
            layers=layers,
            permutations=identity_permutations(given.nets, len(layers) - 1),
            widths=widths_of(layers),
            stats={"aligned_layers": 0.0},
        )
