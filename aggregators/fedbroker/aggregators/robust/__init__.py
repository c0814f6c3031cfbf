"""Robust aggregation rules over a round's individual updates, chosen by registry name (`aggregation.robust`):
`none`, `median`, `trimmed_mean`, `multi_krum`, `geometric_median`, `norm_bound`, `fltrust`, `centered_clipping`,
`history_check`; each behind an optional pre-mix (`premix: bucketing | nnm`)."""

from fedbroker.aggregators.robust.base import (
    ROBUST,
    RobustInput,
    RobustResult,
    RobustRule,
    RootRequest,
    check_updates,
)
from fedbroker.aggregators.robust.bounded import FLTrust, NormBound, NoRobust
from fedbroker.aggregators.robust.centered import CenteredClipping
from fedbroker.aggregators.robust.coordinatewise import Median, TrimmedMean, trimmed
from fedbroker.aggregators.robust.geomed import GeometricMedian, weiszfeld
from fedbroker.aggregators.robust.history import HistoryCheck
from fedbroker.aggregators.robust.krum import MultiKrum, krum_scores
from fedbroker.aggregators.robust.memory import RobustMemory, SiteRecord, memory_arrays, memory_from_arrays

__all__ = [
    "ROBUST",
    "CenteredClipping",
    "FLTrust",
    "GeometricMedian",
    "HistoryCheck",
    "Median",
    "MultiKrum",
    "NoRobust",
    "NormBound",
    "RobustInput",
    "RobustMemory",
    "RobustResult",
    "RobustRule",
    "RootRequest",
    "SiteRecord",
    "TrimmedMean",
    "check_updates",
    "krum_scores",
    "memory_arrays",
    "memory_from_arrays",
    "trimmed",
    "weiszfeld",
]
