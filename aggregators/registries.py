"""Builds a job's algorithms by registry name, once, so a bad name or parameter fails at submission."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedbroker.errors import ConfigError, ConfigErrors


@dataclass(frozen=True)
class Algorithms:
    alignment_name: str
    alignment: Any
    weighting: Any
    selection_name: str
    selection: Any

    @property
    def weights_positive(self) -> bool:
        """FedAvg and uniform weights are > 0 for every valid update; DWFed's may all be 0."""
        from fedbroker.aggregators.weighting.fedavg import FedAvgWeighting, UniformWeighting

        return isinstance(self.weighting, (FedAvgWeighting, UniformWeighting))

    @property
    def incremental(self) -> bool:
        """True when every accepted update can be folded into a running mean and then dropped."""
        return self.alignment_name == "none" and self.selection_name == "all"


def build_algorithms(config: Any) -> Algorithms:
    """`config` is an AggregationConfig (or anything with the same attributes)."""
    from fedbroker.aggregators.alignment import ALIGNMENT
    from fedbroker.aggregators.selection import SELECTION
    from fedbroker.aggregators.weighting import WEIGHTING

    errors: list[ConfigError] = []
    built: dict[str, Any] = {}
    for kind, registry in (("alignment", ALIGNMENT), ("weighting", WEIGHTING), ("selection", SELECTION)):
        try:
            built[kind] = registry.create(getattr(config, kind), getattr(config, f"{kind}_params"))
        except ConfigError as exc:
            errors.append(exc)
    if errors:
        raise errors[0] if len(errors) == 1 else ConfigErrors(errors)
    return Algorithms(
        alignment_name=config.alignment,
        alignment=built["alignment"],
        weighting=built["weighting"],
        selection_name=config.selection,
        selection=built["selection"],
    )
