"""A close's report in types: how the round's updates were chosen (`SelectionRecord`) and what a robust rule
did to each (`Verdict`). The aggregation service makes them, `CloseRoundReply` carries them, the coordinator
records them, and only the face puts them in words (`fedbroker.app.round_notes`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from fedbroker.algorithms.robust_params import DISCARDED_BELOW, DOWNWEIGHTED_BELOW
from fedbroker.proto import fedbroker_pb2 as pb


@dataclass(frozen=True)
class Verdict:
    """One update as a robust rule judged it: the weight it kept against what the plain mean would give it."""

    worker_id: str
    rule: str
    kept_weight: float
    expected_weight: float
    flagged: bool = False   # a history check found it inconsistent with its own past updates (and excluded it)

    @property
    def ratio(self) -> float:
        """kept / expected (1 where nothing was expected)."""
        return self.kept_weight / self.expected_weight if self.expected_weight > 0 else 1.0

    @property
    def judgement(self) -> str:
        """`flagged` (excluded by a history check), `discarded` (under DISCARDED_BELOW of its share),
        `down-weighted` (under DOWNWEIGHTED_BELOW), or `kept`."""
        if self.flagged:
            return "flagged"
        if self.ratio < DISCARDED_BELOW:
            return "discarded"
        return "down-weighted" if self.ratio < DOWNWEIGHTED_BELOW else "kept"

    def to_proto(self) -> pb.Verdict:
        """The wire form (`CloseRoundReply.verdicts`)."""
        return pb.Verdict(worker_id=self.worker_id, rule=self.rule, kept_weight=self.kept_weight,
                          expected_weight=self.expected_weight,
                          discarded=self.judgement in ("discarded", "flagged"),
                          reason=self.judgement)

    @classmethod
    def from_proto(cls, message: pb.Verdict) -> Verdict:
        """Back from the wire form."""
        return cls(message.worker_id, message.rule, message.kept_weight, message.expected_weight,
                   flagged=message.reason == "flagged")


@dataclass(frozen=True)
class SelectionRecord:
    """How the round's updates were chosen: by which selection, how many of how many, and whether the genetic
    algorithm ran (`ga_round`: the round is one of the GA's; `fallback`: it ran past its time limit)."""

    method: str
    accepted: int
    chosen: int
    ga_round: bool = False
    ga_ran: bool = False
    fallback: bool = False
    fitness: float | None = None

    def to_proto(self) -> pb.SelectionRecord:
        """The wire form (`CloseRoundReply.selection`)."""
        message = pb.SelectionRecord(method=self.method, accepted=self.accepted, chosen=self.chosen,
                                     ga_round=self.ga_round, ga_ran=self.ga_ran, fallback=self.fallback)
        if self.fitness is not None:
            message.fitness = self.fitness
        return message

    @classmethod
    def from_proto(cls, message: pb.SelectionRecord) -> SelectionRecord:
        """Back from the wire form."""
        return cls(message.method, message.accepted, message.chosen, message.ga_round, message.ga_ran,
                   message.fallback, message.fitness if message.HasField("fitness") else None)


def judged(verdicts: Sequence[Verdict]) -> list[Verdict]:
    """The verdicts worth a note (discarded or down-weighted), by worker."""
    return sorted((v for v in verdicts if v.judgement != "kept"), key=lambda v: v.worker_id)


def to_json(record: SelectionRecord | Sequence[Verdict]) -> str:
    """The record as the coordinator keeps it in a job's events (the face reads it back with `from_json`)."""
    if isinstance(record, SelectionRecord):
        return json.dumps(asdict(record), sort_keys=True)
    return json.dumps([asdict(v) for v in record], sort_keys=True)


def names_json(names: Sequence[str]) -> str:
    """Site names as the coordinator keeps them in a `secure` event (the sites a secure round excluded)."""
    return json.dumps(sorted(names))


def names_from_json(text: str) -> list[str]:
    """Site names from `names_json`'s text; a ValueError when they are not."""
    names = json.loads(text)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError("not a list of site names")
    return names


def selection_from_json(text: str) -> SelectionRecord:
    """A SelectionRecord from `to_json`'s text; a ValueError when it is not one."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("not a selection record")
    return SelectionRecord(**data)


def verdicts_from_json(text: str) -> list[Verdict]:
    """Verdicts from `to_json`'s text; a ValueError when they are not."""
    data = json.loads(text)
    if not isinstance(data, list) or not all(isinstance(v, dict) for v in data):
        raise ValueError("not a list of verdicts")
    return [Verdict(**v) for v in data]
