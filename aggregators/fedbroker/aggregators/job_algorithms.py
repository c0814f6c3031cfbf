"""A job's algorithms, built once from its typed settings when the service learns the job (`Job.algorithms_for`)
and reused by every round: the implementations the registries bind to the catalogue's names."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from fedbroker.aggregators.alignment import ALIGNMENT, Alignment
from fedbroker.aggregators.robust import ROBUST, RobustRule
from fedbroker.aggregators.selection import SELECTION, Selector
from fedbroker.aggregators.weighting import WEIGHTING, Weighting
from fedbroker.catalogue import AggregationSettings, aggregation_settings
from fedbroker.errors import ConfigErrors
from fedbroker.spec import AggregationConfig
from fedbroker.submission import robust_problems


@dataclass(frozen=True)
class Algorithms:
    """A job's algorithm objects and the typed settings they were built from (its traits included)."""

    source: str                    # the aggregation section they were built from, as canonical JSON
    settings: AggregationSettings
    alignment: Alignment
    weighting: Weighting
    selection: Selector
    robust: RobustRule
    max_update_value: float = 0.0  # aggregation.max_update_value (admission.value_limit)

    def built_from(self, config: AggregationConfig) -> bool:
        """Whether `config` is the section these were built from (a job whose settings changed rebuilds)."""
        return self.source == _canonical(config)


def build_algorithms(config: AggregationConfig) -> Algorithms:
    """Raises every bad name or parameter of the four algorithms at once, and a robust rule beside an alignment
    or secure aggregation (which the coordinator refuses at submission too)."""
    settings = aggregation_settings(config)
    problems = robust_problems(config, None)
    if problems:
        raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
    return Algorithms(_canonical(config), settings, ALIGNMENT.build(settings.alignment),
                      WEIGHTING.build(settings.weighting), SELECTION.build(settings.selection),
                      ROBUST.build(settings.robust), config.max_update_value)


def _canonical(config: AggregationConfig) -> str:
    return json.dumps(asdict(config), sort_keys=True, default=repr)
