"""How a round's updates were chosen, in words, from the close's stats (`selection_*`, `accepted`, `aggregated`):
the aggregation service logs it and the coordinator records it as the round's `selection` event, so a GA job
shows, round by round, whether the genetic algorithm or a random draw chose."""

from __future__ import annotations

from collections.abc import Mapping


def selection_note(round_number: int, stats: Mapping[str, float]) -> str:
    """The choice of round `round_number` in words; "" when every accepted update was aggregated by a selection
    that does not choose (`all`)."""
    accepted, aggregated = int(stats.get("accepted", 0)), int(stats.get("aggregated", 0))
    of = f"{aggregated} of {accepted} update(s)"
    if "selection_ga_round" not in stats:  # random, or all
        return f"{of} chosen at random" if aggregated < accepted else ""
    if stats.get("selection_ga_ran", 0.0):
        fitness = stats.get("selection_fitness")
        return f"the genetic algorithm chose {of}" + (f" (fitness {fitness:.4g})" if fitness is not None else "")
    if stats.get("selection_fallback", 0.0):
        return f"{of} chosen at random: the genetic algorithm ran past the aggregation service's time limit"
    if stats.get("selection_ga_round", 0.0):
        return f"all {accepted} update(s) aggregated: no more arrived than the genetic algorithm chooses (m)"
    return f"{of} chosen at random: round {round_number} is not a GA round (the GA runs every ga_gap-th round)"
