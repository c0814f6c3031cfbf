"""A consistent backup of a site's privacy ledger while its worker runs, and a restore that never lowers ε.

The ledger (ledger.py) is one JSON file and its mark file, each replaced atomically, the ledger first. Reading
the mark first and the ledger second gives a pair a load accepts: the ledger read is the one the mark was
written after, or a later one, and ε only grows. The copy is loaded as an operator reads a ledger (no worker
id, nothing written) before the backup counts it.

A restore never lets ε fall: a target whose mark (or ledger) records more ε than the backed-up ledger holds is
refused, even with `force` (the worker would refuse that ledger anyway, and rightly: the ε was spent). The mark
written is the higher of the target's and the backup's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fedbroker.backup import BackupRefused, FileEntry, Part, check_version, copy_file, verify
from fedbroker.errors import ConfigError
from fedbroker.files import write_atomic
from fedbroker.worker.ledger import FORMAT_VERSION, MARK_SUFFIX, PrivacyLedger, below

PART = "ledger"
LEDGER = "ledger.json"


def backup_ledger(ledger_path: str | os.PathLike[str], backup_root: Path) -> Part:
    """Copy the ledger at `ledger_path` and its mark into `backup_root/ledger/`; its manifest entry."""
    source = Path(ledger_path).absolute()
    folder = backup_root / PART
    folder.mkdir(mode=0o700, parents=True)
    mark = Path(f"{source}{MARK_SUFFIX}")
    entries = []
    try:
        with open(mark, "rb") as fh:  # the mark first: see the module
            entries.append(FileEntry(LEDGER + MARK_SUFFIX, *copy_file(fh, folder / (LEDGER + MARK_SUFFIX))))
    except FileNotFoundError:
        pass
    try:
        with open(source, "rb") as fh:
            entries.insert(0, FileEntry(LEDGER, *copy_file(fh, folder / LEDGER)))
    except FileNotFoundError:
        raise ConfigError("--ledger", f"no privacy ledger at {source} (the worker's ledger_path)") from None
    try:
        copy = PrivacyLedger(str(folder / LEDGER))
    except ConfigError as exc:
        raise BackupRefused(f"the ledger at {source} does not load, so it was not backed up: {exc}") from None
    return Part(PART, str(source), FORMAT_VERSION, entries,
                {"worker_id": copy.worker_id or "", "total_epsilon": copy.total_epsilon(), "jobs": len(copy.jobs())})


def restore_ledger(backup_root: Path, part: Part, target: str | os.PathLike[str], *, force: bool,
                   check_only: bool = False) -> None:
    """Restore the backup's ledger to the path `target` (and its mark); refused over an existing ledger unless
    `force`, and always where that would lower the ε the target's ledger or mark records. `check_only`: the
    refusals only (not the digests), nothing written."""
    check_version(part, FORMAT_VERSION, "of ledger format")
    if not check_only:
        verify(backup_root, part)
    path = Path(target).absolute()
    mark = Path(f"{path}{MARK_SUFFIX}")
    if path.exists() and not force:
        raise BackupRefused(f"{path} holds a ledger already: restoring would replace it; give --force to replace it "
                            f"(a ledger holding more ε than the backup's is never replaced)")
    try:  # what the file holds (its digest checked), not what the manifest says
        restored = PrivacyLedger(str(backup_root / PART / LEDGER)).total_epsilon()
    except ConfigError as exc:
        raise BackupRefused(f"the backed-up ledger does not load: {exc}") from None
    spent = max(_marked(mark), _held(path))
    if below(restored, spent):
        raise BackupRefused(f"the backed-up ledger holds ε {restored:.6g}, below the {spent:.6g} that {path} (or its "
                            f"mark) records as spent: restoring it would let the site spend that ε again; keep the "
                            f"newer ledger (--force does not override this)")
    if check_only:
        return
    source = backup_root / PART
    content = (source / LEDGER).read_bytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, content)
    backed_mark = _marked(source / (LEDGER + MARK_SUFFIX))
    write_atomic(mark, json.dumps({"total_epsilon": max(spent, backed_mark, 0.0)}).encode())
    PrivacyLedger(str(path))  # loads as the worker will (its mark check included)


def _marked(mark: Path) -> float:
    """The total ε a mark file records (0: none)."""
    try:
        return float(json.loads(mark.read_text(encoding="utf-8"))["total_epsilon"])
    except FileNotFoundError:
        return 0.0
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BackupRefused(f"{mark} is unreadable ({exc}): look at it before restoring over it") from None


def _held(path: Path) -> float:
    """The total ε the ledger at `path` holds (0: none, or one that does not load: its mark, always at least
    what a ledger held before its last write, still counts)."""
    if not path.exists():
        return 0.0
    try:
        return PrivacyLedger(str(path)).total_epsilon()
    except ConfigError:
        return 0.0
