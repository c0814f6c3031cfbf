"""The algorithms a job may name, per kind: their typed parameters and the traits they declare.

The catalogue is what the coordinator, the workers and the aggregation service agree on: a job chooses an
alignment, a weighting, a selection and a robust rule by these names (never by dotted class paths), the coordinator
validates them here at submission, and the aggregation service binds an implementation to every name
(`fedbroker.aggregators.registry`; a contract test holds the two lists equal). What the service must know
of an algorithm (does it need every update at once? are its weights always positive?) is a declared
trait, read instead of the algorithm's name or class.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from fedbroker.algorithms.params import (
    AlignmentParams,
    AllParams,
    DWFedParams,
    FedAvgParams,
    FedDNAParams,
    GeneticParams,
    NAFIParams,
    NoAlignmentParams,
    ParamErrors,
    PFNMParams,
    RandomParams,
    SelectionParams,
    UniformParams,
    WeightingParams,
)
from fedbroker.algorithms.robust_params import (
    CenteredClippingParams,
    FLTrustParams,
    GeometricMedianParams,
    HistoryCheckParams,
    MedianParams,
    MultiKrumParams,
    NormBoundParams,
    NoRobustParams,
    RobustParams,
    TrimmedMeanParams,
)
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.spec import AggregationConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

P = TypeVar("P", bound="DataclassInstance")


@dataclass(frozen=True)
class Traits:
    """What an algorithm asks of the aggregation service, declared with its name."""

    needs_update_set: bool = False   # every update of the round at once: no running mean, no asynchronous mode
    aligns_units: bool = False       # alignment: matches units across clients (the model must allow it)
    needs_histograms: bool = False   # reads the sites' label histograms (class shares; DWFed's population P):
                                     # a job with such an algorithm asks its sites for them before round 1
    weights_positive: bool = False   # weighting: every valid update's raw weight is > 0
    resizes_layers: bool = False     # alignment: the global width of a matched layer is inferred and may change


@dataclass(frozen=True)
class Entry(Generic[P]):
    """One name of a kind: the class of its parameters and its traits."""

    params: type[P]
    traits: Traits = Traits()


@dataclass(frozen=True)
class Choice(Generic[P]):
    """One kind's algorithm as a job chose it: its name, its checked parameters and its traits."""

    name: str
    params: P
    traits: Traits


class Catalogue(Generic[P]):
    """The names of one kind. An unknown name, an unknown or missing parameter and a bad value each raise a
    ConfigError naming the field (`aggregation.<kind>_params.<name>`), so a typo in a job is caught at
    submission, not in round 7."""

    def __init__(self, kind: str, entries: Mapping[str, Entry[P]]) -> None:
        self.kind = kind
        self._entries = dict(entries)

    def names(self) -> list[str]:
        """The known names, sorted."""
        return sorted(self._entries)

    def entry(self, name: str) -> Entry[P]:
        """The entry of `name`; a ConfigError listing the known names for any other."""
        try:
            return self._entries[name]
        except KeyError:
            raise ConfigError(
                f"aggregation.{self.kind}",
                f"unknown {self.kind} algorithm {name!r}; known: {', '.join(self.names())}",
            ) from None

    def traits(self, name: str) -> Traits | None:
        """The traits of `name` (None for an unknown name, which `entry` reports)."""
        entry = self._entries.get(name)
        return entry.traits if entry is not None else None

    def choose(self, name: str, params: Mapping[str, Any] | None = None) -> Choice[P]:
        """`name` with `params` checked into its parameter class; every unknown, missing or bad parameter is
        raised at once, each named by its path."""
        entry = self.entry(name)
        given = dict(params or {})
        fields = [f for f in dataclasses.fields(entry.params) if f.init]
        known = {f.name for f in fields}
        where = f"aggregation.{self.kind}_params"
        problems = [ConfigError(f"{where}.{key}", f"unknown parameter for {self.kind} {name!r}; known: "
                                                  f"{', '.join(sorted(known)) or 'none'}")
                    for key in sorted(set(given) - known)]
        required = sorted(f.name for f in fields if f.name not in given and f.default is dataclasses.MISSING
                          and f.default_factory is dataclasses.MISSING)
        problems += [ConfigError(f"{where}.{key}", f"required for {self.kind} {name!r} ({', '.join(required)} "
                                                   f"must be given)") for key in required]
        if not problems:
            try:
                return Choice(name, entry.params(**given), entry.traits)
            except ParamErrors as exc:
                problems = [self._named(name, e, known) for e in exc.errors]
            except (TypeError, ValueError) as exc:
                problems = [self._named(name, exc, known)]
        raise problems[0] if len(problems) == 1 else ConfigErrors(problems)

    def _named(self, name: str, exc: Exception, known: set[str]) -> ConfigError:
        """A parameter class's error under its field's path (its message starts with the parameter's name)."""
        if isinstance(exc, ConfigError):
            return exc
        first = str(exc).split(" ", 1)[0]
        where = f"aggregation.{self.kind}_params" + (f".{first}" if first in known else "")
        return ConfigError(where, f"{name}: {exc}")


