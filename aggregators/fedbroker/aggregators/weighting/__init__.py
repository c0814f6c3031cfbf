"""Per-update aggregation weights, chosen by registry name (`fedavg`, `uniform`, `dwfed`)."""

from fedbroker.aggregators.weighting.base import WEIGHTING, UpdateMeta, Weighting, normalise_weights
from fedbroker.aggregators.weighting.dwfed import DWFedWeighting
from fedbroker.aggregators.weighting.fedavg import FedAvgWeighting, UniformWeighting

__all__ = [
    "WEIGHTING",
    "DWFedWeighting",
    "FedAvgWeighting",
    "UniformWeighting",
    "UpdateMeta",
    "Weighting",
    "normalise_weights",
]
