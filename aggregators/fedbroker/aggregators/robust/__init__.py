"""Robust aggregation rules over a round's individual updates, chosen by registry name (`aggregation.robust`):
`none`, `median`, `trimmed_mean`, `multi_krum`, `geometric_median`, `norm_bound`, `fltrust`."""

from fedbroker.aggregators.robust.base import (
    ROBUST,
    RobustInput,
    RobustResult,
    RobustRule,
    RootRequest,
    check_updates,
)
from fedbroker.aggregators.robust.bounded import FLTrust, NormBound, NoRobust
from fedbroker.aggregators.robust.coordinatewise import Median, TrimmedMean, trimmed
from fedbroker.aggregators.robust.geomed import GeometricMedian, weiszfeld
from fedbroker.aggregators.robust.krum import MultiKrum, krum_scores

__all__ = [
    "ROBUST",
    "FLTrust",
    "GeometricMedian",
    "Median",
    "MultiKrum",
    "NoRobust",
    "NormBound",
    "RobustInput",
    "RobustResult",
    "RobustRule",
    "RootRequest",
    "TrimmedMean",
    "check_updates",
    "krum_scores",
    "trimmed",
    "weiszfeld",
]
