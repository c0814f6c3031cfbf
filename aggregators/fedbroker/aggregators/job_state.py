"""A job's rounds as a state machine, with no I/O and no locks (the book holds its lock around every call).

A round is OPEN (receiving uploads), CLOSING (aggregating: uploads are refused; back to OPEN if the
aggregation fails) or CLOSED. Every transition is idempotent for the coordinator, who may repeat any call
after a restart on either side, and an upload is idempotent per (job, round, worker): a retry of an
accepted update gets the first receipt, even after the close (the recent closed rounds keep their receipts,
so a worker whose receipt was lost learns its update got in, not that the round closed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from fedbroker.aggregators.admission import Standing, check_finite, value_limit
from fedbroker.aggregators.async_state import AsyncState
from fedbroker.aggregators.job_algorithms import Algorithms
from fedbroker.aggregators.mean import Layout, Slot, UpdateRows
from fedbroker.aggregators.robust import RobustMemory
from fedbroker.aggregators.rows import Rows
from fedbroker.aggregators.secure_session import SecureSession
from fedbroker.aggregators.weighting.base import UpdateMeta
from fedbroker.close_report import SelectionRecord, Verdict
from fedbroker.errors import Conflict, NotFound, Rejection, UploadRejected
from fedbroker.job.spec import ModelSpec
from fedbroker.weights.plan import trainable_shapes

if TYPE_CHECKING:  # secure_groups builds on this module (its close makes a Combined)
    from fedbroker.aggregators.secure_groups import GroupedSession

KEEP_CLOSED_ROUNDS = 16  # closed rounds whose accepted workers and deadline are remembered (redeliveries, stragglers)


class Phase(Enum):
    """Where a round is: receiving uploads, aggregating them, or done."""

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True)
class Receipt:
    """What an accepted upload gets back; a retry gets the first one again."""

    job_id: str
    round: int
    worker_id: str
    duplicate: bool
    bytes_received: int
    sha256: str


@dataclass(frozen=True)
class AfterClose:
    """A retry of an accepted update that arrived after its round (or buffer) closed: the closed round takes
    nothing new, so only the update it took, the same bytes, gets its first receipt back."""

    first: Receipt
    closed: str  # why nothing else is taken, for the refusal

    def judge(self, digest: str) -> Receipt:
        """The first receipt if `digest` is the accepted update's, else UploadRejected (`round_closed`)."""
        if digest != self.first.sha256:
            raise UploadRejected(Rejection.ROUND_CLOSED, f"{self.closed}: it holds another update of worker "
                                                         f"{self.first.worker_id!r} and takes no new one")
        return self.first


@dataclass(frozen=True)
class UpdateSummary:
    """One update's part in a close (its coefficient), for the coordinator's records."""

    worker_id: str
    num_samples: int
    epsilon: float
    train_loss: float
    weight: float


@dataclass(frozen=True)
class CloseResult:
    """A close's result; kept, so a repeated close returns it again."""

    model_version: int
    aggregated: list[str]
    model_spec_json: str
    stats: dict[str, float]
    seconds: float
    updates: list[UpdateSummary]
    selection: SelectionRecord | None = None
    verdicts: list[Verdict] = field(default_factory=list)
    excluded: list[str] = field(default_factory=list)   # sites a secure round excluded


@dataclass
class Accepted:
    """An accepted update and what is known of it; its tensors only while the round keeps them."""

    worker_id: str
    num_samples: int
    raw_weight: float
    sha256: str
    bytes_received: int
    meta: UpdateMeta
    epsilon: float
    train_loss: float
    tensors: dict[str, np.ndarray] | None = None
    slot: Slot | None = None     # the row of the round's kept updates that holds `tensors`