_ALIGNS = Traits(needs_update_set=True, aligns_units=True)
_MATCHES = Traits(needs_update_set=True, aligns_units=True, needs_histograms=True, resizes_layers=True)

ALIGNMENTS: Catalogue[AlignmentParams] = Catalogue("alignment", {
    "none": Entry(NoAlignmentParams),
    "feddna": Entry(FedDNAParams, _ALIGNS),
    "pfnm": Entry(PFNMParams, _MATCHES),
    "nafi": Entry(NAFIParams, _MATCHES),
})
WEIGHTINGS: Catalogue[WeightingParams] = Catalogue("weighting", {
    "fedavg": Entry(FedAvgParams, Traits(weights_positive=True)),
    "uniform": Entry(UniformParams, Traits(weights_positive=True)),
    "dwfed": Entry(DWFedParams, Traits(needs_histograms=True)),  # P: a worker far from it may weigh 0
})
SELECTIONS: Catalogue[SelectionParams] = Catalogue("selection", {
    "all": Entry(AllParams),
    "random": Entry(RandomParams, Traits(needs_update_set=True)),
    "ga": Entry(GeneticParams, Traits(needs_update_set=True)),
})
_INDIVIDUAL = Traits(needs_update_set=True)  # a robust rule reads every update apart: no running mean
ROBUST_RULES: Catalogue[RobustParams] = Catalogue("robust", {
    "none": Entry(NoRobustParams),
    "median": Entry(MedianParams, _INDIVIDUAL),
    "trimmed_mean": Entry(TrimmedMeanParams, _INDIVIDUAL),
    "multi_krum": Entry(MultiKrumParams, _INDIVIDUAL),
    "geometric_median": Entry(GeometricMedianParams, _INDIVIDUAL),
    "norm_bound": Entry(NormBoundParams, _INDIVIDUAL),
    "fltrust": Entry(FLTrustParams, _INDIVIDUAL),
    "centered_clipping": Entry(CenteredClippingParams, _INDIVIDUAL),
    "history_check": Entry(HistoryCheckParams, _INDIVIDUAL),
})


@dataclass(frozen=True)
class AggregationSettings:
    """A job's aggregation section, typed: each kind's choice with its parameters and traits."""

    alignment: Choice[AlignmentParams]
    weighting: Choice[WeightingParams]
    selection: Choice[SelectionParams]
    robust: Choice[RobustParams]

    @property
    def incremental(self) -> bool:
        """True when every accepted update can be folded into a running mean and then dropped (not when an
        algorithm or a robust rule needs the whole set, nor when a `max_share` cap makes the coefficients depend
        on it)."""
        return (not self.alignment.traits.needs_update_set and not self.selection.traits.needs_update_set
                and not self.robust.traits.needs_update_set and self.weighting.params.proportional)

    @property
    def weights_positive(self) -> bool:
        """Whether every valid update's raw weight is > 0 (else a round may fall back to the plain mean)."""
        return self.weighting.traits.weights_positive

    def aggregated(self, participants: int) -> int:
        """K, the number of updates a round of `participants` aggregates (at least 1)."""
        most = self.selection.params.chooses_at_most
        return max(1, participants if most is None else min(participants, most))


def aggregation_settings(config: AggregationConfig) -> AggregationSettings:
    """The typed settings of an aggregation section; every bad name or parameter raised at once."""
    errors: list[ConfigError] = []
    alignment = _choose(ALIGNMENTS, config.alignment, config.alignment_params, errors)
    weighting = _choose(WEIGHTINGS, config.weighting, config.weighting_params, errors)
    selection = _choose(SELECTIONS, config.selection, config.selection_params, errors)
    robust = _choose(ROBUST_RULES, config.robust, config.robust_params, errors)
    if alignment is None or weighting is None or selection is None or robust is None:
        raise errors[0] if len(errors) == 1 else ConfigErrors(errors)
    return AggregationSettings(alignment, weighting, selection, robust)


def needs_histograms(config: AggregationConfig) -> bool:
    """Whether any of the job's algorithms declares that it reads the sites' label histograms: only such a
    job asks its sites for them (an unknown name declares nothing; submission refuses it)."""
    return any(traits is not None and traits.needs_histograms for traits in (
        ALIGNMENTS.traits(config.alignment), WEIGHTINGS.traits(config.weighting), SELECTIONS.traits(config.selection)))


def _choose(catalogue: Catalogue[P], name: str, params: Mapping[str, Any],
            errors: list[ConfigError]) -> Choice[P] | None:
    try:
        return catalogue.choose(name, params)
    except ConfigError as exc:
        errors.extend(getattr(exc, "errors", [exc]))
        return None
