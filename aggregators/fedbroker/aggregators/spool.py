"""The aggregation service's durable state on local disk, so a restarted service loses no accepted update.

One folder per job (named from the job id, safe for any file system):

    settings.pb              the job's installed settings (a JobSettings message's bytes: `installed_jobs`)
    job.json                 the commit record: seed, kept global versions, closed rounds (and the receipts of
                             the recent ones' uploads), the open round's definition, the last close's result
                             and the asynchronous state (rewritten atomically on every change)
    global-<version>.npz     a global model: raw arrays + its model spec as UTF-8 bytes
    robust-<version>.npz     the robust rule's memory after the close that made that version (`robust.memory`)
    round-<n>/<seq>.npz      one accepted update of the open round: raw arrays + its metadata as UTF-8 JSON

Every file is written atomically (`fedbroker.files.write_atomic`: a temporary name in the same folder,
fsync, rename, fsync the folder), so a crash leaves the old file or the new one, never half of one. Files
are numpy `.npz` archives of plain arrays, loaded with `allow_pickle=False`: nothing on disk is pickled.

job.json is the single source of truth: a global file or a round folder it does not name (left by a
crash between writing it and committing job.json) is ignored on load and deleted. While the service runs,
a global file written for a record still to come (`save_global`, then `save_record` naming it) is kept by
every record committed meanwhile.

Aggregation replicas (`aggregators.ownership`): a spool opened with `fence` is shared by every replica on one
ReadWriteMany volume. It takes no `spool.lock` and loads nothing at start: each job is owned by one replica through
its lease `job:<id>`, loaded on takeover (`load_job`), and every write of a job runs inside `fence(job_id)`, which
refuses it (nothing written) unless this replica still holds the job's lease.

One service at a time (without `fence`): an open Spool holds `spool.lock` in its root (`fedbroker.files.FolderLock`), so a
second service on the same folder is refused (`SpoolInUse`) instead of deleting the files the first one's
records name; it waits `aggregator.spool_lock_wait_s` first, so a quick restart starts once the old process
has exited. `close()` waits for the writes under way, then lets the next service in; a write through a
closed spool raises `SpoolClosed`, so a handler thread that outlives its stopped service touches nothing.

`job_record` turns the book's state (`aggregators.job_state`) into these records; `aggregators.spool_restore` reads
them back.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from fedbroker.aggregators import metrics
from fedbroker.aggregators.async_state import state_record
from fedbroker.aggregators.job_algorithms import Algorithms
from fedbroker.aggregators.job_state import Accepted, Job
from fedbroker.aggregators.robust import RobustMemory, memory_arrays
from fedbroker.errors import ConfigError, Rejection, Unavailable, UploadRejected
from fedbroker.files import TEMP_SUFFIX, FolderLock, FolderLocked, write_atomic

# The job's algorithms for a round or buffer being restored: its installed settings', else (a record of an older
# service) those of the aggregation section the record kept (`InstalledJobs.for_round`).
AlgorithmsFor = Callable[[str, Mapping[str, Any] | None], Algorithms]
# On a shared spool: a job's write inside its lease's fence (`aggregators.ownership.JobOwnership.fenced`).
Fence = Callable[[str], contextlib.AbstractContextManager[None]]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
QUARANTINE_DIR = "quarantine"   # records that do not load, moved aside at start (never a job folder's name)
META_KEY = "__fedbroker_meta_json__"
SETTINGS_FILE = "settings.pb"   # a job's installed settings
LOCK_FILE = "spool.lock"        # held by the one service writing the spool (never a job folder's name)
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


@contextlib.contextmanager
def _disk_full_is_an_outage(what: str) -> Generator[None, None, None]:
    """A full spool disk refuses the call with `spool_full` (UNAVAILABLE): nothing was accepted, and every
    client retries it as it retries a restarting service, instead of failing on an opaque UNKNOWN.
    `write_atomic` has removed its temporary file, so the spool holds what it held before."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _DISK_FULL:
            raise
        log.error("the spool disk is full: %s refused (%s)", what, exc)
        raise UploadRejected(Rejection.SPOOL_FULL, f"the aggregation service's spool disk is full "
                                                   f"({os.strerror(exc.errno)}); {what} not accepted, retry later"
                             ) from exc


