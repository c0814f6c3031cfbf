"""The settings of every job installed at the aggregation service, each parsed and checked once (`InstallJob`).

The coordinator installs a job's settings before its global model and rounds; OpenRound and OpenBuffer then name
only the job. Installing is idempotent (the same settings again are taken), and other settings for a job that
has some are refused: a job's settings never change. Each job's settings are on disk (the spool's
`<job>/settings.pb`, the message's own bytes) before the reply, so a restarted service needs no resend.

An older coordinator that installs nothing sends the aggregation section with each OpenRound (read for one
release): the first one is parsed into the job's settings, in memory only (its rounds' records keep the
section, and a restart rebuilds them from there); a later request with another section is refused.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from fedbroker.aggregators.job_algorithms import Algorithms, build_algorithms
from fedbroker.aggregators.spool import Spool
from fedbroker.errors import Conflict, Rejection, UnknownJob, UploadRejected
from fedbroker.job.settings import legacy_settings, parse_settings, settings_digest
from fedbroker.proto import fedbroker_pb2 as pb

log = logging.getLogger(__name__)


class InstalledJobs:
    """Job id → its installed settings and the algorithms built from them (thread-safe)."""

    def __init__(self, spool: Spool | None = None, *, claim: Callable[[str], None] | None = None) -> None:
        self._spool = spool
        self._claim = claim  # aggregation replicas: own a job (its lease) before installing it
        self._jobs: dict[str, Algorithms] = {}
        self._lock = threading.Lock()
        if spool is not None:
            for path, raw in spool.load_settings():
                try:
                    self._jobs_put(build_algorithms(parse_settings(pb.JobSettings.FromString(raw))))
                except Exception as exc:  # a damaged file: quarantined; the job's coordinator installs it again
                    spool.quarantine(path, exc)

    def _jobs_put(self, algorithms: Algorithms) -> None:
        self._jobs[algorithms.installed.job_id] = algorithms

    def install(self, message: pb.JobSettings) -> Algorithms:
        """Parse, check and keep a job's settings (on disk first); the same settings again are taken as they
        are, other settings for the same job are refused (Conflict), bad ones raise ConfigError(s)."""
        if not message.job_id:
            raise UploadRejected(Rejection.BAD_REQUEST, "the settings name no job_id")
        digest = settings_digest(message)
        if self._claim is not None:
            self._claim(message.job_id)
        with self._lock:
            held = self._jobs.get(message.job_id)
        if held is not None:
            return self._same(held, digest)
        algorithms = build_algorithms(parse_settings(message))
        with self._lock:
            held = self._jobs.get(message.job_id)
            if held is not None:  # installed by a concurrent call meanwhile
                return self._same(held, digest)
            if self._spool is not None:
                self._spool.save_settings(message.job_id, message.SerializeToString(deterministic=True))
            self._jobs_put(algorithms)
        log.info("job %s installed (settings %s…)", message.job_id, digest[:12])
        return algorithms

    def load(self, job_id: str) -> None:
        """A job's settings from the shared spool (a replica taking the job over), if it has some."""
        spool = self._spool
        found = spool.settings_of(job_id) if spool is not None else None
        if spool is None or found is None:
            return
        path, raw = found
        try:
            algorithms = build_algorithms(parse_settings(pb.JobSettings.FromString(raw)))
        except Exception as exc:  # a damaged file: quarantined; the job's coordinator installs it again
            spool.quarantine(path, exc, job_id)
            return
        with self._lock:
            self._jobs_put(algorithms)

    def forget(self, job_id: str) -> None:
        """Drop a job's settings from memory (another replica owns it now; they stay on disk)."""
        with self._lock:
            self._jobs.pop(job_id, None)

    @staticmethod
    def _same(held: Algorithms, digest: str) -> Algorithms:
        if held.installed.digest != digest:
            raise Conflict(f"job {held.installed.job_id!r} is installed with other settings (digest "
                           f"{held.installed.digest[:12]}…, these are {digest[:12]}…): a job's settings never "
                           f"change; submit a new job")
        return held

    def get(self, job_id: str) -> Algorithms:
        """The job's settings and algorithms; UnknownJob when it has none (its coordinator installs them again)."""
        with self._lock:
            held = self._jobs.get(job_id)
        if held is None:
            raise UnknownJob(f"job {job_id!r} has no installed settings (InstallJob first)")
        return held

    def for_round(self, job_id: str, legacy_aggregation: Mapping[str, Any] | None) -> Algorithms:
        """The job's algorithms for a round or buffer being opened: the installed ones, else (an older
        coordinator's request) those of the aggregation section it sent, parsed once and kept in memory."""
        if legacy_aggregation is None:
            return self.get(job_id)
        message = legacy_settings(job_id, aggregation_json=json.dumps(dict(legacy_aggregation)))
        with self._lock:
            held = self._jobs.get(job_id)
        if held is None:
            algorithms = build_algorithms(parse_settings(message))
            with self._lock:
                held = self._jobs.setdefault(job_id, algorithms)
        if held.installed.message.aggregation != message.aggregation:
            raise Conflict(f"job {job_id!r} is installed with another aggregation section: a job's settings never "
                           f"change; submit a new job")
        return held