@dataclass
class Round:
    """A job's current round: who may upload until when, with which algorithms, and what was accepted."""

    number: int
    participants: frozenset[str]
    deadline: float
    algorithms: Algorithms
    rows: Rows
    aggregation: dict[str, Any]                  # the job's section (kept in the record, for an older service)
    histograms: dict[str, list[int]]
    accepted: dict[str, Accepted] = field(default_factory=dict)
    phase: Phase = Phase.OPEN
    sample_limits: dict[str, int] = field(default_factory=dict)  # registered sample counts: no upload claims more
    next_seq: int = 0                            # acceptance order of the spooled updates
    secure: SecureSession | GroupedSession | None = None  # aggregation.secure: keys, shares and the masked sum

    @property
    def closed(self) -> bool:
        """Whether uploads are refused (the round is aggregating or done)."""
        return self.phase is not Phase.OPEN

    def receipt(self, job_id: str, worker_id: str) -> Receipt | None:
        """The first receipt of the worker's accepted update (a retry is answered with it), else None."""
        done = self.accepted.get(worker_id)
        if done is None:
            return None
        return Receipt(job_id, self.number, worker_id, True, done.bytes_received, done.sha256)

    def receipts(self, job_id: str) -> dict[str, Receipt]:
        """Every accepted update's first receipt: what the round keeps of them once it is closed."""
        return {w: Receipt(job_id, self.number, w, True, a.bytes_received, a.sha256) for w, a in self.accepted.items()}

    def take_seq(self) -> int:
        """The next acceptance number (the spool replays updates in this order)."""
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def accept(self, entry: Accepted, tensors: Mapping[str, np.ndarray], slot: Slot | None) -> None:
        """Count an accepted update; `slot` is the row it was received into, if any."""
        entry.slot = self.rows.add(tensors, entry.raw_weight, slot)
        if entry.slot is not None:
            entry.tensors = self.rows.layout.views(entry.slot.values)
        self.accepted[entry.worker_id] = entry


def new_round(number: int, members: frozenset[str], deadline: float, algorithms: Algorithms,
              aggregation: dict[str, Any], histograms: dict[str, list[int]], spec: ModelSpec,
              spare_rows: UpdateRows | None = None, *, sample_limits: Mapping[str, int] | None = None,
              secure: SecureSession | GroupedSession | None = None) -> Round:
    """`sample_limits`: each participant's registered sample count (a participant not in it is unbounded);
    `secure`: the round's SecAgg+ session (aggregation.secure), which then receives every upload instead."""
    settings = algorithms.settings
    incremental = settings.incremental and not algorithms.installed.privacy.site.enabled  # site DP clips each update
    rows = Rows(Layout(trainable_shapes(spec, algorithms.installed.plan)), incremental=incremental,
                weights_positive=settings.weights_positive, spare=spare_rows)
    return Round(number, members, deadline, algorithms, rows, aggregation, histograms,
                 sample_limits={w: int(n) for w, n in (sample_limits or {}).items()}, secure=secure)


