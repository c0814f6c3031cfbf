"""Atomic file replacement: a crash leaves the old file or the new one, never half of one.

The spool, the worker's privacy ledger and the coordinator's checkpoints all write through `write_atomic`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

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
