"""A job's asynchronous state in the aggregation service (schedule.mode async): no transport, no disk.

No round barrier: the coordinator asks the service to issue a worker a task (`issue`), the service names
the task (a job-wide number) and its base version (always the newest), and the worker's upload is admitted
only for its one outstanding task. Each accepted update is folded into the FedBuff buffer at once
(`aggregators.fedbuff`); every `buffer_size` updates make a new global version. The book (`round_book.py`)
holds the locks and writes the spool before each reply; this module only says what changes.

Idempotence is per (job, worker, task): a task number names its base version, so a retry of an accepted
upload (same worker, same task) gets its first receipt back and counts once, and an upload for a task
that is no longer the worker's outstanding one is refused.

An update is weighed by the samples it claims, so no claim may exceed what its worker registered: the
state holds a sample limit for every worker that can hold a task, whenever it registered (OpenBuffer names
the workers registered then, IssueTasks each worker it gives a task), and a worker without one is neither
given a task nor admitted: the service fails closed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from fedbroker.aggregators.fedbuff import Buffer
from fedbroker.aggregators.job_algorithms import Algorithms
from fedbroker.algorithms.params import staleness_function
from fedbroker.errors import ConfigError, Rejection, UploadRejected
from fedbroker.job.spec import ScheduleConfig, mode_problems
from fedbroker.job.submission import robust_problems

KEEP_VERSION_ROWS = 64   # the newest versions' summaries (the coordinator records each one)


@dataclass(frozen=True)
class Issued:
    """A worker's outstanding task: its number and the version it trains from."""

    task: int
    base: int


@dataclass(frozen=True)
class Folded:
    """One update accepted into the buffer of the version being built."""

    worker_id: str
    task: int
    base: int
    tau: int
    raw_weight: float
    factor: float
    num_samples: int
    epsilon: float
    train_loss: float
    sha256: str
    bytes_received: int


@dataclass(frozen=True)
class FirstReceipt:
    """What a retry of an accepted upload is answered with."""

    task: int
    bytes_received: int
    sha256: str


@dataclass(frozen=True)
class VersionSummary:
    """One published version: the updates that made it, for BufferStatus's rows."""

    version: int
    updates: list[Folded]
    total_weight: float
    created: float

    def coefficient(self, update: Folded) -> float:
        """The update's share of the step: w·s(τ) / Σ w."""
        return update.raw_weight * update.factor / self.total_weight


@dataclass
class AsyncState:
    """A job in asynchronous mode: its buffer, who holds which task, and the recent versions."""

    config: dict[str, Any]            # as opened (the spool restores the algorithms and buffer from it)
    algorithms: Algorithms
    buffer: Buffer
    sample_limits: dict[str, int]     # worker → its registered sample count (the newest one sent)
    issued: dict[str, Issued] = field(default_factory=dict)       # worker → its outstanding task
    accepted: dict[str, FirstReceipt] = field(default_factory=dict)  # worker → its last accepted update
    next_task: int = 1
    folded: list[Folded] = field(default_factory=list)            # the buffer's updates, in acceptance order
    summaries: list[VersionSummary] = field(default_factory=list)
    refused_stale: int = 0
    closed: bool = False              # the job ended: no task is issued, every upload is refused

    @property
    def max_staleness(self) -> int:
        """The most versions an update may lag (older base versions need not be kept)."""
        return self.buffer.max_staleness

    def receipt(self, worker_id: str, task: int) -> FirstReceipt | None:
        """The first receipt of this worker's update for `task`, when that was its last accepted one."""
        done = self.accepted.get(worker_id)
        return done if done is not None and done.task == task else None

    def outstanding(self, worker_id: str, task: int) -> Issued | None:
        """The worker's task numbered `task`, if it is still the one it holds."""
        issued = self.issued.get(worker_id)
        return issued if issued is not None and issued.task == task else None

    def task_status(self, task: int) -> tuple[list[str], bool]:
        """A round's status for a task: its worker if its update was accepted, and open while outstanding."""
        return ([w for w, r in self.accepted.items() if r.task == task],
                any(i.task == task for i in self.issued.values()))

    def worker_task_status(self, worker_id: str, task: int) -> tuple[bool, bool]:
        """Whether the worker's update for `task` is in, and whether `task` is still the one it holds."""
        return self.receipt(worker_id, task) is not None, self.outstanding(worker_id, task) is not None

    def sample_limit(self, job_id: str, worker_id: str) -> int:
        """The most samples the worker's upload may claim; UploadRejected when its registered count is unknown
        (a spool written before tasks carried counts): an unbounded claim could set the global model alone."""
        limit = self.sample_limits.get(worker_id)
        if limit is None:
            raise UploadRejected(Rejection.UNKNOWN_WORKER,
                                 f"worker {worker_id!r} has no registered sample count in job {job_id!r}: its upload "
                                 f"cannot be weighed (it gets a new task that names its count)")
        return limit

    def issue(self, workers: list[str], version: int, limits: Mapping[str, int]) -> list[tuple[str, Issued]]:
        """A new task on `version` for each worker, replacing the one it had (whose upload is then refused).
        `limits`: registered sample counts, the newest for each worker; nothing is issued unless every worker
        has one (UploadRejected names the first that does not)."""
        for worker_id, count in limits.items():
            if count < 1:
                raise UploadRejected(Rejection.BAD_REQUEST, f"the registered sample count of worker {worker_id!r} "
                                                            f"must be positive, got {count}")
        unknown = [w for w in workers if w not in limits and w not in self.sample_limits]
        if unknown:
            raise UploadRejected(Rejection.BAD_REQUEST, f"worker {unknown[0]!r} has no registered sample count: "
                                                        f"IssueTasks must name it (num_samples), no task is issued")
        self.sample_limits.update(limits)
        out = []
        for worker_id in workers:
            issued = Issued(self.next_task, version)
            self.next_task += 1
            self.issued[worker_id] = issued
            out.append((worker_id, issued))
        return out

    def fold(self, entry: Folded, update: Mapping[str, np.ndarray], base: Mapping[str, np.ndarray],
             ) -> None:
        """Count an accepted update: into the buffer, and its task is done."""
        self.buffer.add(update, base, weight=entry.raw_weight, tau=entry.tau)
        self.folded.append(entry)
        self.accepted[entry.worker_id] = FirstReceipt(entry.task, entry.bytes_received, entry.sha256)
        if self.issued.get(entry.worker_id) == Issued(entry.task, entry.base):
            del self.issued[entry.worker_id]

    def close(self) -> bool:
        """The job ended: no task is outstanding and none is issued, no upload is folded; what the buffer holds
        stays (`folded`: accepted, in no version). False when it was closed already."""
        if self.closed:
            return False
        self.closed, self.issued = True, {}
        return True

    def publish(self, version: int, created: float) -> VersionSummary:
        """The buffer became version `version`: summarise what went in, and empty it."""
        summary = VersionSummary(version, list(self.folded), self.buffer.total_weight, created)
        self.summaries = [*self.summaries, summary][-KEEP_VERSION_ROWS:]
        self.folded = []
        self.buffer.reset()
        return summary


