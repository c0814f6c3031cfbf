"""A participant's kit folder: created new (never written over), with its files' modes set as they are written;
and the one way a file of an existing kit is changed later (`replace_file`): whole, never half."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from fedbroker.files import write_atomic


class KitFolder:
    """One participant's folder: 0700, secrets 0600, everything else 0644."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, mode=0o700, exist_ok=False)
        os.chmod(root, 0o700)

    def write(self, relative: str, data: str | bytes, *, secret: bool = False, executable: bool = False) -> Path:
        """A new file (never one already there), its mode set from its creation on: a secret is never readable
        by others, not even for a moment."""
        path = self.root / relative
        path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        mode = 0o600 if secret else 0o755 if executable else 0o644
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
        os.chmod(path, mode)
        return path

    def yaml(self, relative: str, doc: Any, *, header: str = "", secret: bool = False) -> Path:
        """`doc` as YAML in its own key order (a kit's config reads as its sections were written), after `header`."""
        return self.write(relative, header + yaml.safe_dump(doc, sort_keys=False), secret=secret)


def replace_file(path: Path, data: str | bytes, *, secret: bool) -> None:
    """Put `data` at `path` all at once (`fedbroker.files.write_atomic`), so a service that re-reads the file (a
    token table, the CRL) sees the old content or the new, never half of either; a secret stays 0600."""
    path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
    write_atomic(path, data.encode() if isinstance(data, str) else data, mode=0o600 if secret else 0o644)


def replace_yaml(path: Path, doc: Any, *, header: str = "", secret: bool) -> None:
    """`doc` as YAML (its own key order) after `header`, put at `path` with `replace_file`."""
    replace_file(path, header + yaml.safe_dump(doc, sort_keys=False), secret=secret)
