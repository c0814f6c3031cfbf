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

One service at a time: an open Spool holds `spool.lock` in its root (`fedbroker.files.FolderLock`), so a
second service on the same folder is refused (`SpoolInUse`) instead of deleting the files the first one's
records name; it waits `aggregator.spool_lock_wait_s` first, so a quick restart starts once the old process
has exited. `close()` waits for the writes under way, then lets the next service in; a write through a
closed spool raises `SpoolClosed`, so a handler thread that outlives its stopped service touches nothing.

`job_record`/`restore_job` translate between the book's state (`aggregators.job_state`) and these records.
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
from fedbroker.aggregators.async_state import folded_from_record, new_async_state, restore_fields, state_record
from fedbroker.aggregators.job_algorithms import Algorithms
from fedbroker.aggregators.job_state import Accepted, CloseResult, Job, Receipt, UpdateSummary, new_round
from fedbroker.aggregators.robust import RobustMemory, memory_arrays, memory_from_arrays
from fedbroker.aggregators.secure_session import SecureSession
from fedbroker.aggregators.weighting.base import UpdateMeta
from fedbroker.close_report import SelectionRecord, Verdict
from fedbroker.errors import ConfigError, NotFound, Rejection, Unavailable, UploadRejected
from fedbroker.files import TEMP_SUFFIX, FolderLock, FolderLocked, write_atomic
from fedbroker.job.spec import parameter_shapes, parse_model
from fedbroker.weights.plan import ModelPlan, all_shapes, trainable_shapes

# The job's algorithms for a round or buffer being restored: its installed settings', else (a record of an older
# service) those of the aggregation section the record kept (`InstalledJobs.for_round`).
AlgorithmsFor = Callable[[str, Mapping[str, Any] | None], Algorithms]

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

    def __init__(self, root: str | os.PathLike[str], *, lock_wait_s: float = 0.0) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        try:
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
        self._lock.release()

    @contextlib.contextmanager
    def _writing(self, what: str) -> Generator[None, None, None]:
        """One write (or deletion) in the folder, refused once the spool is closed; `close` waits for it."""
        with self._guard:
            if self._closed:
                raise SpoolClosed(f"the spool {self.root} is closed (its aggregation service stopped): "
                                  f"{what} not written")
            self._writers += 1
        try:
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
        with self._writing(what), _disk_full_is_an_outage(what):
            with self._guard:  # before the file exists, so no prune that sees the file can miss it
                self._unnamed.setdefault(job_id, set()).add(version)
            folder = self.folder(job_id)
            folder.mkdir(parents=True, exist_ok=True)
            _write_npz(folder / f"global-{version}.npz", tensors, {"version": version, "spec_json": spec_json})

    def save_robust(self, job_id: str, version: int, memory: RobustMemory) -> None:
        """The robust rule's memory after the close that made `version`, after that version's `save_global`
        (so the prune keeps it as it keeps the global file) and before the record that names it."""
        what = f"the robust memory of job {job_id!r}"
        with self._writing(what), _disk_full_is_an_outage(what):
            _write_npz(self.folder(job_id) / f"robust-{version}.npz", *memory_arrays(memory))

    def save_record(self, job_id: str, record: Mapping[str, Any]) -> None:
        """Commit a job's state; global files and the round folder it names must already be on disk."""
        folder = self.folder(job_id)
        doc = {"format": FORMAT_VERSION, "job_id": job_id, **record}
        what = f"the record of job {job_id!r}"
        with self._writing(what):
            folder.mkdir(parents=True, exist_ok=True)
            with _disk_full_is_an_outage(what):
                write_atomic(folder / "job.json", json.dumps(doc, sort_keys=True).encode())
            with self._guard:
                self._unnamed.get(job_id, set()).difference_update(int(v) for v in doc.get("versions", []))
            self._prune(job_id, folder, doc)

    def save_settings(self, job_id: str, raw: bytes) -> None:
        """A job's installed settings (written once: a job's settings never change)."""
        what = f"the settings of job {job_id!r}"
        with self._writing(what), _disk_full_is_an_outage(what):
            folder = self.folder(job_id)
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(folder / SETTINGS_FILE, raw)

    def load_settings(self) -> Iterator[tuple[Path, bytes]]:
        """Every installed job's settings file and bytes."""
        for path in sorted(self.root.glob(f"*/{SETTINGS_FILE}")):
            yield path, path.read_bytes()

    def save_update(self, job_id: str, round_number: int, seq: int, meta: Mapping[str, Any],
                    tensors: Mapping[str, np.ndarray]) -> Path:
        """An accepted update of a round, on disk before its receipt; its path."""
        return self._save(self.folder(job_id) / f"round-{round_number}", seq, meta, tensors,
                          what=f"an update for round {round_number} of job {job_id!r}")

    def save_buffered(self, job_id: str, version: int, seq: int, meta: Mapping[str, Any],
                      tensors: Mapping[str, np.ndarray]) -> Path:
        """An update accepted into the asynchronous buffer that builds on `version` (the version it will follow)."""
        return self._save(self.folder(job_id) / f"buffer-{version}", seq, meta, tensors,
                          what=f"an update for the buffer of job {job_id!r}")

    def _save(self, folder: Path, seq: int, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *,
              what: str) -> Path:
        path = folder / f"{seq:06d}.npz"
        with self._writing(what), _disk_full_is_an_outage(what):
            folder.mkdir(parents=True, exist_ok=True)
            _write_npz(path, tensors, dict(meta))
        return path

    def discard(self, path: Path) -> None:
        """Delete an update file that was not counted (its round closed during the upload)."""
        with self._writing(f"the deletion of {path}"):
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
        with self._writing(f"the cleanup of {folder}"):
            for path in folder.glob(f".*{TEMP_SUFFIX}"):  # an upload that crashed before its receipt: never acknowledged
                path.unlink(missing_ok=True)
        for path in sorted(folder.glob("[0-9]*.npz")):
            try:
                tensors, meta = _read_npz(path)
            except Exception as exc:  # truncated, not a zip, no metadata
                self.quarantine(path, exc)
                continue
            yield path, meta, tensors

    def quarantine(self, path: Path, error: BaseException) -> None:
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
            with self._writing(f"the quarantine of {path}"):
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