CONFIG_KEYS = ("aggregation", "buffer_size", "max_staleness", "staleness", "staleness_params", "server_lr", "seed")


def new_async_state(config: dict[str, Any], sample_limits: dict[str, int], algorithms: Algorithms) -> AsyncState:
    """A job's async state from what OpenBuffer sent, checked as at submission (ConfigError names the field);
    `algorithms`: the job's, from its installed settings (the record keeps their aggregation section)."""
    aggregation = algorithms.installed.aggregation
    config = {**config, "aggregation": asdict(aggregation)}
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ConfigError(f"schedule.{missing[0]}", "is required to open an asynchronous buffer")
    schedule = ScheduleConfig(mode="async", max_staleness=config["max_staleness"], staleness=config["staleness"],
                              staleness_params=dict(config["staleness_params"]), server_lr=config["server_lr"],
                              buffer_size=config["buffer_size"])
    problems = mode_problems(schedule=schedule, aggregation=aggregation) + robust_problems(aggregation, schedule)
    if problems:
        raise problems[0]
    if schedule.buffer_size < 1:
        raise ConfigError("schedule.buffer_size", f"must be at least 1 when the buffer opens, got {schedule.buffer_size}")
    staleness = staleness_function(schedule.staleness, schedule.staleness_params)
    buffer = Buffer(buffer_size=schedule.buffer_size, max_staleness=schedule.max_staleness, staleness=staleness,
                    server_lr=schedule.server_lr)
    return AsyncState(config, algorithms, buffer, sample_limits)


def copy_for_status(state: AsyncState, since_version: int) -> AsyncState:
    """What BufferStatus reports, copied under the book's lock (the buffer itself is not copied)."""
    return AsyncState(state.config, state.algorithms, state.buffer, dict(state.sample_limits), dict(state.issued),
                      dict(state.accepted), state.next_task, list(state.folded),
                      [v for v in state.summaries if v.version > since_version], state.refused_stale, state.closed)


def folded_record(entry: Folded, seq: int) -> dict[str, Any]:
    """A buffered update's metadata, as its spooled file holds it."""
    return {**vars(entry), "seq": seq}


def folded_from_record(record: Mapping[str, Any]) -> Folded:
    """`folded_record`'s inverse."""
    return Folded(str(record["worker_id"]), int(record["task"]), int(record["base"]), int(record["tau"]),
                  float(record["raw_weight"]), float(record["factor"]), int(record["num_samples"]),
                  float(record["epsilon"]), float(record["train_loss"]), str(record["sha256"]),
                  int(record["bytes_received"]))


def state_record(state: AsyncState) -> dict[str, Any]:
    """What job.json holds of the async state (the buffer's updates are files of their own)."""
    return {
        "config": state.config,
        "num_samples": state.sample_limits,
        "issued": {w: [i.task, i.base] for w, i in state.issued.items()},
        "accepted": {w: [r.task, r.bytes_received, r.sha256] for w, r in state.accepted.items()},
        "next_task": state.next_task,
        "summaries": [{"version": s.version, "updates": [vars(u) for u in s.updates], "total_weight": s.total_weight,
                       "created": s.created} for s in state.summaries],
        "refused_stale": state.refused_stale,
        "closed": state.closed,
    }


def restore_fields(state: AsyncState, record: Mapping[str, Any]) -> None:
    """Fill a freshly built state from `state_record`'s output (the buffer is replayed by the spool)."""
    state.issued = {w: Issued(int(t), int(b)) for w, (t, b) in record["issued"].items()}
    state.accepted = {w: FirstReceipt(int(t), int(n), str(sha)) for w, (t, n, sha) in record["accepted"].items()}
    state.next_task = int(record["next_task"])
    state.summaries = [VersionSummary(int(s["version"]), [folded_from_record(u) for u in s["updates"]],
                                      float(s["total_weight"]), float(s["created"])) for s in record["summaries"]]
    state.refused_stale = int(record.get("refused_stale", 0))
    state.closed = bool(record.get("closed", False))
