"""How a round's updates were chosen and judged, in words, from the close's stats: the aggregation service logs
it and the coordinator records it as the round's events, so a job shows, round by round, whether the genetic
algorithm or a random draw chose (`selection_*`, `accepted`, `selected`, `aggregated`), and which updates a
robust rule discarded or down-weighted (`robust_kept:<worker>`), and which sites a secure round excluded
(`secure_excluded:<worker>`)."""

from __future__ import annotations

from collections.abc import Mapping

from fedbroker.robust_params import DISCARDED_BELOW, DOWNWEIGHTED_BELOW

ROBUST_KEPT = "robust_kept:"
"""Stats key prefix: per update a robust rule judged, the weight it kept over what the plain mean would give."""

EXCLUDED_STAT = "secure_excluded:"
"""Stats key prefix: a site a secure round excluded because the protocol proved what it sent wrong (its shares
failed at a recipient before training, were malformed, or a share it revealed was not its dealer's)."""


def secure_note(stats: Mapping[str, float]) -> str:
    """The sites a secure round excluded, in words ("" when none)."""
    named = sorted(k[len(EXCLUDED_STAT):] for k in stats if k.startswith(EXCLUDED_STAT))
    return (f"secure aggregation excluded {', '.join(named)}: what it sent failed the protocol's checks (its shares, "
            f"or a share it revealed; the aggregation service's log says which)") if named else ""


def selection_note(round_number: int, stats: Mapping[str, float]) -> str:
    """The choice of round `round_number` in words; "" when every accepted update was aggregated by a selection
    that does not choose (`all`)."""
    accepted = int(stats.get("accepted", 0))
    aggregated = int(stats.get("selected", stats.get("aggregated", 0)))  # a robust rule's discards come after
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


def robust_verdicts(stats: Mapping[str, float]) -> dict[str, tuple[str, float]]:
    """The updates a robust rule discarded or down-weighted: worker → (verdict, kept/expected ratio)."""
    out = {}
    for key, ratio in stats.items():
        if key.startswith(ROBUST_KEPT):
            if ratio < DISCARDED_BELOW:
                out[key[len(ROBUST_KEPT):]] = ("discarded", float(ratio))
            elif ratio < DOWNWEIGHTED_BELOW:
                out[key[len(ROBUST_KEPT):]] = ("down-weighted", float(ratio))
    return dict(sorted(out.items()))


def robust_note(rule: str, stats: Mapping[str, float]) -> str:
    """What the robust rule `rule` did to the round's updates in words ("" when it kept every one at half its
    share or more, or the job has no rule)."""
    verdicts = robust_verdicts(stats)
    if rule == "none" or not verdicts:
        return ""
    parts = []
    for verdict in ("discarded", "down-weighted"):
        named = [f"{w} ({ratio:.0%} of its share)" for w, (v, ratio) in verdicts.items() if v == verdict]
        if named:
            parts.append(f"{verdict} {', '.join(named)}")
    return f"{rule} {'; '.join(parts)}"
