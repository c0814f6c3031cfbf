"""PFNM and NAFI front-ends: one-shot multi-layer matching, and the layer-wise (FedMA / NAFI App. D) driver.

One-shot (`align`), from the top hidden layer down: a neuron of hidden layer c is its bias plus its
outgoing weights re-indexed into the already-matched layer c+1's global order (zeros where the client
lacks a global neuron); layer 0 also carries its incoming weights. Outgoing weights into the output layer
get precision share/σ² per class (each client's share of that class), so the output layer and its bias
are per-class weighted posteriors; `output_weighting="plain"` gives every client's outgoing weights precision
1/σ² instead while the output bias keeps its class shares, as the NAFI authors' code does with use_freq=False
(its process_softmax_bias always reads them). Global widths are inferred and may exceed every client's.

Layer-wise (`align_layerwise`): match layer ℓ on incoming weights + bias, hand the frozen global prefix to
the caller's `retrain` (clients retrain the layers above), repeat; the output layer is the class-share
weighted average of the retrained clients' output layers (under "plain" its weights are their plain mean, its
bias still class-share weighted).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fedbroker.aggregators.alignment.base import (
    AlignInput,
    AlignmentResult,
    Layer,
    Network,
    validate_clients,
    widths_of,
)
from fedbroker.aggregators.alignment.layerwise import layerwise_round
from fedbroker.aggregators.alignment.matching import LayerMatch, channel_prior, match_layer, match_neurons
from fedbroker.aggregators.alignment.permute import scatter_inputs, scatter_outputs
from fedbroker.algorithms.params import OUTPUT_WEIGHTINGS, MatchingParams, NAFIParams, PFNMParams, check_choice

RetrainFn = Callable[[int, list[Layer], list[Network]], Sequence[Sequence[Layer]]]
"""retrain(layer_index, frozen_global_prefix, starts) -> clients.

`frozen_global_prefix` holds global layers 0..layer_index; `starts[k]` is client k's network to resume
from: the prefix, then its own layer_index+1 with input blocks moved into the global order, then its
own layers above. The returned networks must keep the prefix (their shapes are checked).
"""


def _outgoing(next_layer: Layer, n_units: int, next_assignment: np.ndarray | None, next_width: int) -> np.ndarray:
    """Outgoing weights of every unit, next layer's rows moved to its global order: (n_units, width·block)."""
    moved = next_layer if next_assignment is None else scatter_outputs(next_layer, next_assignment, next_width)
    blocks = moved.weight.reshape(next_width, n_units, -1)
    return blocks.transpose(1, 0, 2).reshape(n_units, -1)


def _incoming(outgoing: np.ndarray, next_width: int, template: np.ndarray) -> np.ndarray:
    """Inverse of `_outgoing` for the global network: (width, next_width·block) → next layer's weight."""
    width = outgoing.shape[0]
    blocks = outgoing.reshape(width, next_width, -1).transpose(1, 0, 2)
    shape = (next_width, width) + template.shape[2:] if template.ndim > 2 else (next_width, -1)
    return blocks.reshape(shape)


def _posterior(values: Sequence[np.ndarray], precisions: Sequence[np.ndarray], mu0: float, tau0: float) -> np.ndarray:
    """Precision-weighted posterior mean (μ0·τ0 + Σ τ·v) / (τ0 + Σ τ), elementwise."""
    num = mu0 * tau0 + sum(t * v for t, v in zip(precisions, values))
    den = tau0 + sum(precisions)
    return np.asarray(num / den)