class SpoolInUse(ConfigError):
    """Another aggregation service holds this spool: two on one folder would delete each other's files."""

    reason = "spool_in_use"


class SpoolClosed(Unavailable):
    """A write through a spool its service has closed (a handler thread that outlived the stop): refused, so
    the next service on the folder is its only writer; a client retries it against that service."""


@dataclass
class StoredJob:
    """One job as read from its folder: its record and its kept global models."""

    record: dict[str, Any]                                   # job.json as written
    globals: dict[int, tuple[str, dict[str, np.ndarray]]]    # version → (model spec JSON, tensors)
    folder: Path


def _lock(root: Path, wait_s: float) -> FolderLock:
    """The spool's lock, waiting up to `wait_s` for a holder (an old service still exiting) to let go."""
    try:
        return FolderLock(root, LOCK_FILE)
    except FolderLocked as exc:
        if wait_s <= 0:
            raise
        log.warning("spool %s is held by pid %s (a service still exiting?); waiting up to %g s for it", root,
                    exc.holder, wait_s)
    return FolderLock(root, LOCK_FILE, wait_s=wait_s)


class Spool:
    """The folder of job folders (see the module docstring); every write is atomic. Holds the folder's lock
    from here to `close()`: `SpoolInUse` when another service still holds it after `lock_wait_s`."""

    def __init__(self, root: str | os.PathLike[str], *, lock_wait_s: float = 0.0, fence: Fence | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fence = fence  # set: shared by replicas, each job's writes fenced by its lease (module docstring)
        self._lock: FolderLock | None = None
        try:
            if fence is None:
                self._lock = _lock(self.root, lock_wait_s)
        except FolderLocked as exc:
            raise SpoolInUse(
                "aggregator.spool_dir",
                f"{self.root} is in use by another aggregation service (pid {exc.holder}, which holds "
                f"{exc.path}{f' and did not let go within aggregator.spool_lock_wait_s = {lock_wait_s:g} s' if lock_wait_s > 0 else ''}); "
                f"two services on one spool would delete each other's files: stop that one, or give this one its "
                f"own spool_dir",
            ) from None
        self._guard = threading.Condition()  # the three fields below
        self._writers = 0                     # writes under way (`close` waits for them)
        self._closed = False
        self._unnamed: dict[str, set[int]] = {}  # job → global versions written that no record named yet

    def close(self) -> None:
        """Refuse every later write (`SpoolClosed`), wait for the writes under way, and let the next service
        on the folder in (idempotent)."""
        with self._guard:
            self._closed = True
            self._guard.wait_for(lambda: self._writers == 0)
        if self._lock is not None:
            self._lock.release()

    @property
    def shared(self) -> bool:
        """Whether replicas share this spool (each job loaded on takeover, not at start)."""
        return self.fence is not None

    @contextlib.contextmanager
    def _writing(self, what: str, job_id: str | None = None) -> Generator[None, None, None]:
        """One write (or deletion) in the folder, refused once the spool is closed; `close` waits for it. On a
        shared spool a write of a job is fenced by its lease (LeaseLost: nothing written)."""
        with self._guard:
            if self._closed:
                raise SpoolClosed(f"the spool {self.root} is closed (its aggregation service stopped): "
                                  f"{what} not written")
            self._writers += 1
        try:
            if self.fence is not None and job_id is not None:
                with self.fence(job_id):
                    yield
            else:
                yield
        finally:
            with self._guard:
                self._writers -= 1
                self._guard.notify_all()

    # ----- paths -----

    def folder(self, job_id: str) -> Path:
        """The job's folder (`job_folder`)."""
        return job_folder(self.root, job_id)

    # ----- writes -----

    def save_global(self, job_id: str, version: int, spec_json: str, tensors: Mapping[str, np.ndarray]) -> None:
        """A global model version, on disk before the record that names it: kept meanwhile by every record
        committed by another call (it may name older versions only)."""
        what = f"global model {version} of job {job_id!r}"
        with self._writing(what, job_id), _disk_full_is_an_outage(what):
            with self._guard:  # before the file exists, so no prune that sees the file can miss it
                self._unnamed.setdefault(job_id, set()).add(version)
            folder = self.folder(job_id)
            folder.mkdir(parents=True, exist_ok=True)
            _write_npz(folder / f"global-{version}.npz", tensors, {"version": version, "spec_json": spec_json})

    def save_robust(self, job_id: str, version: int, memory: RobustMemory) -> None:
        """The robust rule's memory after the close that made `version`, after that version's `save_global`
        (so the prune keeps it as it keeps the global file) and before the record that names it."""
        what = f"the robust memory of job {job_id!r}"
        with self._writing(what, job_id), _disk_full_is_an_outage(what):
            _write_npz(self.folder(job_id) / f"robust-{version}.npz", *memory_arrays(memory))

    def save_record(self, job_id: str, record: Mapping[str, Any]) -> None:
        """Commit a job's state; global files and the round folder it names must already be on disk."""
        folder = self.folder(job_id)
        doc = {"format": FORMAT_VERSION, "job_id": job_id, **record}
        what = f"the record of job {job_id!r}"
        with self._writing(what, job_id):
            folder.mkdir(parents=True, exist_ok=True)
            with _disk_full_is_an_outage(what):
                write_atomic(folder / "job.json", json.dumps(doc, sort_keys=True).encode())
            with self._guard:
                self._unnamed.get(job_id, set()).difference_update(int(v) for v in doc.get("versions", []))
            self._prune(job_id, folder, doc)

    def save_settings(self, job_id: str, raw: bytes) -> None:
        """A job's installed settings (written once: a job's settings never change)."""
        what = f"the settings of job {job_id!r}"
        with self._writing(what, job_id), _disk_full_is_an_outage(what):
            folder = self.folder(job_id)
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(folder / SETTINGS_FILE, raw)

    def load_settings(self) -> Iterator[tuple[Path, bytes]]:
        """Every installed job's settings file and bytes (none on a shared spool: each job's are read when its
        replica takes it, `settings_of`)."""
        if self.shared:
            return
        for path in sorted(self.root.glob(f"*/{SETTINGS_FILE}")):
            yield path, path.read_bytes()

    def settings_of(self, job_id: str) -> tuple[Path, bytes] | None:
        """One job's settings file and bytes, if it has some."""
        path = self.folder(job_id) / SETTINGS_FILE
        try:
            return path, path.read_bytes()
        except FileNotFoundError:
            return None

    def has_job(self, job_id: str) -> bool:
        """Whether a job was ever installed here (its settings or its record are on disk)."""
        folder = self.folder(job_id)
        return (folder / SETTINGS_FILE).is_file() or (folder / "job.json").is_file()

    def load_job(self, job_id: str) -> StoredJob | None:
        """One job's committed record and global models (a replica taking it over), None before its first
        record; a folder that does not load is quarantined (None)."""
        folder = self.folder(job_id)
        if not (folder / "job.json").is_file():
            return None
        try:
            return self._load_job(folder)
        except Exception as exc:
            self.quarantine(folder, exc, job_id)
            return None

    def save_update(self, job_id: str, round_number: int, seq: int, meta: Mapping[str, Any],
                    tensors: Mapping[str, np.ndarray]) -> Path:
        """An accepted update of a round, on disk before its receipt; its path."""
        return self._save(job_id, self.folder(job_id) / f"round-{round_number}", seq, meta, tensors,
                          what=f"an update for round {round_number} of job {job_id!r}")

    def save_buffered(self, job_id: str, version: int, seq: int, meta: Mapping[str, Any],
                      tensors: Mapping[str, np.ndarray]) -> Path:
        """An update accepted into the asynchronous buffer that builds on `version` (the version it will follow)."""
        return self._save(job_id, self.folder(job_id) / f"buffer-{version}", seq, meta, tensors,
                          what=f"an update for the buffer of job {job_id!r}")

    def _save(self, job_id: str, folder: Path, seq: int, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray],
              *, what: str) -> Path:
        path = folder / f"{seq:06d}.npz"
        with self._writing(what, job_id), _disk_full_is_an_outage(what):
            folder.mkdir(parents=True, exist_ok=True)
            _write_npz(path, tensors, dict(meta))
        return path

    def discard(self, path: Path, job_id: str | None = None) -> None:
        """Delete an update file that was not counted (its round closed during the upload)."""
        with self._writing(f"the deletion of {path}", job_id):
            path.unlink(missing_ok=True)

    # ----- reads -----

    def load(self) -> Iterator[StoredJob]:
        """Every job folder's committed record and global models; a folder that does not load is quarantined
        (`quarantine`) and the others are still yielded. Use `restore_jobs`, which also quarantines a job
        whose record loads but does not restore."""
        for record_path in sorted(self.root.glob("*/job.json")):
            folder = record_path.parent
            try:
                stored = self._load_job(folder)
            except Exception as exc:  # whatever a damaged file raises: one bad record never stops the others
                self.quarantine(folder, exc)
                continue
            yield stored

    def _load_job(self, folder: Path) -> StoredJob:
        record = json.loads((folder / "job.json").read_text(encoding="utf-8"))
        if not isinstance(record, dict) or record.get("format") != FORMAT_VERSION:
            raise ValueError(f"not a spool record of format {FORMAT_VERSION}")
        job_id = record.get("job_id")
        if not isinstance(job_id, str) or self.folder(job_id) != folder:
            raise ValueError(f"names job {job_id!r}, whose folder is not this one")
        versions = record.get("versions")
        if not isinstance(versions, list) or not versions:
            raise ValueError("names no global model version")
        globals_: dict[int, tuple[str, dict[str, np.ndarray]]] = {}
        for version in versions:
            tensors, meta = _read_npz(folder / f"global-{int(version)}.npz")
            globals_[int(version)] = (str(meta["spec_json"]), tensors)
        return StoredJob(record, globals_, folder)

    def updates(self, stored: StoredJob, round_number: int, *,
                kind: str = "round") -> Iterator[tuple[Path, dict[str, Any], dict[str, np.ndarray]]]:
        """The round's (kind "round") or a version's buffer's (kind "buffer") accepted updates in the order they
        were accepted (the running mean sums in that order), each with its file; a file that does not load is
        quarantined and skipped."""
        folder = stored.folder / f"{kind}-{round_number}"
        with self._writing(f"the cleanup of {folder}", stored.record.get("job_id")):
            for path in folder.glob(f".*{TEMP_SUFFIX}"):  # an upload that crashed before its receipt: never acknowledged
                path.unlink(missing_ok=True)
        for path in sorted(folder.glob("[0-9]*.npz")):
            try:
                tensors, meta = _read_npz(path)
            except Exception as exc:  # truncated, not a zip, no metadata
                self.quarantine(path, exc)
                continue
            yield path, meta, tensors

    def quarantine(self, path: Path, error: BaseException, job_id: str | None = None) -> None:
        """Move a job folder or an update file that does not load out of the way, into `quarantine/` inside
        the spool (kept for a person to look at, never read again), with a log line and a metric."""
        kind = "job" if path.is_dir() else "update"
        name = path.name if kind == "job" else f"{path.parent.parent.name}.{path.parent.name}.{path.name}"
        target = self.root / QUARANTINE_DIR / f"{name}.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        n = 1
        while target.exists():
            n += 1
            target = target.with_name(f"{target.name.split('~')[0]}~{n}")
        try:
            with self._writing(f"the quarantine of {path}", job_id):
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
        except OSError as exc:
            log.error("spool: %s does not load (%s: %s) and could not be quarantined (%s); skipped this time",
                      path, type(error).__name__, error, exc)
        else:
            log.error("spool: %s does not load (%s: %s); moved to %s%s", path, type(error).__name__, error, target,
                      "; the service goes on with every other job" if kind == "job"
                      else "; its job is restored without that update")
        metrics.SPOOL_QUARANTINED.labels(kind).inc()

    # ----- housekeeping -----

    def _prune(self, job_id: str, folder: Path, record: Mapping[str, Any]) -> None:
        """Delete what the committed record no longer names: older global versions (but not one written for a
        record still to come) and closed rounds' folders. The caller is writing (`_writing`)."""
        with self._guard:  # a global file written meanwhile was announced first (`save_global`): it is kept
            unnamed = list(self._unnamed.get(job_id, ()))
            keep = {f"global-{int(v)}.npz" for v in [*record.get("versions", []), *unnamed]}
            keep |= {f"robust-{int(v)}.npz" for v in [*unnamed, record.get("robust")] if v is not None}
            for path in [*folder.glob("global-*.npz"), *folder.glob("robust-*.npz")]:
                if path.name not in keep:
                    path.unlink(missing_ok=True)
        open_round = (record.get("round") or {}).get("number")
        buffer = f"buffer-{max(record.get('versions') or [0])}" if record.get("async") else None
        for path in folder.iterdir():
            name = path.name
            if path.is_dir() and ((name.startswith("round-") and name != f"round-{open_round}")
                                  or (name.startswith("buffer-") and name != buffer)):
                shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def _sweep(folder: Path) -> None:
        """Delete the temporary files a crash left in a job folder: only at start, when none is being written
        (a running service's are writes under way)."""
        for path in folder.glob(f".*{TEMP_SUFFIX}"):
            path.unlink(missing_ok=True)


