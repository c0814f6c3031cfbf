"""The coordinator's state directory: one coordinator at a time (an `flock` naming its holder), owner-only files.

`StateStore.in_directory` opens a coordinator's state through it: the folder (0700) is locked
(`coordinator.lock`) so a second coordinator on it is refused, naming the holder's pid. A coordinator whose state
is in PostgreSQL (`coordinator.database_url`) keeps only its checkpoints here, and marks the folder with where the
state is (`DATABASE_MARK`, the URL without its password), so a backup of the folder alone is refused, not partial.
"""

from __future__ import annotations

import logging
import os
import stat

from fedbroker.errors import ConfigError
from fedbroker.files import FolderLock, FolderLocked

log = logging.getLogger(__name__)

LOCK_FILE = "coordinator.lock"
DATABASE_MARK = "coordinator.database"  # the database URL (no password) of a state kept in PostgreSQL


class StateDirInUse(ConfigError):
    """Another coordinator holds this state directory's lock."""

    reason = "state_dir_in_use"


class StateDirLock:
    """An exclusive `flock` on `<state_dir>/coordinator.lock` (`fedbroker.files.FolderLock`), holding this
    process's pid.

    Two coordinators on one state directory would both write the SQLite file and the checkpoints and resume
    the same jobs twice. The kernel drops the lock when the process dies, however it dies, so a stale lock
    file never blocks a restart.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        try:
            self._lock = FolderLock(directory, LOCK_FILE)
        except FolderLocked as exc:
            raise StateDirInUse(
                "coordinator.state_dir",
                f"{directory} is in use by another coordinator (pid {exc.holder}, which holds {self.path}); two "
                f"coordinators on one state directory would overwrite each other's state: stop that one, or "
                f"give this one its own state_dir",
            ) from None

    def release(self) -> None:
        """Let the next coordinator in (the process's exit would too)."""
        self._lock.release()


def owner_only(path: str, mode: int) -> None:
    """Tighten an existing `path` to `mode`: the state holds every job and worker (absent: nothing to do)."""
    if not os.path.exists(path):
        return
    current = stat.S_IMODE(os.stat(path).st_mode)
    if current & 0o077:
        try:
            os.chmod(path, mode)
        except OSError as exc:
            log.warning("%s is readable by others (mode %o) and could not be tightened: %s", path, current, exc)


def mark_database(directory: str, where: str) -> None:
    """Record in a state directory (created 0700) that its coordinator's state is in the database `where`."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    owner_only(directory, 0o700)
    path = os.path.join(directory, DATABASE_MARK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(where + "\n")


def database_of(directory: str) -> str:
    """The database a state directory's coordinator keeps its state in (empty: an embedded SQLite state)."""
    try:
        with open(os.path.join(directory, DATABASE_MARK), encoding="utf-8") as mark:
            return mark.read(4096).strip()
    except FileNotFoundError:
        return ""