@dataclass
class Job:
    """One job in the aggregation service: its kept global versions, its round, its algorithms."""

    job_id: str
    spec: ModelSpec
    seed: int
    versions: dict[int, dict[str, np.ndarray]]
    specs: dict[int, str]
    round: Round | None = None
    closed_rounds: set[int] = field(default_factory=set)
    last_close: tuple[int, CloseResult] | None = None   # (round, result): a repeated close returns it
    closed_deadlines: dict[int, float] = field(default_factory=dict)  # a late upload is "late", not "round_closed"
    closed_accepted: dict[int, list[str]] = field(default_factory=dict)  # recent rounds: who got in (status)
    closed_receipts: dict[int, dict[str, Receipt]] = field(default_factory=dict)  # recent rounds: a retry's answer
    spare_rows: UpdateRows | None = None   # the last running mean's rows: the next round receives into them
    asynchronous: AsyncState | None = None  # schedule.mode async: the FedBuff buffer and the issued tasks
    site_clip: float | None = None  # privacy.site: the clip S of the next round (None: the job's clip_norm)
    robust_memory: RobustMemory | None = None  # the robust rule's momentum and per-site history (since install)

    @property
    def version(self) -> int:
        """The newest global version."""
        return max(self.versions)

    def asked(self, worker_id: str) -> bool:
        """Whether the job asked the worker for an update: its open round's or a kept closed round's, or a task."""
        rnd, state = self.round, self.asynchronous
        return ((rnd is not None and worker_id in rnd.participants)
                or any(worker_id in kept for kept in self.closed_accepted.values())
                or (state is not None and (worker_id in state.issued or worker_id in state.accepted)))

    # ----- the global model -----

    def check_update(self, tensors: Mapping[str, np.ndarray], *, who: str, declared: float) -> None:
        """Finite, and within the job's bound on an update's values (`declared`, else `admission.value_limit`),
        judged against the newest global model: else UploadRejected."""
        versions = dict(self.versions)  # a close may replace them meanwhile
        check_finite(tensors, who=who, limit=value_limit(declared=declared, model=versions[max(versions)]))

    def holds(self, version: int, spec_json: str, state: Mapping[str, np.ndarray]) -> bool:
        """Whether this exact model is installed already (a restarted coordinator re-installing it)."""
        held = self.versions.get(version)
        if held is None or self.specs.get(version) != spec_json or held.keys() != state.keys():
            return False
        return all(np.array_equal(held[name], arr) for name, arr in state.items())

    def install(self, version: int, spec: ModelSpec, spec_json: str, state: dict[str, np.ndarray]) -> None:
        """Replace the global model; the open round and its uploads go with the old one."""
        self.spec = spec
        self.versions = {version: state}
        self.specs = {version: spec_json}
        self.round = None
        self.last_close = None
        self.spare_rows = None  # the dropped round's uploads may still hold rows of them
        self.asynchronous = None  # its tasks' base versions went with the old model
        self.robust_memory = None  # its steps and the sites' predictions were of the old model

    # ----- rounds -----

    def current(self, round_number: int) -> Round | None:
        """The job's round if it is the one numbered `round_number` (open, closing or just closed)."""
        return self.round if self.round is not None and self.round.number == round_number else None

    def kept_receipt(self, round_number: int, worker_id: str) -> Receipt | None:
        """The first receipt of the worker's update in round `round_number` once that round stopped taking
        uploads (closing, closed or abandoned), else None: a retry of that very update gets it back."""
        rnd = self.current(round_number)
        if rnd is not None and rnd.closed:
            return rnd.receipt(self.job_id, worker_id)
        return self.closed_receipts.get(round_number, {}).get(worker_id)

    def standing(self, round_number: int) -> Standing:
        """What admission needs to judge an upload for round `round_number`."""
        rnd = self.current(round_number)
        return Standing(
            participants=rnd.participants if rnd is not None else None,
            deadline=rnd.deadline if rnd is not None else self.closed_deadlines.get(round_number),
            closed=round_number in self.closed_rounds or (rnd is not None and rnd.closed),
            sample_limits=rnd.sample_limits if rnd is not None else {},
            beyond=self.beyond(round_number),
        )

    def status(self, round_number: int) -> tuple[list[str], bool]:
        """Who got into round `round_number`, and whether it is still open."""
        rnd = self._asked(round_number)
        if rnd is None:  # a worker with a redelivered task of a closed round
            return list(self.closed_accepted.get(round_number, [])), False
        return sorted(rnd.accepted), not rnd.closed

    def worker_status(self, round_number: int, worker_id: str) -> tuple[bool, bool]:
        """`status` for one worker: whether its update is in, and whether the round is open (without listing
        the round's uploads: every worker of a round asks once)."""
        rnd = self._asked(round_number)
        if rnd is None:
            return worker_id in self.closed_accepted.get(round_number, ()), False
        if worker_id not in rnd.participants:  # said before it trains: its upload would be refused, its ε spent
            raise UploadRejected(Rejection.UNKNOWN_WORKER,
                                 f"worker {worker_id!r} is not a participant of round {round_number}")
        return worker_id in rnd.accepted, not rnd.closed

    def beyond(self, round_number: int) -> bool:
        """Whether round `round_number` lies past what this service can still open: its round is open (or closing)
        and is an earlier one, or the asked one is more than one past a closed round. Rounds open in order, each
        here before its tasks go out, so such a task is from a state given up since: a restore from a backup (or
        a coordinator that lost its own). The task is dropped, never retried: the coordinator re-sends its own."""
        rnd = self.round
        return rnd is not None and (round_number > rnd.number + 1 or (round_number > rnd.number and not rnd.closed))

    def _asked(self, round_number: int) -> Round | None:
        """The open round `round_number`; None for a closed one, and for one `beyond` this service's state."""
        if self.beyond(round_number):
            return None
        rnd = self.current(round_number)
        if rnd is None and round_number not in self.closed_rounds and (
                self.round is None or round_number > self.round.number):
            # Not open *yet*: a service that restarted without its spool learns the job's model before its
            # round, and a worker asking in between must retry, not give its task up as "closed".
            raise UploadRejected(Rejection.UNKNOWN_ROUND, f"round {round_number} of job {self.job_id!r} is not open")
        return rnd

    def open(self, number: int, participants: frozenset[str], deadline: float, *, seed: int,
             build: Callable[[], Round]) -> bool:
        """Open round `number`, or confirm that it is open (idempotent); True when the state changed."""
        rnd = self.round
        if rnd is not None and rnd.number == number and rnd.phase is Phase.OPEN:
            if rnd.participants != participants:
                raise Conflict(f"round {number} of job {self.job_id!r} is already open with other participants")
            if deadline > rnd.deadline:  # a resumed coordinator gives a round more time, never less
                rnd.deadline = deadline
                return True
            return False  # a coordinator retrying after a lost reply, or restarted
        if number in self.closed_rounds:
            raise Conflict(f"round {number} of job {self.job_id!r} is already closed")
        self.seed = seed
        self.round = build()
        return True

    def repeated_close(self, number: int) -> CloseResult | None:
        """The result of closing round `number` when that was the last close (the coordinator lost our reply)."""
        return self.last_close[1] if self.last_close is not None and self.last_close[0] == number else None

    def closing(self, number: int) -> bool:
        """Whether round `number` is being aggregated right now (a repeated close waits for its result)."""
        rnd = self.round
        return rnd is not None and rnd.number == number and rnd.phase is Phase.CLOSING

    def begin_close(self, number: int) -> Round:
        """OPEN → CLOSING: uploads are refused from now on."""
        rnd = self.round
        if rnd is None or rnd.number != number:
            raise NotFound(f"round {number} of job {self.job_id!r} is not open")
        if rnd.closed:
            raise Conflict(f"round {number} of job {self.job_id!r} is already closed")
        if rnd.secure is not None and rnd.secure.failed is not None:  # why (a lost round: the coordinator re-opens)
            raise UploadRejected(Rejection.SECURE_PROTOCOL, rnd.secure.failed)
        if not rnd.accepted:
            raise Conflict(f"round {number} of job {self.job_id!r} cannot close with no accepted update")
        rnd.phase = Phase.CLOSING
        return rnd

    def abandon(self, number: int) -> list[Accepted]:
        """OPEN → gone, with no new version: a cancelled job's round. Its uploads are returned (to be
        reported) and dropped; a later upload is refused as `round_closed`, a later open or close as closed.
        Idempotent: a round abandoned before gives nothing back; a round that was closed cannot be undone."""
        rnd = self.round
        if rnd is None or rnd.number != number:
            if self.last_close is not None and self.last_close[0] == number:
                raise Conflict(f"round {number} of job {self.job_id!r} is already closed: its version stands")
            return []
        if rnd.phase is Phase.CLOSED:
            raise Conflict(f"round {number} of job {self.job_id!r} is already closed: its version stands")
        if rnd.phase is not Phase.OPEN:
            raise Conflict(f"round {number} of job {self.job_id!r} is {rnd.phase.value}: it cannot be abandoned")
        dropped = list(rnd.accepted.values())
        if rnd.secure is not None:
            rnd.secure.end("the round was abandoned (its job failed or was cancelled)")
        self.closed_rounds.add(number)
        self.closed_deadlines[number] = rnd.deadline
        self.closed_accepted[number] = sorted(rnd.accepted)
        self.closed_receipts[number] = rnd.receipts(self.job_id)
        rnd.phase = Phase.CLOSED
        self.round = None
        return dropped

    @staticmethod
    def abort_close(rnd: Round) -> None:
        """CLOSING → OPEN: nothing changed, and the coordinator may close the round again."""
        rnd.phase = Phase.OPEN

    def finish_close(self, rnd: Round, result: CloseResult, current: dict[str, np.ndarray],
                     new_state: dict[str, np.ndarray], spec: ModelSpec, memory: RobustMemory | None = None) -> None:
        """CLOSING → CLOSED: the new global version is in, the old one kept for late downloads; `memory`: the
        robust rule's after the close (kept only now, so a failed close leaves the job's as it was)."""
        version = result.model_version
        self.versions = {self.version: current, version: new_state}
        self.specs = {v: self.specs[v] for v in self.versions if v in self.specs}
        self.spec = spec
        self.specs[version] = result.model_spec_json
        self.closed_rounds.add(rnd.number)
        spare = rnd.rows.spare()
        if spare is not None:  # an upload still streaming into one of them keeps its row until refused
            self.spare_rows = spare
        self.closed_deadlines[rnd.number] = rnd.deadline
        self.closed_accepted[rnd.number] = sorted(rnd.accepted)
        self.closed_receipts[rnd.number] = rnd.receipts(self.job_id)
        for old in sorted(self.closed_accepted)[:-KEEP_CLOSED_ROUNDS]:
            del self.closed_accepted[old]
            self.closed_deadlines.pop(old, None)
            self.closed_receipts.pop(old, None)
        self.last_close = (rnd.number, result)
        if memory is not None:
            self.robust_memory = memory
        rnd.phase = Phase.CLOSED


@dataclass(frozen=True)
class JobSnapshot:
    """What the Watch stream says of one job."""

    job_id: str
    round: int
    accepted: int
    open: bool
    version: int
    buffered: int


def snapshot(job: Job) -> JobSnapshot:
    """The Watch stream's view of the job."""
    rnd, state = job.round, job.asynchronous
    return JobSnapshot(job.job_id, rnd.number if rnd is not None else 0, len(rnd.accepted) if rnd is not None else 0,
                       rnd is not None and not rnd.closed, job.version, len(state.folded) if state is not None else 0)
