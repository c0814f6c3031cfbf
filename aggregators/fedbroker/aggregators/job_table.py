"""Every job the aggregation service holds, the locks over them, and the record of each change.

The one public collaborator the book's parts share: the sync rounds (`round_book`), the buffer of
asynchronous jobs (`async_buffers`) and the secure rounds (`secure_rounds`) each receive the table and use
only what is named here. Rules for the locks: `lock` guards every job's state (held briefly, never across
I/O); `accept_lock` lets one accept at a time change a round's accepted set or a buffer, while status calls
and downloads go on; `closed` is notified whenever a close ends. A change is `commit`ted (its record on disk
first, under `lock`) or only `touch`ed (in memory), and either wakes the watchers (`watch`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from fedbroker.aggregators.job_state import Job, JobSnapshot, Round, snapshot
from fedbroker.aggregators.ownership import JobOwnership
from fedbroker.aggregators.spool import Spool, job_record
from fedbroker.errors import Rejection, UnknownJob, UploadRejected
from fedbroker.proto import fedbroker_pb2 as pb


class JobTable:
    """The jobs by id, their locks, and the generation counter the watchers follow."""

    def __init__(self, *, clock: Callable[[], float], spool: Spool | None,
                 ownership: JobOwnership | None = None) -> None:
        self.clock = clock
        self.spool = spool  # None: nothing is kept across a restart
        self.ownership = ownership  # aggregation replicas: a job is served only by the one owning its lease
        self.jobs: dict[str, Job] = {}
        self.lock = threading.Lock()
        self.closed = threading.Condition(self.lock)  # notified whenever a close ends, done or not
        self.accept_lock = threading.Lock()  # one accept at a time; status and downloads go on meanwhile
        self._watchers = threading.Condition(self.lock)  # notified whenever a job changes (`watch`)
        self._generation = 0                             # counts the changes
        self._changed_at: dict[str, int] = {}            # job → the generation of its last change

    def claim(self, job_id: str, *, create: bool = False) -> None:
        """Among aggregation replicas, own the job before serving a call for it (`JobOwnership.ensure`: a
        takeover loads it; NotOwner names its owner). Never called under `lock`."""
        if self.ownership is not None:
            self.ownership.ensure(job_id, create=create)

    def job(self, job_id: str) -> Job:
        """The job (owned first, `claim`), or UnknownJob."""
        self.claim(job_id)
        job = self.jobs.get(job_id)
        if job is None:
            raise UnknownJob(f"unknown job {job_id!r}")
        return job

    def commit(self, job: Job) -> None:
        """Write the job's record (under `lock`); its global versions are on disk already. Watchers hear of it."""
        if self.spool is not None:
            self.spool.save_record(job.job_id, job_record(job))
        self.touch(job)

    def touch(self, job: Job) -> None:
        """The job changed (under `lock`): wake the watchers."""
        self._generation += 1
        self._changed_at[job.job_id] = self._generation
        self._watchers.notify_all()

    def watch(self, after: int, timeout: float) -> tuple[int, list[JobSnapshot]]:
        """Wait up to `timeout` for a change after generation `after` (0: everything); the generation reached
        and a snapshot of every job that changed since `after` (none on a timeout)."""
        with self._watchers:
            self._watchers.wait_for(lambda: self._generation > after, timeout)
            changed = [self.jobs[j] for j, g in self._changed_at.items() if g > after and j in self.jobs]
            return self._generation, [snapshot(job) for job in changed]


def receiving(job: Job, header: pb.UpdateHeader) -> Round:
    """The round the upload was admitted to, if it is still open (under `lock`)."""
    rnd = job.round
    if rnd is None or rnd.number != header.round or rnd.closed:
        raise closed_during_upload(header)
    return rnd


def closed_during_upload(header: pb.UpdateHeader) -> UploadRejected:
    """The refusal of an upload whose round closed while it was being received."""
    return UploadRejected(Rejection.ROUND_CLOSED, f"round {header.round} of job {header.job_id!r} closed during the upload")
