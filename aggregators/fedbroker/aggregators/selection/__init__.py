"""Which received updates to aggregate, chosen by registry name (`all`, `random`, `ga`)."""

from fedbroker.aggregators.selection.base import (
    SELECTION,
    Candidate,
    ProbeRequest,
    Selection,
    SelectionInput,
    Selector,
)
from fedbroker.aggregators.selection.genetic import (
    Evolution,
    GeneticSelection,
    breed,
    cosine_to_global,
    crossover,
    evolve,
    initial_population,
    mutate,
)
from fedbroker.aggregators.selection.probe import Probe
from fedbroker.aggregators.selection.simple import AllSelection, RandomSelection

__all__ = [
    "SELECTION",
    "AllSelection",
    "Candidate",
    "Evolution",
    "GeneticSelection",
    "Probe",
    "ProbeRequest",
    "RandomSelection",
    "Selection",
    "SelectionInput",
    "Selector",
    "breed",
    "cosine_to_global",
    "crossover",
    "evolve",
    "initial_population",
    "mutate",
]