def output_shares(shares: np.ndarray, output_weighting: str, *, normalised: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each client's weight per class in the output layer, (for its weights, for its bias). `class_share`: its
    class shares for both. `plain`: the weights the same for every client (1, a full precision 1/σ², for the
    one-shot posterior; 1/J for the layer-wise average) and the bias still its class shares, as in the NAFI
    authors' code with use_freq=False, whose output bias (process_softmax_bias) always reads them."""
    check_choice("output_weighting", output_weighting, OUTPUT_WEIGHTINGS)
    if output_weighting == "class_share":
        return shares, shares
    return np.full_like(shares, 1.0 / shares.shape[0] if normalised else 1.0), shares


def match_network(
    nets: Sequence[Network], *, params: MatchingParams, shares: np.ndarray, rng: np.random.Generator,
    deadline: float | None = None, bias_shares: np.ndarray | None = None,
) -> tuple[Network, list[LayerMatch]]:
    """One-shot PFNM/NAFI over validated networks; the global network and each hidden layer's match.
    `shares[k, c]` scales client k's precision for class c in the output layer's weights, `bias_shares[k, c]`
    (default: `shares`) in its bias (see `output_shares`).
    `deadline` (time.monotonic()) is checked before every client's assignment (DeadlinePassed)."""
    n_layers = len(nets[0])
    tau, tau0 = 1.0 / params.sigma2, 1.0 / params.sigma0_2
    has_bias = [layer.bias is not None for layer in nets[0]]
    first_shape = nets[0][0].weight.shape
    n_classes = nets[0][-1].weight.shape[0]
    g_weights: list[np.ndarray | None] = [None] * n_layers
    g_biases: list[np.ndarray | None] = [None] * n_layers
    g_channels: list[dict[str, np.ndarray]] = [{} for _ in range(n_layers)]
    matches: list[LayerMatch] = []  # top-down
    next_assign: list[np.ndarray] | None = None  # layer c+1's assignments; None for the output layer
    next_width = n_classes
    for c in reversed(range(n_layers - 1)):
        n_in = int(np.prod(first_shape[1:])) if c == 0 else 0
        names = sorted(nets[0][c].channels)  # an attached norm's per-unit tensors, matched with the unit
        n_lead = n_in + int(has_bias[c]) + len(names)
        vectors, taus = [], []
        for k, net in enumerate(nets):
            n_units = net[c].weight.shape[0]
            a = None if next_assign is None else next_assign[k]
            outgoing = _outgoing(net[c + 1], n_units, a, next_width)
            if next_assign is None:  # into the output layer: precision share[k, class]/σ²
                out_tau = np.repeat(shares[k] * tau, outgoing.shape[1] // next_width)
            else:
                out_tau = np.full(outgoing.shape[1], tau)
            pieces = [net[0].weight.reshape(n_units, -1)] if c == 0 else []
            if has_bias[c]:
                pieces.append(net[c].bias[:, None])  # type: ignore[index]
            pieces.extend(net[c].channels[name][:, None] for name in names)
            vectors.append(np.hstack(pieces + [outgoing]))
            taus.append(np.concatenate([np.full(n_lead, tau), out_tau]))
        prior_mean = np.zeros(vectors[0].shape[1])
        if has_bias[c]:
            prior_mean[n_in] = params.bias_prior_mean
        prior_mean[n_lead - len(names):n_lead] = [channel_prior(name) for name in names]
        match = match_neurons(
            vectors,
            precisions=taus,
            prior_mean=prior_mean,
            prior_precision=np.full(prior_mean.shape[0], tau0),
            params=params,
            rng=rng,
            deadline=deadline,
        )
        theta = match.global_neurons
        if c == 0:
            g_weights[0] = theta[:, :n_in].reshape((match.width,) + first_shape[1:])
        if has_bias[c]:
            g_biases[c] = theta[:, n_in].copy()
        g_channels[c] = {name: theta[:, n_lead - len(names) + i].copy() for i, name in enumerate(names)}
        g_weights[c + 1] = _incoming(theta[:, n_lead:], next_width, nets[0][c + 1].weight)
        matches.append(match)
        next_assign, next_width = match.assignments, match.width
    if has_bias[-1]:  # as the reference code's process_softmax_bias: precision bias_share/σ², prior N(μ_b, σ0²)
        biases = [net[-1].bias[:, None] for net in nets]  # type: ignore[index]
        bias_tau = [(shares if bias_shares is None else bias_shares)[k][:, None] * tau for k in range(len(nets))]
        g_biases[-1] = _posterior(biases, bias_tau, params.bias_prior_mean, tau0)[:, 0]
    if n_layers == 1:  # nothing to match: the output layer's weights are per-class posteriors too
        rows = [net[0].weight.reshape(n_classes, -1) for net in nets]
        g_weights[0] = _posterior(rows, [shares[k][:, None] * tau for k in range(len(nets))], 0.0,
                                  tau0).reshape(first_shape)
    if nets[0][-1].channels:  # a norm after the output layer: per class, like its bias
        g_channels[-1] = {name: _posterior([net[-1].channels[name][:, None] for net in nets],
                                           [(shares if bias_shares is None else bias_shares)[k][:, None] * tau
                                            for k in range(len(nets))], channel_prior(name), tau0)[:, 0]
                          for name in nets[0][-1].channels}
    layers = [Layer(np.asarray(w_), b_, c_) for w_, b_, c_ in zip(g_weights, g_biases, g_channels)]
    return layers, matches[::-1]


class PFNM(PFNMParams):
    """Probabilistic federated neural matching (Yurochkin et al. 2019), defaults of the public code."""

    def align(self, problem: AlignInput) -> AlignmentResult:
        """One-shot matching of every hidden layer, top down (see the module's docstring); in `mode: layerwise`,
        the round's one layer (`fedbroker.aggregators.alignment.layerwise`)."""
        given = problem.checked(same_widths=False)
        if self.layerwise:
            weight_shares, bias_shares = output_shares(given.shares(), self.output_weighting, normalised=True)
            return layerwise_round(problem, params=self.matching_params(), weight_shares=weight_shares,
                                   bias_shares=bias_shares)
        nets, shares, rng, deadline = given.nets, given.shares(), problem.rng, problem.deadline
        weight_shares, bias_shares = output_shares(shares, self.output_weighting, normalised=False)
        layers, matches = match_network(nets, params=self.matching_params(), shares=weight_shares, rng=rng,
                                        deadline=deadline, bias_shares=bias_shares)
        permutations = [[m.assignments[k] for m in matches] for k in range(len(nets))]
        return AlignmentResult(
            layers=layers, permutations=permutations, widths=widths_of(layers), stats=_width_stats(matches)
        )

    def match_layer(self, layers: Sequence[Layer], *, rng: np.random.Generator) -> tuple[Layer, LayerMatch]:
        """Single-layer matching on incoming weights + bias (see `matching.match_layer`)."""
        return match_layer(layers, params=self.matching_params(), rng=rng)

    def align_layerwise(self, problem: AlignInput, retrain: RetrainFn) -> AlignmentResult:
        """Layer-wise matching with the clients retraining in between (see `align_layerwise`)."""
        return align_layerwise(problem, retrain, params=self.matching_params(),
                               output_weighting=self.output_weighting)


class NAFI(NAFIParams, PFNM):
    """PFNM with λ·KL added to the assignment cost (Xiao & Cheng, eq. 14); λ = 0 is PFNM exactly."""


def _width_stats(matches: Sequence[LayerMatch]) -> dict[str, float]:
    stats = {f"global_neurons_layer_{ell}": float(m.width) for ell, m in enumerate(matches)}
    stats["total_global_neurons"] = float(sum(m.width for m in matches))
    return stats


def align_layerwise(problem: AlignInput, retrain: RetrainFn, *, params: MatchingParams,
                    output_weighting: str = "class_share") -> AlignmentResult:
    """FedMA / NAFI Algorithm 2: match one layer, freeze it, let the clients retrain the rest, repeat."""
    given = problem.checked(same_widths=False)
    nets, shares, rng = given.nets, given.shares(), problem.rng
    n_clients, n_layers = len(nets), len(nets[0])
    weight_shares, bias_shares = output_shares(shares, output_weighting, normalised=True)
    prefix: list[Layer] = []
    matches: list[LayerMatch] = []
    for ell in range(n_layers - 1):
        global_layer, match = match_layer([net[ell] for net in nets], params=params, rng=rng)
        prefix.append(global_layer)
        matches.append(match)
        starts = [
            list(prefix) + [scatter_inputs(net[ell + 1], match.assignments[k], match.width)] + net[ell + 2 :]
            for k, net in enumerate(nets)
        ]
        returned = retrain(ell, list(prefix), starts)
        if len(returned) != n_clients:
            raise ValueError(f"retrain({ell}) returned {len(returned)} clients; expected {n_clients}")
        nets = validate_clients(returned, same_widths=False, spatial=problem.spatial)
        for k, net in enumerate(nets):
            for i, frozen in enumerate(prefix):
                if net[i].weight.shape != frozen.weight.shape:
                    raise ValueError(
                        f"client {k} layer {i}: retrain({ell}) returned shape {net[i].weight.shape},"
                        f" the frozen global layer has {frozen.weight.shape}"
                    )
    # output layer: per-class weighted average by each client's share of that class (Algorithm 2, line 7); under
    # "plain" its weights are the plain mean
    row_shape = (-1,) + (1,) * (nets[0][-1].weight.ndim - 1)
    out_w = sum(weight_shares[k].reshape(row_shape) * net[-1].weight for k, net in enumerate(nets))
    out_b = None
    if nets[0][-1].bias is not None:
        out_b = sum(bias_shares[k] * net[-1].bias for k, net in enumerate(nets))
    layers = prefix + [Layer(np.asarray(out_w), None if out_b is None else np.asarray(out_b))]
    permutations = [[m.assignments[k] for m in matches] for k in range(n_clients)]
    return AlignmentResult(layers=layers, permutations=permutations, widths=widths_of(layers), stats=_width_stats(matches))


__all__ = ["NAFI", "PFNM", "RetrainFn", "align_layerwise", "match_network", "output_shares"]
