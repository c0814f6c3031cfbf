"""What every part of a host's backup shares: files copied with their digests, a manifest, checks on restore.

A backup is a folder (or a tar of one) holding `manifest.json` and one folder per part (`coordinator/`,
`spool/`, `ledger/`). Each part is written by its own service's module, which knows how to copy its state
consistently while the service runs (the coordinator's SQLite file through SQLite's backup API, the spool's
files as its commit record names them, a ledger after its mark file); here is only what they have in common:

- `copy_file` streams a file into the backup (or back out of it), computing its SHA-256 on the way;
- `Part` is one part's entry in the manifest: where it came from, its schema or format version, and every
  file with its digest and size;
- `verify` checks a part's files against the manifest before a restore writes anything (every problem at once);
- `claim_target` refuses to restore over a target that holds something, unless told to (`--force`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from fedbroker.errors import Conflict

FORMAT = "fedbroker-backup/1"
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


class BackupRefused(Conflict):
    """A backup cannot be written or restored as asked (a digest that does not match, a target that holds state,
    a version this code does not know); nothing was written to the target."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a part: its path inside the part's folder (`/`-separated), SHA-256 and size."""

    path: str
    sha256: str
    bytes: int


@dataclass
class Part:
    """One part of a backup as the manifest records it. `version`: the schema version of its SQLite file, or the
    format version of its files; `details`: what a person (or the restore) wants to know about it."""

    name: str
    source: str
    version: int
    files: list[FileEntry] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def entry(self, path: str) -> FileEntry:
        """The manifest's entry for `path` (KeyError: the backup holds no such file)."""
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)


def copy_file(source: str | os.PathLike[str] | BinaryIO, target: str | os.PathLike[str]) -> tuple[str, int]:
    """Copy `source` (a path, or a file already open: a file renamed over meanwhile is still the one opened) to
    `target` (0600, fsynced, its folders made 0700); its (SHA-256, size)."""
    target = Path(target)
    _owner_only_folders(target.parent)
    digest, size = hashlib.sha256(), 0
    own = not hasattr(source, "read")
    src: BinaryIO = open(source, "rb") if own else source  # type: ignore[arg-type,assignment]  # noqa: SIM115
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as out:
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
    finally:
        if own:
            src.close()
    return digest.hexdigest(), size


def _owner_only_folders(folder: Path) -> None:
    """`folder` and each missing folder above it, created 0700 (`mkdir(parents=True)` gives the upper ones the
    umask's mode): a backup holds every job and worker, and a ledger."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        path.mkdir(mode=0o700, exist_ok=True)


def file_digest(path: str | os.PathLike[str]) -> tuple[str, int]:
    """(SHA-256, size) of a file."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def verify(root: Path, part: Part) -> None:
    """Every file of `part` in the backup folder `root` is a plain file (no link on its way: a backup's file is
    never read from elsewhere) with its recorded digest and size; `BackupRefused` naming every file that is not
    (missing, a link, changed, truncated)."""
    problems = []
    for f in part.files:
        path = root / part.name / f.path
        try:
            link = linked(root, f"{part.name}/{f.path}")
            if link is not None:
                problems.append(f"{link} is a symbolic link (a backup holds plain files only)")
                continue
            sha, size = file_digest(path)
        except FileNotFoundError:
            problems.append(f"{part.name}/{f.path} is missing")
            continue
        if (sha, size) != (f.sha256, f.bytes):
            problems.append(f"{part.name}/{f.path} does not match its digest (sha256 {sha[:12]}…, {size} bytes; the "
                            f"manifest says {f.sha256[:12]}…, {f.bytes} bytes)")
    if problems:
        raise BackupRefused(f"the backup at {root} is damaged, nothing was restored: " + "; ".join(problems))


def linked(root: Path, relative: str) -> str | None:
    """The first of `relative`'s folders or its file (below `root`) that is a symbolic link, as a path relative to
    `root`; None when none is. FileNotFoundError when one is missing."""
    here = root
    for name in relative.split("/"):
        here = here / name
        if stat.S_ISLNK(os.lstat(here).st_mode):
            return str(here.relative_to(root))
    return None


def check_version(part: Part, known: int, what: str) -> None:
    """Refuse a part written by a newer release than this code (its version above `known`), and a version no
    release writes (below 0)."""
    if part.version < 0:
        raise BackupRefused(f"the backup's {part.name} part is {what} {part.version}, which is invalid (no fedbroker "
                            f"release writes a negative version): the manifest is damaged or was edited")
    if part.version > known:
        raise BackupRefused(f"the backup's {part.name} part is {what} {part.version}, newer than the {known} this "
                            f"fedbroker knows: restore it with the release that wrote it (or a newer one)")


def claim_target(target: Path, *, force: bool, ignore: Iterable[str] = ()) -> list[Path]:
    """What `target` (a folder) holds besides `ignore` (lock files); `BackupRefused` when that is anything and
    not `force`. The caller removes what it replaces."""
    held = sorted(p for p in target.iterdir() if p.name not in set(ignore)) if target.is_dir() else []
    if held and not force:
        shown = ", ".join(p.name for p in held[:5]) + (", …" if len(held) > 5 else "")
        raise BackupRefused(f"{target} is not empty ({shown}): restoring would replace that state; restore into an "
                            f"empty folder, or give --force to replace it")
    return held


def remove(paths: Iterable[Path]) -> None:
    """Delete files and folders (what a forced restore replaces)."""
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def write_manifest(root: Path, parts: Iterable[Part], *, version: str) -> dict[str, Any]:
    """`manifest.json` in the backup folder `root`: the format, when, by which fedbroker, and every part."""
    doc = {"format": FORMAT, "created_unix": time.time(),
           "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "fedbroker_version": version,
           "parts": {p.name: {"source": p.source, "version": p.version, "details": p.details,
                              "files": [vars(f) for f in p.files]} for p in parts}}
    (root / MANIFEST).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return doc


def read_manifest(root: Path) -> dict[str, Part]:
    """The parts the backup folder `root` holds, as its manifest records them; `BackupRefused` when it has no
    manifest or one of another format."""
    try:
        doc = json.loads((root / MANIFEST).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BackupRefused(f"{root} is not a fedbroker backup: it has no {MANIFEST}") from None
    except ValueError as exc:
        raise BackupRefused(f"{root / MANIFEST} is not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise BackupRefused(f"{root / MANIFEST}: a backup of format {found!r}, not {FORMAT!r}: restore it with the "
                            f"release that wrote it")
    try:
        parts = {name: Part(name, str(p["source"]), int(p["version"]),
                            [FileEntry(_inside(str(f["path"])), str(f["sha256"]), int(f["bytes"])) for f in p["files"]],
                            dict(p.get("details") or {}))
                 for name, p in doc["parts"].items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise BackupRefused(f"{root / MANIFEST}: a malformed part entry ({type(exc).__name__}: {exc})") from None
    return parts


def _inside(path: str) -> str:
    """A manifest's file path, which a restore writes below its target: relative, and never up out of it."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in path:
        raise ValueError(f"file path {path!r} is not a plain relative path")
    return path
