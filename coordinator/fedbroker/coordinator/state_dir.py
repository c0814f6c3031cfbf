"""The coordinator's state directory: one coordinator at a time (an `flock` naming its holder), owner-only files.

`StateStore.in_directory` opens a coordinator's state through it: the folder (0700) is locked
(`coordinator.lock`) so a second coordinator on it is refused, naming the holder's pid.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat

from fedbroker.errors import ConfigError

log = logging.getLogger(__name__)

LOCK_FILE = "coordinator.lock"


class StateDirInUse(ConfigError):
    """Another coordinator holds this state directory's lock."""

    reason = "state_dir_in_use"


class StateDirLock:
    """An exclusive `flock` on `<state_dir>/coordinator.lock`, holding this process's pid.

    Two coordinators on one state directory would both write the SQLite file and the checkpoints and resume
    the same jobs twice. The kernel drops the lock when the process dies, however it dies, so a stale lock
    file never blocks a restart.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, LOCK_FILE)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise StateDirInUse(
                "coordinator.state_dir",
                f"{directory} is in use by another coordinator (pid {holder}, which holds {self.path}); two "
                f"coordinators on one state directory would overwrite each other's state: stop that one, or "
                f"give this one its own state_dir",
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        """Let the next coordinator in (the process's exit would too)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


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
