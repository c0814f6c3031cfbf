"""The kernel's catalogue and the aggregation service's registries agree: every name the coordinator accepts
has an implementation, every implementation has a name, and an implementation is its name's parameters plus
the arithmetic, so the kernel's checks are the whole check."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from fedbroker.aggregators.alignment import ALIGNMENT
from fedbroker.aggregators.registry import Registry
from fedbroker.aggregators.robust import ROBUST
from fedbroker.aggregators.selection import SELECTION
from fedbroker.aggregators.weighting import WEIGHTING
from fedbroker.algorithms.catalogue import (
    ALIGNMENTS,
    ROBUST_RULES,
    SELECTIONS,
    WEIGHTINGS,
    Catalogue,
    Traits,
    aggregation_settings,
)
from fedbroker.algorithms.params import AlignmentParams, FedAvgParams, SelectionParams, WeightingParams
from fedbroker.algorithms.robust_params import RobustParams
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.spec import AggregationConfig

PAIRS: list[tuple[Catalogue[Any], Registry[Any], type]] = [
    (ALIGNMENTS, ALIGNMENT, AlignmentParams), (WEIGHTINGS, WEIGHTING, WeightingParams),
    (SELECTIONS, SELECTION, SelectionParams), (ROBUST_RULES, ROBUST, RobustParams),
]
REQUIRED = {"random": {"m": 2}, "ga": {"m": 2, "fitness": "reported_loss"}, "norm_bound": {"max_norm": 1.0},
            "fltrust": {"probe_dataset": "digits"}}


@pytest.mark.parametrize(("catalogue", "registry", "base"), PAIRS, ids=lambda v: getattr(v, "kind", ""))
def test_the_catalogue_and_the_registry_name_the_same_algorithms(catalogue: Catalogue[Any], registry: Registry[Any],
                                                                 base: type) -> None:
    assert registry.names() == catalogue.names()
    assert registry.kind == catalogue.kind
    for name in catalogue.names():
        params, implementation = catalogue.entry(name).params, registry.get(name)
        assert issubclass(params, base) and issubclass(implementation, params), name
        assert [f.name for f in dataclasses.fields(implementation)] == [f.name for f in dataclasses.fields(params)]


@pytest.mark.parametrize(("catalogue", "registry", "base"), PAIRS, ids=lambda v: getattr(v, "kind", ""))
def test_every_checked_choice_builds_its_implementation(catalogue: Catalogue[Any], registry: Registry[Any],
                                                        base: type) -> None:
    for name in catalogue.names():
        choice = catalogue.choose(name, REQUIRED.get(name))
        built = registry.build(choice)
        assert isinstance(built, registry.get(name)) and built == registry.create(name, REQUIRED.get(name))
        assert dataclasses.asdict(built) == dataclasses.asdict(choice.params)


def test_a_registry_binds_only_catalogue_names_to_their_own_parameters() -> None:
    registry: Registry[Any] = Registry(WEIGHTINGS)
    with pytest.raises(ValueError, match="not in the catalogue"):
        registry.register("median")(FedAvgParams)
    with pytest.raises(TypeError, match="must extend DWFedParams"):
        registry.register("dwfed")(FedAvgParams)
    registry.register("fedavg")(FedAvgParams)
    with pytest.raises(ValueError, match="already registered"):
        registry.register("fedavg")(FedAvgParams)


def test_the_traits_the_service_reads_in_place_of_names() -> None:
    assert ALIGNMENTS.traits("none") == Traits()
    assert ALIGNMENTS.traits("feddna") == Traits(needs_update_set=True, aligns_units=True)
    assert ALIGNMENTS.traits("pfnm") == ALIGNMENTS.traits("nafi") == Traits(
        needs_update_set=True, aligns_units=True, needs_histograms=True, resizes_layers=True)
    assert [n for n in WEIGHTINGS.names() if WEIGHTINGS.entry(n).traits.weights_positive] == ["fedavg", "uniform"]
    assert [n for n in SELECTIONS.names() if SELECTIONS.entry(n).traits.needs_update_set] == ["ga", "random"]
    assert ALIGNMENTS.traits("magic") is None


def test_typed_settings_say_how_a_round_is_aggregated() -> None:
    plain = aggregation_settings(AggregationConfig())
    assert plain.incremental and plain.weights_positive and plain.aggregated(5) == 5
    capped = aggregation_settings(AggregationConfig(weighting="dwfed", weighting_params={"max_share": 0.5,
                                                                                         "ish_form": "one_minus"}))
    assert not capped.incremental and not capped.weights_positive
    assert capped.weighting.params.reported_ish_form == "one_minus"
    chosen = aggregation_settings(AggregationConfig(selection="random", selection_params={"m": 3}))
    assert not chosen.incremental and chosen.aggregated(5) == 3 and chosen.aggregated(2) == 2
    assert chosen.weighting.params.reported_ish_form == "ratio"
    assert aggregation_settings(AggregationConfig()).alignment.name == "none"


def test_every_bad_name_or_parameter_of_a_section_is_reported_at_once() -> None:
    with pytest.raises(ConfigErrors) as info:
        aggregation_settings(AggregationConfig(alignment="magic", weighting_params={"bogus": 1},
                                               selection="random"))
    assert [e.field for e in info.value.errors] == [
        "aggregation.alignment", "aggregation.weighting_params.bogus", "aggregation.selection_params.m"]
    with pytest.raises(ConfigError, match=r"aggregation\.selection_params\.m: random: m must be an integer"):
        SELECTIONS.choose("random", {"m": 0})
