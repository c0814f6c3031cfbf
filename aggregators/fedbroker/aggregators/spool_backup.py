"""A consistent backup of the aggregation service's spool while the service runs, and its restore.

The spool (spool.py) is files, each written atomically, with one commit record per job (`job.json`) that names
the global models and the open round the job needs. A job folder is copied as its record names it: the record
is read, then the job's installed settings, the global files it names and the update files in its open round's (or
asynchronous buffer's) folder, then the record is read again. A record that changed meanwhile (a round closed, a version published and
older files pruned) means the copy may mix two states: that job is copied again, up to `ATTEMPTS` times. An
update file that lands in the open round during the copy may or may not be in it, exactly as after a crash at
that moment: the restored service counts the updates whose files it finds (the coordinator asks the workers
whose upload it lost again). Files are opened before they are read, so a file renamed over meanwhile is read
whole, old or new, never half of each.

A restore takes the spool's lock (`spool.lock`): refused while a service runs on it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any

from fedbroker.aggregators.spool import FORMAT_VERSION, LOCK_FILE, QUARANTINE_DIR, SETTINGS_FILE, SpoolInUse
from fedbroker.backup import BackupRefused, FileEntry, Part, check_version, claim_target, copy_file, remove, verify
from fedbroker.errors import ConfigError
from fedbroker.files import FolderLock, FolderLocked

PART = "spool"
RECORD = "job.json"
ATTEMPTS = 20


class _Moved(Exception):
    """A file the record named went while it was copied: the record moved on."""


def backup_spool(spool_dir: str | os.PathLike[str], backup_root: Path) -> Part:
    """Copy every job of the spool in `spool_dir` into `backup_root/spool/`; its manifest entry."""
    source = Path(spool_dir).absolute()
    if not source.is_dir():
        raise ConfigError("--spool", f"{source} is not a folder (the aggregation service's spool_dir)")
    folder = backup_root / PART
    folder.mkdir(mode=0o700, parents=True)
    part = Part(PART, str(source), FORMAT_VERSION, details={"jobs": 0, "updates": 0})
    for record_path in sorted(source.glob(f"*/{RECORD}")):
        job_folder = record_path.parent
        if job_folder.name == QUARANTINE_DIR:
            continue
        entries, updates = _copy_job(job_folder, folder / job_folder.name)
        part.files += entries
        part.details["jobs"] += 1
        part.details["updates"] += updates
    return part


def _copy_job(job_folder: Path, target: Path) -> tuple[list[FileEntry], int]:
    """One job folder as one of its records names it (see the module); (its entries, its update files)."""
    for _ in range(ATTEMPTS):
        if target.exists():
            shutil.rmtree(target)
        try:
            record_bytes = (job_folder / RECORD).read_bytes()
            record = json.loads(record_bytes)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
            entries, updates = _copy_named(job_folder, target, record)
            if (job_folder / RECORD).read_bytes() != record_bytes:
                continue  # the job moved on while it was copied: again
        except (_Moved, FileNotFoundError):
            continue
        except ValueError as exc:
            raise BackupRefused(f"{job_folder / RECORD} is not a spool record ({exc}): the service quarantines "
                                f"it at its next start; move it aside, or stop the service and look") from None
        copy_file(io.BytesIO(record_bytes), target / RECORD)
        entries.insert(0, _entry(job_folder.name, RECORD, record_bytes))
        return entries, updates
    raise BackupRefused(f"the spool job {job_folder} changed on each of {ATTEMPTS} tries to copy it; back up between "
                        f"rounds, or stop the aggregation service")


def _copy_named(job_folder: Path, target: Path, record: dict[str, Any]) -> tuple[list[FileEntry], int]:
    if record.get("format") != FORMAT_VERSION:
        raise ValueError(f"format {record.get('format')!r}, not {FORMAT_VERSION}")
    names = [f"global-{int(v)}.npz" for v in record.get("versions") or []]
    if (job_folder / SETTINGS_FILE).is_file():  # the job's installed settings: written once, never replaced
        names.insert(0, SETTINGS_FILE)
    folders = []
    if record.get("round"):
        folders.append(f"round-{int(record['round']['number'])}")
    if record.get("async"):
        folders.append(f"buffer-{max(int(v) for v in record.get('versions') or [0])}")
    updates = 0
    for sub in folders:
        found = sorted(p.name for p in (job_folder / sub).glob("[0-9]*.npz")) if (job_folder / sub).is_dir() else []
        names += [f"{sub}/{name}" for name in found]
        updates += len(found)
    entries = []
    for name in names:
        try:
            fh = open(job_folder / name, "rb")  # noqa: SIM115 (closed below; opened first: a rename after is harmless)
        except FileNotFoundError:
            raise _Moved(name) from None
        with fh:
            sha, size = copy_file(fh, target / name)
        entries.append(FileEntry(f"{job_folder.name}/{name}", sha, size))
    return entries, updates


def restore_spool(backup_root: Path, part: Part, target: str | os.PathLike[str], *, force: bool,
                  check_only: bool = False) -> None:
    """Restore the backup's spool into `target`; refused while a service runs on it, and over a spool that holds
    jobs unless `force` (which replaces its job folders; the quarantine is kept). `check_only`: the refusals only
    (not the digests), nothing written."""
    check_version(part, FORMAT_VERSION, "of spool format")
    folder = Path(target).absolute()
    if check_only and not folder.exists():
        return
    if not check_only:
        verify(backup_root, part)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        lock = FolderLock(folder, LOCK_FILE)
    except FolderLocked as exc:
        raise SpoolInUse("--spool", f"{folder} is in use by an aggregation service (pid {exc.holder}): stop it "
                                    f"before restoring its spool") from None
    try:
        held = claim_target(folder, force=force, ignore={LOCK_FILE, QUARANTINE_DIR})
        if check_only:
            return
        remove(held)
        for f in part.files:
            sha, size = copy_file(backup_root / PART / f.path, folder / f.path)
            if (sha, size) != (f.sha256, f.bytes):
                raise BackupRefused(f"{backup_root / PART / f.path} changed while it was restored")
    finally:
        lock.release()


def _entry(job: str, name: str, content: bytes) -> FileEntry:
    return FileEntry(f"{job}/{name}", hashlib.sha256(content).hexdigest(), len(content))