def job_folder(root: Path, job_id: str) -> Path:
    """A job's folder in the spool `root`: a name that is safe whatever the job id holds, and distinct for
    distinct ids. Where to look without opening the spool (which only one service may hold)."""
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:12]
    return root / f"{_SAFE.sub('_', job_id)[:60]}-{digest}"


def _write_npz(path: Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    if META_KEY in tensors:
        raise ValueError(f"a tensor may not be named {META_KEY!r}")
    arrays: dict[str, Any] = {name: np.ascontiguousarray(arr) for name, arr in tensors.items()}
    arrays[META_KEY] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)

    def write(fh: BinaryIO) -> None:
        np.savez(fh, **arrays)

    write_atomic(path, write)


def _read_npz(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(path, allow_pickle=False) as data:
        tensors = {name: data[name] for name in data.files if name != META_KEY}
        meta = json.loads(bytes(data[META_KEY]).decode())
    return tensors, meta


# ----- the book's state ↔ records -----


def job_record(job: Job) -> dict[str, Any]:
    """A job's commit record (its global versions are written apart, before it)."""
    rnd = job.round if job.round is not None and not job.round.closed else None
    last = None
    if job.last_close is not None:
        n, r = job.last_close
        last = {"round": n, "model_version": r.model_version, "aggregated": r.aggregated,
                "model_spec_json": r.model_spec_json, "stats": r.stats, "seconds": r.seconds,
                "updates": [vars(u) for u in r.updates],
                "selection": None if r.selection is None else asdict(r.selection),
                "verdicts": [asdict(v) for v in r.verdicts], "excluded": list(r.excluded)}
    return {
        "seed": job.seed,
        "versions": sorted(job.versions),
        "closed_rounds": sorted(job.closed_rounds),
        "closed_accepted": {str(n): w for n, w in job.closed_accepted.items()},
        "closed_receipts": {str(n): {w: [r.bytes_received, r.sha256] for w, r in kept.items()}
                            for n, kept in job.closed_receipts.items()},
        "closed_deadlines": {str(n): d for n, d in job.closed_deadlines.items()},
        "last_close": last,
        "site_clip": job.site_clip,
        "async": None if job.asynchronous is None else state_record(job.asynchronous),
        "robust": None if job.robust_memory is None else job.version,   # robust-<version>.npz
        "round": None if rnd is None else {
            "number": rnd.number, "participants": sorted(rnd.participants), "deadline": rnd.deadline,
            "aggregation": rnd.aggregation, "histograms": rnd.histograms, "num_samples": rnd.sample_limits,
        },
    }


def update_record(entry: Accepted, seq: int) -> dict[str, Any]:
    """An accepted update's metadata; `seq` is its acceptance order (the running mean sums in that order)."""
    m = entry.meta
    return {"worker_id": entry.worker_id, "num_samples": entry.num_samples, "raw_weight": entry.raw_weight,
            "sha256": entry.sha256, "bytes_received": entry.bytes_received, "epsilon": entry.epsilon,
            "train_loss": entry.train_loss, "ish": m.ish, "loss": m.loss, "seq": seq}