def restore_job(spool: Spool, stored: StoredJob, algorithms_for: AlgorithmsFor) -> Job:
    """A job as committed, with its open round refilled from the spooled updates in their acceptance order."""
    record = stored.record
    versions = {v: tensors for v, (_, tensors) in stored.globals.items()}
    specs = {v: spec_json for v, (spec_json, _) in stored.globals.items()}
    try:  # what the job trains (fedbroker.weights): its global models hold adapters, its updates a subset
        plan = algorithms_for(record["job_id"], None).installed.plan
    except NotFound:
        plan = ModelPlan()
    for v, tensors in versions.items():
        _check_tensors(tensors, all_shapes(parse_model(json.loads(specs[v])), plan))
    job = Job(record["job_id"], parse_model(json.loads(specs[max(specs)])), int(record["seed"]), versions, specs,
              closed_rounds={int(n) for n in record["closed_rounds"]},
              closed_accepted={int(n): list(w) for n, w in record.get("closed_accepted", {}).items()},
              closed_deadlines={int(n): float(d) for n, d in record.get("closed_deadlines", {}).items()},
              closed_receipts={int(n): {w: Receipt(record["job_id"], int(n), w, True, int(size), str(sha))
                                        for w, (size, sha) in kept.items()}
                               for n, kept in record.get("closed_receipts", {}).items()})
    if record.get("robust") is not None:  # a damaged file fails the job's restore: quarantined, as a global's
        job.robust_memory = memory_from_arrays(*_read_npz(spool.folder(job.job_id) / f"robust-{int(record['robust'])}.npz"))
    last = record.get("last_close")
    if last:
        job.last_close = (int(last["round"]), CloseResult(
            int(last["model_version"]), list(last["aggregated"]), last["model_spec_json"],
            {k: float(v) for k, v in last["stats"].items()}, float(last["seconds"]),
            [UpdateSummary(**u) for u in last["updates"]],
            SelectionRecord(**last["selection"]) if last.get("selection") else None,
            [Verdict(**v) for v in last.get("verdicts", [])], [str(w) for w in last.get("excluded", [])]))
    r = record.get("round")
    if r:
        aggregation = dict(r["aggregation"])
        job.round = new_round(int(r["number"]), frozenset(r["participants"]), float(r["deadline"]),
                              algorithms_for(job.job_id, aggregation), aggregation,
                              {w: list(h) for w, h in r["histograms"].items()}, job.spec,
                              sample_limits={w: int(n) for w, n in (r.get("num_samples") or {}).items()})
        shapes = trainable_shapes(job.spec, plan)
        if aggregation.get("secure"):  # its keys and masked sum were in the dead service's memory only
            job.round.secure = SecureSession.lost(job_id=job.job_id, round_number=job.round.number,
                                                  participants=job.round.participants, length=0)
            log.warning("job %s: %s", job.job_id, job.round.secure.failed)
        for path, meta, tensors in spool.updates(stored, job.round.number):
            try:
                entry = _accepted_from_record(meta)
                seq = int(meta["seq"])
                _check_tensors(tensors, shapes)
            except Exception as exc:  # a damaged update: quarantined, the round goes on with the others
                spool.quarantine(path, exc)
                continue
            job.round.next_seq = seq + 1
            job.round.accept(entry, tensors, None)
        log.info("job %s: round %d reopened with %d accepted update(s) from the spool", job.job_id,
                 job.round.number, len(job.round.accepted))
    if record.get("async"):
        _restore_async(spool, stored, job, record["async"], algorithms_for)
    return job


