"""A consistent backup of a coordinator's state directory while the coordinator runs, and its restore.

The SQLite file is copied through SQLite's online backup API in one step (`Connection.backup`, all pages at
once): it reads one snapshot under a read transaction, which in WAL mode never blocks the coordinator's writes,
and no write is half in it. A file copy of a live database could mix pages of two transactions, or miss the
WAL. The copy is checked (`PRAGMA integrity_check`) and left in rollback-journal mode, one self-contained file.

Checkpoints are copied as that snapshot names them (`rounds.checkpoint`): a checkpoint is written (atomically)
before the round's close records it and never changes after, so every file the snapshot names exists and is
whole; one written after the snapshot is not named and not needed. Restoring rewrites those paths to the
target's `checkpoints/` folder, so a state restored elsewhere finds its checkpoints.

A restore takes the target's lock (`StateDirLock`): refused while a coordinator runs on it.

Only an embedded (SQLite) state is backed up here. A coordinator on PostgreSQL (`coordinator.database_url`) marks
its state directory (`state_dir.DATABASE_MARK`) and a backup of it is refused, naming the tools that do back a
PostgreSQL database up consistently: pg_dump, or the operator's (CloudNativePG's) backups.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

from fedbroker.backup import BackupRefused, FileEntry, Part, claim_target, copy_file, file_digest, remove, verify
from fedbroker.coordinator.checkpoints import load_checkpoint
from fedbroker.coordinator.schema import file_version
from fedbroker.coordinator.state_dir import LOCK_FILE, StateDirLock, database_of
from fedbroker.coordinator.store import DB_FILE
from fedbroker.coordinator.store_schema import SCHEMA
from fedbroker.errors import ConfigError

PART = "coordinator"
CHECKPOINTS = "checkpoints"


def backup_state(state_dir: str | os.PathLike[str], backup_root: Path, *, busy_timeout_s: float = 30.0) -> Part:
    """Copy the coordinator state in `state_dir` into `backup_root/coordinator/`; its manifest entry."""
    refuse_a_database(state_dir)
    source = Path(state_dir).absolute()
    db_path = source / DB_FILE
    if not db_path.is_file():
        raise ConfigError("--state", f"{source} holds no coordinator state (no {DB_FILE})")
    folder = backup_root / PART
    folder.mkdir(mode=0o700, parents=True)
    copy = folder / DB_FILE
    os.close(os.open(copy, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
    with _connection(f"{db_path.as_uri()}?mode=rw", busy_timeout_s) as src, _connection(str(copy), busy_timeout_s) as dst:
        src.backup(dst)  # pages=-1: every page in one step, one consistent snapshot
        dst.execute("PRAGMA journal_mode=DELETE")
        _check_integrity(dst, f"the backup of {db_path}")
        version = file_version(dst, str(copy))
        named = dst.execute("SELECT DISTINCT job_id, checkpoint FROM rounds WHERE checkpoint IS NOT NULL"
                            " AND checkpoint != '' ORDER BY job_id, checkpoint").fetchall()
        counts = {table: dst.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                  for table in ("jobs", "rounds", "workers")}
    part = Part(PART, str(source), version, details={**counts, "checkpoints": {}})
    part.files.append(FileEntry(DB_FILE, *file_digest(copy)))
    for job_id, recorded in named:
        relative = f"{CHECKPOINTS}/{job_id}/{Path(recorded).name}"
        found = _find_checkpoint(source, recorded, relative)
        sha, size = copy_file(found, folder / relative)
        try:
            load_checkpoint(folder / relative)
        except (ValueError, KeyError) as exc:
            raise BackupRefused(f"checkpoint {found} (job {job_id}) does not load: {exc}") from None
        part.files.append(FileEntry(relative, sha, size))
        part.details["checkpoints"][relative] = recorded
    return part


def refuse_a_database(state_dir: str | os.PathLike[str]) -> None:
    """A state kept in PostgreSQL (a URL, or a state directory its coordinator marked) is not this backup's."""
    where = str(state_dir) if "://" in str(state_dir) else database_of(str(state_dir))
    if where:
        raise BackupRefused(f"the coordinator's state is in a database ({where}), not in an embedded SQLite file: "
                            f"`fedbroker backup` copies only the embedded state; use pg_dump or your operator's backups "
                            f"(CloudNativePG), and back the checkpoints folder up with them")


def round_marks(state_dir: str | os.PathLike[str] | Path) -> list[tuple[str, int, str]]:
    """Every round's (job, round, status) in the state directory (or the backup part's folder) `state_dir`: what
    must not move while a spool backed up with this state is copied (app/backup.py)."""
    db_path = Path(state_dir).absolute() / DB_FILE
    with _connection(f"{db_path.as_uri()}?mode=rw", 30.0) as db:  # rw: a WAL file read-only needs its -shm
        rows = db.execute("SELECT job_id, round, status FROM rounds ORDER BY job_id, round").fetchall()
    return [(str(j), int(n), str(s)) for j, n, s in rows]


