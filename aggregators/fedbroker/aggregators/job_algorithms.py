"""A job's algorithms, built once from its installed settings (`installed_jobs`) and reused by every round: the
implementations the registries bind to the catalogue's names."""

from __future__ import annotations

from dataclasses import dataclass

from fedbroker.aggregators.alignment import ALIGNMENT, Alignment
from fedbroker.aggregators.robust import ROBUST, RobustRule
from fedbroker.aggregators.selection import SELECTION, Selector
from fedbroker.aggregators.site_dp import check_job
from fedbroker.aggregators.weighting import WEIGHTING, Weighting
from fedbroker.algorithms.catalogue import AggregationSettings
from fedbroker.job.settings import InstalledJob


@dataclass(frozen=True)
class Algorithms:
    """A job's algorithm objects and the settings they were built from (its traits included)."""

    installed: InstalledJob
    alignment: Alignment
    weighting: Weighting
    selection: Selector
    robust: RobustRule
    max_update_value: float = 0.0  # aggregation.max_update_value (admission.value_limit)

    @property
    def settings(self) -> AggregationSettings:
        """The typed aggregation settings (each kind's checked parameters and traits)."""
        return self.installed.algorithms


def build_algorithms(installed: InstalledJob) -> Algorithms:
    """The registries' implementations of the job's four choices (already checked by `parse_settings`)."""
    settings = installed.algorithms
    if installed.privacy.site.enabled:  # refused at install, naming the field, before any round
        check_job(installed.privacy.site, weighting=settings.weighting.name, selection=settings.selection.name,
                  robust=settings.robust.name, alignment=settings.alignment.name)
    return Algorithms(installed, ALIGNMENT.build(settings.alignment), WEIGHTING.build(settings.weighting),
                      SELECTION.build(settings.selection), ROBUST.build(settings.robust),
                      installed.aggregation.max_update_value)
