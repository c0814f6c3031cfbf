"""The aggregation service's durable state on local disk, so a restarted service loses no accepted update.

One folder per job (named from the job id, safe for any file system):

    job.json                 the commit record: seed, kept global versions, closed rounds, the open round's
                             definition and the last close's result (rewritten atomically on every change)
    global-<version>.npz     a global model: raw arrays + its model spec as UTF-8 bytes
    round-<n>/<seq>.npz      one accepted update of the open round: raw arrays + its metadata as UTF-8 JSON

Every file is written to a temporary name in the same folder, fsynced, renamed over its final name and
the folder fsynced, so a crash leaves the old file or the new one, never half of one. Files are numpy
`.npz` archives of plain arrays, loaded with `allow_pickle=False`: nothing on disk is pickled.

job.json is the single source of truth: a global file or a round folder it does not name (left by a
crash between writing it and committing job.json) is ignored on load and deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
META_KEY = "__fedbroker_meta_json__"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass
class StoredJob:
    record: dict[str, Any]                                   # job.json as written
    globals: dict[int, tuple[str, dict[str, np.ndarray]]]    # version → (model spec JSON, tensors)
    folder: Path


class Spool:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    # ----- paths -----

    def folder(self, job_id: str) -> Path:
        """A folder name that is safe whatever the job id holds, and distinct for distinct ids."""
        digest = hashlib.sha256(job_id.encode()).hexdigest()[:12]
        return self.root / f"{_SAFE.sub('_', job_id)[:60]}-{digest}"

    # ----- writes -----

    def save_global(self, job_id: str, version: int, spec_json: str, tensors: Mapping[str, np.ndarray]) -> None:
        folder = self.folder(job_id)
        folder.mkdir(parents=True, exist_ok=True)
        _write_npz(folder / f"global-{version}.npz", tensors, {"version": version, "spec_json": spec_json})

    def save_record(self, job_id: str, record: Mapping[str, Any]) -> None:
        """Commit a job's state; global files and the round folder it names must already be on disk."""
        folder = self.folder(job_id)
        folder.mkdir(parents=True, exist_ok=True)
        doc = {"format": FORMAT_VERSION, "job_id": job_id, **record}
        _atomic_write(folder / "job.json", json.dumps(doc, sort_keys=True).encode())
        self._prune(folder, doc)

    def save_update(self, job_id: str, round_number: int, seq: int, meta: Mapping[str, Any],
                    tensors: Mapping[str, np.ndarray]) -> Path:
        folder = self.folder(job_id) / f"round-{round_number}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{seq:06d}.npz"
        _write_npz(path, tensors, dict(meta))
        return path

    @staticmethod
    def discard(path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass

    # ----- reads -----

    def load(self) -> Iterator[StoredJob]:
        for record_path in sorted(self.root.glob("*/job.json")):
            folder = record_path.parent
            record = json.loads(record_path.read_text(encoding="utf-8"))
            if record.get("format") != FORMAT_VERSION:
                raise ValueError(f"{record_path}: not a spool record of format {FORMAT_VERSION}")
            globals_: dict[int, tuple[str, dict[str, np.ndarray]]] = {}
            for version in record["versions"]:
                tensors, meta = _read_npz(folder / f"global-{int(version)}.npz")
                globals_[int(version)] = (str(meta["spec_json"]), tensors)
            self._prune(folder, record)
            yield StoredJob(record, globals_, folder)

    def updates(self, stored: StoredJob, round_number: int) -> Iterator[tuple[dict[str, Any], dict[str, np.ndarray]]]:
        """The round's accepted updates in the order they were accepted (the running mean sums in that order)."""
        folder = stored.folder / f"round-{round_number}"
        for path in folder.glob(".*.tmp"):  # an upload that crashed before its receipt: never acknowledged
            path.unlink(missing_ok=True)
        for path in sorted(folder.glob("[0-9]*.npz")):
            tensors, meta = _read_npz(path)
            yield meta, tensors

    # ----- housekeeping -----

    @staticmethod
    def _prune(folder: Path, record: Mapping[str, Any]) -> None:
        """Delete what the committed record no longer names: older global versions, closed rounds' folders."""
        keep_globals = {f"global-{int(v)}.npz" for v in record.get("versions", [])}
        open_round = (record.get("round") or {}).get("number")
        for path in folder.iterdir():
            name = path.name
            if name.startswith("global-") and name.endswith(".npz") and name not in keep_globals:
                path.unlink(missing_ok=True)
            elif path.is_dir() and name.startswith("round-") and name != f"round-{open_round}":
                shutil.rmtree(path, ignore_errors=True)
            elif name.startswith(".") and name.endswith(".tmp"):
                path.unlink(missing_ok=True)


def _write_npz(path: Path, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> None:
    if META_KEY in tensors:
        raise ValueError(f"a tensor may not be named {META_KEY!r}")
    arrays: dict[str, Any] = {name: np.ascontiguousarray(arr) for name, arr in tensors.items()}
    arrays[META_KEY] = np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8)

    def write(fh: Any) -> None:
        np.savez(fh, **arrays)

    _atomic_write(path, write)


def _read_npz(path: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    with np.load(path, allow_pickle=False) as data:
        tensors = {name: data[name] for name in data.files if name != META_KEY}
        meta = json.loads(bytes(data[META_KEY]).decode())
    return tensors, meta


def _atomic_write(path: Path, content: Any) -> None:
    """`content`: bytes, or a function that writes to a binary file object."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            if isinstance(content, bytes):
                fh.write(content)
            else:
                content(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename durable; not every platform lets a folder be opened
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