def restore_state(backup_root: Path, part: Part, target: str | os.PathLike[str], *, force: bool,
                  check_only: bool = False) -> None:
    """Restore the backup's coordinator part into the state directory `target` (created 0700), its checkpoint
    paths rewritten to it; refused while a coordinator runs there, and over a non-empty one unless `force`.
    `check_only`: the refusals only (not the digests), nothing written."""
    if not check_only:
        verify(backup_root, part)
    check_schema(backup_root, part)
    folder = Path(target).absolute()
    if check_only and not folder.exists():
        return
    if not check_only:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = StateDirLock(str(folder))  # StateDirInUse while a coordinator runs on it
    try:
        held = claim_target(folder, force=force, ignore={LOCK_FILE})
        if check_only:
            return
        remove(p for p in held if p.name in {DB_FILE, f"{DB_FILE}-wal", f"{DB_FILE}-shm", CHECKPOINTS})
        source = backup_root / PART
        moved: dict[str, str] = {}
        for f in part.files:
            if f.path == DB_FILE:
                continue
            sha, size = copy_file(source / f.path, folder / f.path)
            if (sha, size) != (f.sha256, f.bytes):
                raise BackupRefused(f"{source / f.path} changed while it was restored")
            moved[str(part.details.get("checkpoints", {}).get(f.path, ""))] = str(folder / f.path)
        _restore_db(source / DB_FILE, folder / DB_FILE, moved)
    finally:
        lock.release()


def check_schema(backup_root: Path, part: Part) -> None:
    """The part's schema version, as its manifest says and as the backed-up database itself records it
    (`user_version` and its Alembic revision: what a coordinator will read, whatever the manifest says), is one
    this code knows: a newer one is refused (SchemaTooNew), a negative one as written by no release, and the two
    must agree."""
    backup_db = backup_root / PART / DB_FILE
    SCHEMA.check(part.version, f"the backup's manifest ({backup_root}), for its {PART} part,")
    with _connection(f"{backup_db.absolute().as_uri()}?mode=ro", 30.0) as db:
        found = file_version(db, str(backup_db))
    SCHEMA.check(found, str(backup_db))
    if found != part.version:
        raise BackupRefused(f"{backup_db} is at schema version {found}, but the backup's manifest says {part.version}: "
                            f"the manifest does not describe this file (edited, or another file copied in)")


def _restore_db(backup_db: Path, target_db: Path, moved: dict[str, str]) -> None:
    """The backup's SQLite file into `target_db` (through a temporary file and a rename), checkpoints moved."""
    temporary = target_db.with_name(f".{target_db.name}.restoring")
    temporary.unlink(missing_ok=True)
    os.close(os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
    with _connection(f"{backup_db.absolute().as_uri()}?mode=ro", 30.0) as src, _connection(str(temporary), 30.0) as dst:
        src.backup(dst)
        dst.execute("BEGIN IMMEDIATE")
        for recorded, restored in moved.items():
            if recorded:
                dst.execute("UPDATE rounds SET checkpoint = ? WHERE checkpoint = ?", (restored, recorded))
        dst.execute("COMMIT")
        _check_integrity(dst, f"the restored {target_db}")
    os.replace(temporary, target_db)


def _find_checkpoint(source: Path, recorded: str, relative: str) -> Path:
    """A checkpoint the state names: where it was recorded (relative paths are the coordinator's working
    folder's, unknown here), else where the coordinator keeps them: `<state_dir>/checkpoints/<job>/<file>`."""
    for candidate in (Path(recorded), source / relative):
        if candidate.is_absolute() and candidate.is_file():
            return candidate
    raise BackupRefused(f"the coordinator state in {source} names checkpoint {recorded}, which is neither there nor "
                        f"at {source / relative}: the state is already missing a file (backup not written)")


def _check_integrity(db: sqlite3.Connection, what: str) -> None:
    result = [r[0] for r in db.execute("PRAGMA integrity_check").fetchall()]
    if result != ["ok"]:
        raise BackupRefused(f"{what} fails SQLite's integrity check: {'; '.join(result[:5])}")


@contextlib.contextmanager
def _connection(uri: str, busy_timeout_s: float) -> Iterator[sqlite3.Connection]:
    try:
        db = sqlite3.connect(uri, uri=uri.startswith("file:"), isolation_level=None, timeout=busy_timeout_s)
    except sqlite3.Error as exc:
        raise BackupRefused(f"cannot open {uri}: {exc}") from None
    try:
        yield db
    except sqlite3.Error as exc:
        raise BackupRefused(f"{uri}: {exc}") from exc
    finally:
        db.close()
