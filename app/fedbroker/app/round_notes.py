"""A close's report in words, for the operator: how a round's updates were chosen, and which a robust rule
discarded or down-weighted. The only place these notes are written; the services pass typed records
(`fedbroker.close_report`) and the coordinator keeps them as a job's `selection` and `robust` events."""

from __future__ import annotations

from collections.abc import Sequence

from fedbroker.close_report import (
    SelectionRecord,
    Verdict,
    judged,
    names_from_json,
    selection_from_json,
    verdicts_from_json,
)


def selection_note(round_number: int, record: SelectionRecord) -> str:
    """The choice of round `round_number` in words; "" when every accepted update was aggregated by a selection
    that does not choose (`all`)."""
    of = f"{record.chosen} of {record.accepted} update(s)"
    if record.method != "ga":
        return f"{of} chosen at random" if record.chosen < record.accepted else ""
    if record.ga_ran:
        return f"the genetic algorithm chose {of}" + (f" (fitness {record.fitness:.4g})"
                                                       if record.fitness is not None else "")
    if record.fallback:
        return f"{of} chosen at random: the genetic algorithm ran past the aggregation service's time limit"
    if record.ga_round:
        return f"all {record.accepted} update(s) aggregated: no more arrived than the genetic algorithm chooses (m)"
    return f"{of} chosen at random: round {round_number} is not a GA round (the GA runs every ga_gap-th round)"


def robust_note(verdicts: Sequence[Verdict]) -> str:
    """What the robust rule did to the round's updates in words ("" when it kept every one at half its share or
    more)."""
    noted = judged(verdicts)
    if not noted:
        return ""
    parts = []
    for judgement in ("flagged", "discarded", "down-weighted"):
        named = [f"{v.worker_id} ({v.ratio:.0%} of its share)" for v in noted if v.judgement == judgement]
        if named:
            parts.append(f"{judgement} {', '.join(named)}")
    return f"{noted[0].rule} {'; '.join(parts)}"


def secure_note(excluded: Sequence[str]) -> str:
    """The sites a secure round excluded, in words ("" when none)."""
    return (f"secure aggregation excluded {', '.join(sorted(excluded))}: what it sent failed the protocol's checks "
            f"(its shares, or a share it revealed; the aggregation service's log says which)") if excluded else ""


def event_words(kind: str, round_number: int, message: str) -> str:
    """An event's message as the operator reads it: a `selection`, `robust` or `secure` event holds the typed
    record, put in words here; any other event's message is already words (and so is a record that cannot be
    read)."""
    try:
        if kind == "selection":
            words = selection_note(round_number, selection_from_json(message))
        elif kind == "robust":
            words = robust_note(verdicts_from_json(message))
        elif kind == "secure":
            words = secure_note(names_from_json(message))
        else:
            return message
    except (ValueError, TypeError):  # recorded before the typed records, or not one of ours: shown as it is
        return message
    return words or message