def _restore_async(spool: Spool, stored: StoredJob, job: Job, record: Mapping[str, Any],
                   algorithms_for: AlgorithmsFor) -> None:
    """The async state as committed, its buffer refilled by replaying the spooled updates in acceptance order
    (the buffer sums in that order, so the next version is the one the service would have published)."""
    config = dict(record["config"])
    state = new_async_state(config, {w: int(n) for w, n in record["num_samples"].items()},
                            algorithms_for(job.job_id, config.get("aggregation")))
    restore_fields(state, record)
    shapes = parameter_shapes(job.spec)
    for path, meta, tensors in spool.updates(stored, job.version, kind="buffer"):
        try:
            entry = folded_from_record(meta)
            _check_tensors(tensors, shapes)
            base = job.versions[entry.base]
        except Exception as exc:  # a damaged update: quarantined, the buffer goes on with the others
            spool.quarantine(path, exc)
            continue
        state.fold(entry, tensors, base)
    job.asynchronous = state
    if state.folded:
        log.info("job %s: asynchronous buffer on version %d reopened with %d update(s) from the spool", job.job_id,
                 job.version, len(state.folded))


def restore_jobs(spool: Spool, algorithms_for: AlgorithmsFor) -> Iterator[Job]:
    """Every job the spool holds, restored; a job whose record or global models do not load or restore is
    quarantined (`Spool.quarantine`), so one damaged record never stops the service or another job."""
    for stored in spool.load():
        try:
            job = restore_job(spool, stored, algorithms_for)
        except Exception as exc:
            spool.quarantine(stored.folder, exc)
            continue
        with spool._writing(f"the cleanup of {stored.folder}"):
            spool._prune(job.job_id, stored.folder, stored.record)
            spool._sweep(stored.folder)
        yield job


def _check_tensors(tensors: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """An update file holds exactly the model's float32 tensors (it was checked on arrival; a file may rot)."""
    got = {name: tuple(arr.shape) for name, arr in tensors.items()}
    if got != {name: tuple(shape) for name, shape in shapes.items()}:
        raise ValueError(f"its tensors {got} are not the model's {dict(shapes)}")
    for name, arr in tensors.items():
        if arr.dtype != np.float32:
            raise ValueError(f"tensor {name!r} is {arr.dtype}, not float32")


def _accepted_from_record(r: Mapping[str, Any]) -> Accepted:
    meta = UpdateMeta(worker_id=r["worker_id"], num_samples=int(r["num_samples"]), ish=r["ish"], loss=r["loss"])
    return Accepted(r["worker_id"], int(r["num_samples"]), float(r["raw_weight"]), r["sha256"],
                    int(r["bytes_received"]), meta, epsilon=float(r["epsilon"]), train_loss=float(r["train_loss"]))
