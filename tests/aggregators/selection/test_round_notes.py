"""Each round says, in words, how its updates were chosen (`fedbroker.app.round_notes.selection_note`): the GA, a random
draw on a round that is not a GA round, a random draw after the GA overran, or no choice at all."""

from __future__ import annotations

import time

import numpy as np

from fedbroker.aggregators.selection import AllSelection, GeneticSelection, RandomSelection, Selection, SelectionInput
from fedbroker.app.round_notes import event_words, selection_note
from fedbroker.close_report import SelectionRecord, to_json
from tests.aggregators.selection.test_ga import random_problem


def note(round_number: int, selection: Selection, accepted: int, method: str = "ga") -> str:
    """The note of a close whose selection chose `selection` among `accepted` updates, as combine records it and
    the face shows it (the record travels as the coordinator keeps it, in a `selection` event)."""
    record = selection.record(method=method, accepted=accepted)
    assert event_words("selection", round_number, to_json(record)) == (selection_note(round_number, record) or to_json(record))
    return selection_note(round_number, record)


def test_the_note_says_whether_the_ga_or_a_random_draw_chose() -> None:
    g, candidates = random_problem(0, n=6)
    ga = GeneticSelection(fitness="reported_loss", m=2, ga_gap=3, population=10, generations=2)

    def choose(round_index: int, among: int = 6, deadline: float | None = None) -> Selection:
        return ga.choose(SelectionInput(candidates=candidates[:among], round_index=round_index, global_vector=g, rng=np.random.default_rng(0),
                         deadline=deadline))

    chose = choose(3)
    assert chose.stats["ga_round"] == 1.0 == chose.stats["ga_ran"]
    assert note(3, chose, 6) == f"the genetic algorithm chose 2 of 6 update(s) (fitness {chose.stats['fitness']:.4g})"
    assert note(4, choose(4), 6) == ("2 of 6 update(s) chosen at random: round 4 is not a GA round (the GA runs "
                                     "every ga_gap-th round)")
    assert choose(4).stats["ga_round"] == 0.0
    assert note(6, choose(6, deadline=time.monotonic() - 1.0), 6) == (
        "2 of 6 update(s) chosen at random: the genetic algorithm ran past the aggregation service's time limit")
    assert note(6, choose(6, among=2), 2) == (
        "all 2 update(s) aggregated: no more arrived than the genetic algorithm chooses (m)")
    kwargs = {"round_index": 5, "global_vector": g, "rng": np.random.default_rng(0)}
    assert note(5, RandomSelection(m=2).choose(SelectionInput(candidates=candidates, **kwargs)), 6,
                "random") == "2 of 6 update(s) chosen at random"
    assert note(5, AllSelection().choose(SelectionInput(candidates=candidates, **kwargs)), 6, "all") == ""
    assert selection_note(1, SelectionRecord("all", 3, 3)) == ""  # a running mean: nothing chosen


def test_an_event_recorded_before_the_typed_records_is_shown_as_it_was_written() -> None:
    assert event_words("selection", 2, "2 of 6 update(s) chosen at random") == "2 of 6 update(s) chosen at random"
    assert event_words("robust", 2, "[{\"worker_id\": 1}]") == "[{\"worker_id\": 1}]"
    assert event_words("waiting", 2, "{}") == "{}"
