"""One round of the layer-wise scheme (NAFI Appendix D, Algorithm 2; FedMA), as a job mode
(`alignment: {name: nafi, mode: layerwise}`): round r matches layer ℓ = r − 1 of the chain.

The round started from the global network `current`, in which layers 0..ℓ−1 were matched in earlier rounds
and frozen: no site trained them (fedbroker.job.alignment_plan names them; the worker freezes them), so every
site reads layer ℓ's inputs in the same, global order and layer ℓ is matched on its incoming weights and bias
(plus its attached norms) as they are. Then:

- layers 0..ℓ−1 are copied from `current`, never from an upload (a site that changed a frozen layer changes
  nothing; the round counts such uploads in `frozen_changed`);
- layer ℓ is the matched global layer (the engine's MAP neurons; its width may grow);
- each site's layer ℓ+1 has its input blocks moved into the global order of layer ℓ (zeros where the site lacks
  a global unit), and layers ℓ+1.. are the weighted mean of the sites' layers: they keep training in the
  rounds that follow, from this mean (our sites keep no model between rounds, so "the later layers keep
  training locally" restarts each round from their common mean, as FedAvg does);
- in the last round (ℓ = the output layer) the output layer is the per-class weighted average of the sites'
  output layers, by each site's share of each class (Algorithm 2, line 7).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedbroker.aggregators.alignment.base import (
    AlignInput,
    AlignmentResult,
    Layer,
    Network,
    validate_clients,
    validate_weights,
    weighted_mean_layers,
    widths_of,
)
from fedbroker.aggregators.alignment.matching import match_layer
from fedbroker.aggregators.alignment.permute import scatter_inputs
from fedbroker.algorithms.params import MatchingParams


def frozen_changed(nets: Sequence[Network], current: Sequence[Layer], upto: int) -> int:
    """How many clients uploaded layers 0..upto−1 that differ from the global ones they were frozen at."""
    def same(a: Layer, b: Layer) -> bool:
        return (a.weight.shape == b.weight.shape and np.array_equal(a.weight, b.weight)
                and (a.bias is None or (b.bias is not None and np.array_equal(a.bias, b.bias)))
                and all(name in b.channels and np.array_equal(v, b.channels[name]) for name, v in a.channels.items()))

    return sum(1 for net in nets if not all(same(net[i], current[i]) for i in range(upto)))


def _class_average(nets: Sequence[Network], weight_shares: np.ndarray, bias_shares: np.ndarray) -> Layer:
    """The output layer as the per-class average: row c of client k weighs weight_shares[k, c]."""
    row_shape = (-1,) + (1,) * (nets[0][-1].weight.ndim - 1)
    weight = sum(weight_shares[k].reshape(row_shape) * net[-1].weight for k, net in enumerate(nets))
    bias = None
    if nets[0][-1].bias is not None:
        bias = np.asarray(sum(bias_shares[k] * net[-1].bias for k, net in enumerate(nets)))
    channels = {name: np.asarray(sum(bias_shares[k] * net[-1].channels[name] for k, net in enumerate(nets)))
                for name in nets[0][-1].channels}
    return Layer(np.asarray(weight), bias, channels)


def layerwise_round(problem: AlignInput, *, params: MatchingParams, weight_shares: np.ndarray,
                    bias_shares: np.ndarray) -> AlignmentResult:
    """The global network after layer-wise round `problem.round_index` (see the module's docstring).
    `weight_shares`/`bias_shares[k, c]`: client k's normalised weight for class c in the output layer."""
    if problem.current is None:
        raise ValueError("the layer-wise mode needs the round's starting global network (AlignInput.current)")
    nets = validate_clients(problem.clients, same_widths=False, spatial=problem.spatial)
    current = validate_clients([problem.current], same_widths=False, spatial=problem.spatial)[0]
    n_layers = len(nets[0])
    if len(current) != n_layers:
        raise ValueError(f"the global network has {len(current)} layers, the clients {n_layers}")
    ell = problem.round_index - 1
    if not 0 <= ell < n_layers:
        raise ValueError(f"round {problem.round_index} is past the layer-wise scheme's {n_layers} rounds")
    for k, net in enumerate(nets):
        for i in range(ell + 1):
            if net[i].weight.shape[1:] != current[i].weight.shape[1:] or (i < ell and net[i].weight.shape
                                                                           != current[i].weight.shape):
                raise ValueError(f"client {k} layer {i}: shape {net[i].weight.shape} does not fit the global "
                                 f"layer's {current[i].weight.shape}")
    stats = {"layerwise_layer": float(ell), "frozen_changed": float(frozen_changed(nets, current, ell))}
    prefix = [current[i] for i in range(ell)]
    if ell == n_layers - 1:
        layers = prefix + [_class_average(nets, weight_shares, bias_shares)]
        return AlignmentResult(layers=layers, permutations=[[] for _ in nets], widths=widths_of(layers), stats=stats)
    matched, match = match_layer([net[ell] for net in nets], params=params, rng=problem.rng)
    moved = [[scatter_inputs(net[ell + 1], match.assignments[k], match.width)] + list(net[ell + 2:])
             for k, net in enumerate(nets)]
    above = weighted_mean_layers(moved, validate_weights(problem.weights, len(nets)))
    layers = prefix + [matched] + above
    stats[f"global_neurons_layer_{ell}"] = float(match.width)
    return AlignmentResult(layers=layers, permutations=[[match.assignments[k]] for k in range(len(nets))],
                           widths=widths_of(layers), stats=stats)
