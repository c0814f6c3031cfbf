"""Atomic file replacement, one writer per folder, and reading a file a setting names.

The spool, the worker's privacy ledger and the coordinator's checkpoints all write through `write_atomic`:
a crash leaves the old file or the new one, never half of one. The coordinator's state directory and the
aggregation service's spool are each held by one process at a time through a `FolderLock`.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from fedbroker.errors import ConfigError

LOCK_POLL_S = 0.05    # between tries of a FolderLock that waits for its holder to exit
TEMP_SUFFIX = ".tmp"  # a temp file is named `.<final name>.<random>.tmp`; readers may sweep leftovers by it


def write_atomic(path: str | os.PathLike[str], content: bytes | Callable[[BinaryIO], None], *,
                 mode: int = 0o600) -> None:
    """Replace `path` with `content` (bytes, or a function that writes to a binary file object).

    Writes a uniquely named temp file in the same folder, fsyncs it, renames it over `path` and fsyncs the
    folder so the rename itself survives a power cut. The file gets `mode` (owner-only by default); on any
    failure the temp file is removed and `path` is left as it was.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TEMP_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode != 0o600:  # mkstemp creates the file 0600 already
                os.fchmod(fh.fileno(), mode)
            if isinstance(content, bytes):
                fh.write(content)
            else:
                content(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)


def _fsync_folder(folder: str | os.PathLike[str]) -> None:
    """Make renames and creations in `folder` durable; not every platform lets a folder be opened."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class FolderLocked(Exception):
    """Another holder has the lock file `path`; `holder` is the pid it wrote ("unknown" if none)."""

    def __init__(self, path: str, holder: str, *, waited_s: float = 0.0) -> None:
        self.path = path
        self.holder = holder
        self.waited_s = waited_s
        super().__init__(f"{path} is held by pid {holder}" + (f" (waited {waited_s:g} s)" if waited_s else ""))


class FolderLock:
    """An exclusive `flock` on `<folder>/<name>`, holding this process's pid: one writer of a folder at a time.

    Waits at most `wait_s` (0: not at all) for a holder to let go, so a service restarted while its old process
    is still exiting starts once that one is gone, and one started beside a running holder is refused with
    `FolderLocked` once the bound passes instead of hanging. The kernel drops the lock when the process dies,
    however it dies, so a stale lock file never blocks a restart; in a process, `release()` lets the next
    holder in.
    """

    def __init__(self, folder: str | os.PathLike[str], name: str, *, wait_s: float = 0.0) -> None:
        self.path = os.path.join(folder, name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
                        raise FolderLocked(self.path, holder, waited_s=wait_s) from None
                    time.sleep(min(LOCK_POLL_S, max(0.0, deadline - time.monotonic())))
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Let the next holder in (idempotent): closing the only descriptor of the lock drops the flock."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_setting_file(path: str | os.PathLike[str], *, field: str, what: str = "") -> bytes:
    """The bytes of the file the setting `field` names (`what` it holds, for the message); a file that cannot be
    read is a ConfigError on `field` saying why, at start, not a traceback later."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(field, f"cannot read {f'{what} ' if what else ''}{path}: {exc.strerror}") from None
