"""A running job's place (its global model and open round), and what ends a job's thread where it waits.

A job's thread stops at the next point where it waits when the coordinator stops (`Stopped`: the job
stays where it is in the store, for the next start to resume) or when the job was cancelled (`Cancelled`);
`JobFailed` is a job ended by its own rules (budgets, too few uploads), recorded without a traceback.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from fedbroker.errors import FedbrokerError
from fedbroker.job.settings import settings_digest, settings_message
from fedbroker.job.spec import JobSpec
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.weights.start import frozen_digest


class JobFailed(FedbrokerError):
    """The job's own rules ended it (budgets, too few uploads, no workers): recorded as its error."""

    reason = "job_failed"


class Stopped(Exception):
    """The coordinator is stopping; leave the job where it is, for the next start to resume."""


class Cancelled(Stopped):
    """The job was cancelled (`Coordinator.cancel`); its thread abandons it where it waits."""


@dataclass
class OpenRound:
    """A synchronous round between its selection and its close: what a resume or a re-open needs."""

    number: int
    participants: list[str]
    started: float
    deadline: float
    histograms: dict[str, list[int]]
    resumed: bool = False
    model_version: int = 0
    published: bool = False   # its tasks went out (a reinstall re-sends them)


@dataclass
class Run:
    """A running job's place: the global model it is at, and its open round (what a reinstall needs)."""

    job_id: str
    job: JobSpec
    version: int
    spec_json: str
    tensors: dict[str, np.ndarray]
    round: OpenRound | None = None
    settings: pb.JobSettings = field(init=False)   # the job's settings as installed (built once per run)
    digest: str = field(init=False)
    settings_sent: set[str] = field(default_factory=set)  # workers whose task carried them (this process)
    reopened: int = 0   # lost secure rounds abandoned and opened again (secure_reopen.py): the last round moves on

    @property
    def last_round(self) -> int:
        """The number of the job's last round: `training.rounds`, plus one per round opened again."""
        return self.job.training.rounds + self.reopened

    def __post_init__(self) -> None:
        self.settings = settings_message(self.job_id, self.job,
                                         start_digest=frozen_digest(self.tensors, self.job.model, self.job.plan))
        self.digest = settings_digest(self.settings)

    def task_settings(self, task: pb.RoundTask, worker_id: str) -> None:
        """Name the job's settings in a task, and carry them on the worker's first task (this process's: a
        worker that lacks them after all fetches them from the aggregation service)."""
        task.settings_digest = self.digest
        if worker_id in self.settings_sent:
            task.ClearField("settings")
        else:
            task.settings.CopyFrom(self.settings)


class CancelRequests:
    """Running jobs asked to cancel and who asked; each job's thread acts on its own at its next wait.

    The thread running a job binds it (`bind`), so code deep in a round loop can ask `halt_if_requested`
    without being handed the job's id.
    """

    def __init__(self) -> None:
        self._by: dict[str, str] = {}
        self._local = threading.local()

    def request(self, job_id: str, by: str) -> None:
        """Ask the job's thread to cancel it; `by`: the identity that asked."""
        self._by[job_id] = by

    def requested_by(self, job_id: str) -> str:
        """Who asked to cancel the job ("" when nobody named, or nobody asked)."""
        return self._by.get(job_id, "")

    def forget(self, job_id: str) -> None:
        """The job's thread has ended: nothing is left to act on a request."""
        self._by.pop(job_id, None)

    def bind(self, job_id: str) -> None:
        """The calling thread runs `job_id` from now on."""
        self._local.job_id = job_id

    def halt_if_requested(self) -> None:
        """In a job's thread, wherever the round loop waits: end the job there if it was cancelled."""
        job_id = getattr(self._local, "job_id", None)
        if job_id is not None and job_id in self._by:
            raise Cancelled
