"""Neuron alignment before aggregation, chosen by registry name (`none`, `feddna`, `pfnm`, `nafi`).

Pure numpy/scipy: every algorithm takes one `AlignInput` (the clients' networks as lists of `Layer`, the
aggregation weights, a seeded `np.random.Generator`, the round and its deadline) and returns an
`AlignmentResult`.
"""

from fedbroker.aggregators.alignment.base import (
    AlignInput,
    Alignment,
    AlignmentResult,
    DeadlinePassed,
    Layer,
    NoAlignment,
)
from fedbroker.aggregators.alignment.bn import fold_batchnorm, fold_batchnorm_layer
from fedbroker.aggregators.alignment.feddna import (
    FedDNA,
    TreeGrowth,
    grow_trees,
    grow_trees_from_distances,
    spanning_costs,
)
from fedbroker.aggregators.alignment.layerwise import layerwise_round
from fedbroker.aggregators.alignment.matching import LayerMatch, assignment_cost, match_layer, match_neurons
from fedbroker.aggregators.alignment.permute import apply_permutations, permute_units, scatter_inputs, scatter_outputs
from fedbroker.aggregators.alignment.pfnm import NAFI, PFNM, RetrainFn, align_layerwise, match_network
from fedbroker.aggregators.registry import Registry
from fedbroker.algorithms.catalogue import ALIGNMENTS
from fedbroker.algorithms.params import MatchingParams

ALIGNMENT: Registry[Alignment] = Registry(ALIGNMENTS)
ALIGNMENT.register("none")(NoAlignment)
ALIGNMENT.register("feddna")(FedDNA)
ALIGNMENT.register("pfnm")(PFNM)
ALIGNMENT.register("nafi")(NAFI)

__all__ = [
    "ALIGNMENT",
    "NAFI",
    "PFNM",
    "AlignInput",
    "Alignment",
    "AlignmentResult",
    "DeadlinePassed",
    "FedDNA",
    "Layer",
    "LayerMatch",
    "MatchingParams",
    "NoAlignment",
    "RetrainFn",
    "TreeGrowth",
    "align_layerwise",
    "apply_permutations",
    "assignment_cost",
    "fold_batchnorm",
    "fold_batchnorm_layer",
    "grow_trees",
    "grow_trees_from_distances",
    "layerwise_round",
    "match_layer",
    "match_network",
    "match_neurons",
    "permute_units",
    "scatter_inputs",
    "scatter_outputs",
    "spanning_costs",
]
