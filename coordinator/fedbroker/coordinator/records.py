"""What the coordinator's state store holds, as the rest of the coordinator reads it: frozen records.

Their statuses are the kernel's (`fedbroker.job.status`): `StrEnum`s whose values are the strings the SQLite file,
the wire (StatusReply's string fields) and `fedbroker status` have always used, shared with the face that reads
them off a reply.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from fedbroker.config import DPPolicy
from fedbroker.job.status import JobStatus, ParticipantStatus, RoundStatus, WorkerState


def _spec_field(spec_json: str, *path: str) -> object:
    """One field of a stored job's spec, None when absent (a job stored before the field existed)."""
    try:
        value: object = json.loads(spec_json)
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
    except ValueError:
        return None
    return value


@dataclass(frozen=True, kw_only=True)
class JobRecord:
    """A submitted job: its spec's one wire form, where it stands, and who submitted it (the only identity
    that may cancel it or download its models)."""

    job_id: str
    name: str
    spec_json: str
    status: JobStatus
    rounds_total: int
    rounds_done: int
    model_spec_json: str
    error: str
    created: float
    updated: float
    submitter: str

    @property
    def category(self) -> str:
        """The data category the job trains on."""
        return str(_spec_field(self.spec_json, "category") or "")

    @property
    def mode(self) -> str:
        """schedule.mode (a job stored before the field existed is synchronous)."""
        return str(_spec_field(self.spec_json, "schedule", "mode") or "sync")


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    """One round of a job (for an asynchronous job: one published version). Its outcome fields are None
    until it closes; `deadline` is None in a state file written before rounds kept it."""

    job_id: str
    round: int
    status: RoundStatus
    participants: int
    uploaded: int
    aggregated: int
    accuracy: float | None
    loss: float | None
    mean_train_loss: float | None
    seconds: float | None
    model_version: int | None          # None until it closes (and for a round that never did)
    checkpoint: str | None             # likewise; "" for a version the service no longer kept to save
    stats: Mapping[str, float]
    started: float
    closed: float | None
    deadline: float | None


@dataclass(frozen=True, kw_only=True)
class ParticipantRecord:
    """A worker selected for a round; its upload's numbers once the round closed (or the job was cancelled)."""

    job_id: str
    round: int
    worker_id: str
    status: ParticipantStatus
    reason: str
    epsilon: float | None
    train_loss: float | None
    num_samples: int | None


@dataclass(frozen=True, kw_only=True)
class EventRecord:
    """One line of a job's history (`fedbroker jobs logs`); `seq` orders them across the whole store."""

    seq: int
    job_id: str
    time: float
    kind: str
    round: int
    worker_id: str
    message: str


@dataclass(frozen=True, kw_only=True)
class WorkerRecord:
    """A registered worker as its registration and last heartbeat described it."""

    worker_id: str
    categories: tuple[str, ...]
    histogram: tuple[int, ...]
    dp: DPPolicy                       # its owner's policy (dp.enabled False: it trains without DP)
    epsilon_spent: float
    device: str
    num_samples: int
    last_seen: float
    state: WorkerState = WorkerState.IDLE
    input_shape: tuple[int, ...] = ()  # one sample's shape; () = not reported (a worker older than the field)
    num_classes: int = 0               # 0 = not reported
    evaluation_samples: int = 0        # its held-out split; 0 = none (or a worker older than the field)


@dataclass(frozen=True, kw_only=True)
class EpsilonCorrection:
    """An operator's correction of the ε recorded for a worker (`fedbroker workers reset-epsilon`): who, when,
    from what to what, and the site's ledger it rests on (its digest and the ε it holds)."""

    seq: int
    worker_id: str
    time: float
    by: str
    old: float
    new: float
    ledger_sha256: str
    ledger_epsilon: float
    note: str


@dataclass(frozen=True, kw_only=True)
class SiteJobRecord:
    """One job as the coordinator recorded it for one site (`fedbroker ledger` on that site): the ε the site
    reported for the job (the highest, as each report is the job's total on its data), the rounds in which the
    site trained, and what else the site sent the job (histogram, statistics, evaluation)."""

    job_id: str
    status: JobStatus
    epsilon: float
    rounds: int
    shared: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class SiteInfo:
    """What the coordinator keeps about a site beside its registration row (`fedbroker sites`): the release it
    runs, when it first registered, how often its process restarted, the broker user it registers from, whether
    it is silent (its heartbeats stopped: an `expired` event was written), its last error and how many warnings
    and errors it forwarded."""

    worker_id: str
    software_version: str
    first_registered: float
    started: float                     # its process's start, as its last registration said (0: not reported)
    restarts: int
    broker_user: str
    silent: bool
    last_error: str
    last_error_time: float | None
    log_records: int


@dataclass(frozen=True, kw_only=True)
class SiteEvent:
    """One line of a site's own history: identical lines in a row are one, with a count and a first time."""

    seq: int
    worker_id: str
    time: float
    kind: str
    message: str
    count: int
    first_time: float


@dataclass(frozen=True, kw_only=True)
class SiteLogRecord:
    """A warning or error a site forwarded, filed under the site its broker user speaks for (`sender`);
    `claimed`: the worker id the message named when that was another one."""

    seq: int
    worker_id: str
    received: float
    site_time: float
    level: str
    logger: str
    message: str
    sender: str
    claimed: str
    dropped_before: int
