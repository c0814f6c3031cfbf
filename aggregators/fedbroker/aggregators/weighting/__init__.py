"""Per-update aggregation weights, chosen by registry name (`fedavg`, `uniform`, `dwfed`)."""

from fedbroker.aggregators.weighting.base import WEIGHTING, UpdateMeta, Weighting, normalise_weights
from fedbroker.aggregators.weighting.dwfed import (
    ISH_FORMS,
    DWFedWeighting,
    emd,
    ish,
    label_distribution,
    population_distribution,
    reported_ish,
)
from fedbroker.aggregators.weighting.fedavg import FedAvgWeighting, UniformWeighting
from fedbroker.aggregators.weighting.privacy import noisy_histogram

__all__ = [
    "ISH_FORMS",
    "WEIGHTING",
    "DWFedWeighting",
    "FedAvgWeighting",
    "UniformWeighting",
    "UpdateMeta",
    "Weighting",
    "emd",
    "ish",
    "label_distribution",
    "noisy_histogram",
    "normalise_weights",
    "population_distribution",
    "reported_ish",
]
