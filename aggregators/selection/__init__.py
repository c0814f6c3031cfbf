"""Which received updates to aggregate, chosen by registry name (`all`, `random`, `ga`)."""

from fedbroker.aggregators.selection.base import SELECTION, Candidate, Selection, Selector, ValidationLoss
from fedbroker.aggregators.selection.genetic import (
    LOSS2_MODES,
    Evolution,
    GeneticSelection,
    breed,
    cosine_to_global,
    crossover,
    evolve,
    initial_population,
    mutate,
)
from fedbroker.aggregators.selection.simple import AllSelection, RandomSelection

__all__ = [
    "LOSS2_MODES",
    "SELECTION",
    "AllSelection",
    "Candidate",
    "Evolution",
    "GeneticSelection",
    "RandomSelection",
    "Selection",
    "Selector",
    "ValidationLoss",
    "breed",
    "cosine_to_global",
    "crossover",
    "evolve",
    "initial_population",
    "mutate",
]
