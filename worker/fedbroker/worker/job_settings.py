"""The settings of the jobs whose tasks a worker runs, kept by job id and digest, each parsed once.

A job's first task to this worker carries its settings; later tasks name only their digest. A worker that lacks
the settings a task names (it restarted, or dropped an old job) fetches them from the aggregation service, which
gives them only to the job's participants. A task from an older coordinator carries the training and
aggregation sections as JSON instead (read for one release).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from fedbroker.errors import ConfigError
from fedbroker.job.settings import InstalledJob, legacy_settings, parse_settings, settings_digest
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.weights.plan import ModelPlan


class JobSettingsCache:
    """Job id → its settings, the latest `kept` jobs. Tasks run one at a time per worker: no lock."""

    def __init__(self, *, kept: int) -> None:
        self.kept = kept
        self._jobs: collections.OrderedDict[str, InstalledJob] = collections.OrderedDict()

    def for_task(self, task: pb.RoundTask, fetch: Callable[[str], pb.JobSettings]) -> InstalledJob:
        """The settings `task` names: held, carried by the task, or fetched (`fetch(digest)`); parsed once per
        job and digest. A bad one raises ConfigError(s), as does settings whose digest is not the one named."""
        if task.settings_digest:
            held = self._jobs.get(task.job_id)
            if held is not None and held.digest == task.settings_digest:
                self._jobs.move_to_end(task.job_id)
                return held
            message = task.settings if task.HasField("settings") else fetch(task.settings_digest)
            if settings_digest(message) != task.settings_digest or message.job_id != task.job_id:
                raise ConfigError("task.settings", f"are not the settings of job {task.job_id!r} the task names "
                                                   f"(digest {task.settings_digest[:12]}…)")
        else:  # an older coordinator's task: its sections as JSON
            message = legacy_settings(task.job_id, training_json=task.training_json,
                                      aggregation_json=task.aggregation_json)
            held = self._jobs.get(task.job_id)
            if held is not None and held.digest == settings_digest(message):
                return held
        installed = parse_settings(message)
        self._jobs[task.job_id] = installed
        self._jobs.move_to_end(task.job_id)
        while len(self._jobs) > self.kept:
            self._jobs.popitem(last=False)
        return installed

    def get(self, job_id: str) -> InstalledJob | None:
        """The settings of a job, when this worker holds them."""
        return self._jobs.get(job_id)

    def plan(self, job_id: str) -> ModelPlan | None:
        """The model plan of a job whose settings this worker holds (None when it holds none)."""
        held = self._jobs.get(job_id)
        return held.plan if held is not None else None

    def held(self, job_id: str) -> InstalledJob:
        """The settings of a job whose task is running (`for_task` put them here)."""
        return self._jobs[job_id]
