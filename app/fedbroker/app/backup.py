"""`fedbroker backup` and `fedbroker restore`: a host's state, copied consistently while its services run, and
put back (deploy/OPERATING.md, "Hosts: backup, restore, upgrade").

A backup holds any of three parts, each copied by its service's own module: the coordinator's state directory
(`--state`: its SQLite file through SQLite's online backup API, and the checkpoints it names;
coordinator/state_backup.py), the aggregation service's spool (`--spool`: each job as its commit record names
it; aggregators/spool_backup.py) and a site's privacy ledger (`--ledger`: mark first, then ledger;
worker/ledger_backup.py). `manifest.json` records each part's source, its schema or format version and every
file's SHA-256 and size. `--out` is a folder (new or empty), or a `.tar` / `.tar.gz` / `.tgz` file.

A restore checks the whole backup first (every digest, and that no part is newer than this code knows) and
writes nothing when anything is wrong; it refuses a target that holds state unless `--force`, and a target a
running service holds (its lock). `--check` only checks.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fedbroker.backup import BackupRefused, Part, read_manifest, verify, write_manifest
from fedbroker.errors import ConfigError

ARCHIVES = (".tar", ".tar.gz", ".tgz")
PAIR_ATTEMPTS = 10
# part name → the flag naming its source (backup) or target (restore)
FLAGS = {"coordinator": "--state", "spool": "--spool", "ledger": "--ledger"}


def _backers() -> dict[str, Callable[[str, Path], Part]]:
    from fedbroker.aggregators.spool_backup import backup_spool
    from fedbroker.coordinator.state_backup import backup_state
    from fedbroker.worker.ledger_backup import backup_ledger

    return {"coordinator": backup_state, "spool": backup_spool, "ledger": backup_ledger}


def _restorers() -> dict[str, Callable[..., None]]:
    from fedbroker.aggregators.spool_backup import restore_spool
    from fedbroker.coordinator.state_backup import restore_state
    from fedbroker.worker.ledger_backup import restore_ledger

    return {"coordinator": restore_state, "spool": restore_spool, "ledger": restore_ledger}


def _is_archive(path: str) -> bool:
    return path.endswith(ARCHIVES)


def backup(sources: dict[str, str], out: str, *, version: str = "") -> list[Part]:
    """Back up each part named in `sources` (part → its folder or file) to `out`; the parts written. The backup
    is built beside `out` and moved there only once whole."""
    if not sources:
        raise ConfigError("--state/--spool/--ledger", "name at least one thing to back up")
    target = Path(out).absolute()
    if _is_archive(out) and target.exists():
        raise ConfigError("--out", f"{target} exists already: choose a new name")
    if not _is_archive(out) and target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConfigError("--out", f"{target} exists and is not an empty folder: choose a new one")
    target.parent.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        parts = _back_up_parts(sources, building)
        write_manifest(building, parts, version=version)
        if _is_archive(out):
            _write_archive(building, target)
        else:
            if target.exists():
                target.rmdir()
            os.replace(building, target)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return parts


def _back_up_parts(sources: dict[str, str], building: Path) -> list[Part]:
    """Each part into `building`. The coordinator's state first, then the spool; both again when a round opened or
    closed in the coordinator's state meanwhile: a pair a crash could leave (the service may be ahead of the
    coordinator by accepted updates and one close, never by a round the coordinator did not record opening)."""
    from fedbroker.coordinator.state_backup import round_marks

    backers = _backers()
    unknown = sorted(set(sources) - set(backers))
    if unknown:
        raise ConfigError("sources", f"no part named {unknown[0]!r}; the parts are {', '.join(backers)}")
    ordered = sorted(sources.items(), key=lambda item: list(backers).index(item[0]))
    together = "coordinator" in sources and "spool" in sources
    for _ in range(PAIR_ATTEMPTS):
        parts = [backers[name](source, building) for name, source in ordered]
        if not together or round_marks(building / "coordinator") == round_marks(sources["coordinator"]):
            return parts
        for part in parts:
            shutil.rmtree(building / part.name)
    raise BackupRefused(f"rounds opened or closed during each of {PAIR_ATTEMPTS} tries to copy the coordinator's state "
                        f"and the spool together; back up between rounds, or stop the services")


def _write_archive(folder: Path, target: Path) -> None:
    temporary = target.with_name(f".{target.name}.partial")
    mode = "w:gz" if target.name.endswith((".gz", ".tgz")) else "w"
    try:
        with tarfile.open(temporary, mode) as tar:  # type: ignore[call-overload]
            tar.add(folder, arcname=".")
        os.chmod(temporary, 0o600)
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


@contextlib.contextmanager
def opened(backup_path: str) -> Iterator[Path]:
    """The backup's folder: `backup_path` itself, or an archive unpacked into a temporary folder (tar's `data`
    filter: no links out, no absolute paths, no device files), at most `unpack_limit` bytes of it."""
    path = Path(backup_path)
    if path.is_dir():
        yield path
        return
    if not path.is_file():
        raise ConfigError("BACKUP", f"no backup at {path}")
    with tempfile.TemporaryDirectory(prefix=".fedbroker-restore.") as tmp:
        _unpack(path, Path(tmp), limit=unpack_limit(path.stat().st_size))
        yield Path(tmp)


UNPACK_RATIO = 100            # a backup is SQLite pages and float tensors: it never packs to 1 % of itself
UNPACK_FLOOR = 1 << 30        # ... and any archive may unpack to 1 GiB
UNPACK_MEMBERS = 100_000


def unpack_limit(archive_bytes: int) -> int:
    """How many bytes an archive of `archive_bytes` may unpack to: beyond that it is a compression bomb, not a
    backup (its ratio would be over UNPACK_RATIO)."""
    return max(UNPACK_FLOOR, UNPACK_RATIO * archive_bytes)


def _unpack(archive: Path, into: Path, *, limit: int) -> None:
    """Unpack `archive` member by member (a stream: nothing is read ahead), refusing it as soon as its members'
    sizes add up past `limit` or their number past UNPACK_MEMBERS, before that member is written."""
    total = count = 0
    try:
        with tarfile.open(archive, "r|*") as tar:
            for member in tar:
                total += max(member.size, 0)
                count += 1
                if total > limit or count > UNPACK_MEMBERS:
                    raise BackupRefused(
                        f"{archive} unpacks to more than {limit} bytes or {UNPACK_MEMBERS} files (the limit for an "
                        f"archive of {archive.stat().st_size} bytes: {UNPACK_RATIO}× its size, at least "
                        f"{UNPACK_FLOOR} bytes): not a fedbroker backup; nothing was restored")
                tar.extract(member, into, filter="data")
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise BackupRefused(f"{archive} is not a readable backup archive ({exc})") from None


def restore(backup_path: str, targets: dict[str, str], *, force: bool = False, check_only: bool = False,
            restored: Callable[[Part], object] = lambda part: None) -> list[Part]:
    """Check the backup (every part's digests and versions), then restore each part named in `targets`, calling
    `restored(part)` after each (a later part's refusal leaves the earlier ones restored: say which)."""
    from fedbroker.aggregators.spool import FORMAT_VERSION as SPOOL_FORMAT
    from fedbroker.backup import check_version
    from fedbroker.coordinator.state_backup import check_schema
    from fedbroker.coordinator.store_schema import SCHEMA
    from fedbroker.worker.ledger import FORMAT_VERSION as LEDGER_FORMAT

    known = {"coordinator": (SCHEMA.latest, "at schema version"), "spool": (SPOOL_FORMAT, "of spool format"),
             "ledger": (LEDGER_FORMAT, "of ledger format")}
    with opened(backup_path) as root:
        parts = read_manifest(root)
        missing = [f"{FLAGS[n]} ({n})" for n in targets if n not in parts]
        if missing:
            raise ConfigError(missing[0].split()[0], f"the backup holds no {', '.join(missing)}; it holds: "
                                                     f"{', '.join(parts) or 'nothing'}")
        if not targets and not check_only:
            raise ConfigError("--state/--spool/--ledger", f"name where to restore; the backup holds: "
                                                          f"{', '.join(f'{FLAGS[n]} ({n})' for n in parts)}")
        for name, part in parts.items():  # all of it, before anything is written
            if name not in known:
                raise BackupRefused(f"the backup holds a part {name!r} this fedbroker does not know: a newer release "
                                    f"wrote it")
            check_version(part, *known[name])
            verify(root, part)
            if name == "coordinator":  # the database's own version, not only the manifest's word for it
                check_schema(root, part)
        restorers = _restorers()
        for name, target in targets.items():  # every target's refusals, before any part is written
            restorers[name](root, parts[name], target, force=force, check_only=True)
        for name, target in ([] if check_only else targets.items()):
            restorers[name](root, parts[name], target, force=force)
            restored(parts[name])
        return list(parts.values())


def _version() -> str:
    """This fedbroker's version, for the manifest (a checkout that was never installed has none)."""
    try:
        return importlib.metadata.version("fedbroker")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _describe(part: Part) -> str:
    size = sum(f.bytes for f in part.files)
    extra = ", ".join(f"{k} {v}" for k, v in sorted(part.details.items()) if not isinstance(v, dict))
    return (f"{part.name}: {part.source} (version {part.version}): {len(part.files)} file(s), {size} bytes"
            + (f"; {extra}" if extra else ""))


def _named(args: argparse.Namespace) -> dict[str, str]:
    return {name: value for name, value in (("coordinator", args.state), ("spool", args.spool),
                                            ("ledger", args.ledger)) if value}


def cmd_backup(args: argparse.Namespace) -> int:
    """Write the backup; one line per part on stdout."""
    for part in backup(_named(args), args.out, version=_version()):
        print(_describe(part))
    print(f"backup written to {Path(args.out).absolute()}")
    return 0


def cmd_restore(args: argparse.Namespace) -> int:
    """Check, then restore; one line per part on stdout."""
    targets = _named(args)

    def say(part: Part) -> None:
        print(f"restored {_describe(part)} → {Path(targets[part.name]).absolute()}", flush=True)

    parts = restore(args.backup, targets, force=args.force, check_only=args.check, restored=say)
    if args.check:
        for part in parts:
            print(_describe(part))
        print("backup checked: every digest matches")
    return 0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`fedbroker backup` and `fedbroker restore` under the main parser's subcommands."""
    p = sub.add_parser("backup", help="copy a host's coordinator state, spool or ledger while they run",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _part_flags(p, "back up")
    p.add_argument("--out", required=True, help="a new (or empty) folder, or a .tar, .tar.gz or .tgz file")
    p.set_defaults(run=cmd_backup)
    r = sub.add_parser("restore", help="put a backup back (checked first; --force to replace existing state)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("backup", help="the backup: its folder, or its .tar/.tar.gz/.tgz file")
    _part_flags(r, "restore into")
    r.add_argument("--force", action="store_true", help="replace the state a target holds (never a ledger's ε)")
    r.add_argument("--check", action="store_true", help="only check the backup's digests and versions")
    r.set_defaults(run=cmd_restore)


def _part_flags(p: Any, verb: str) -> None:
    p.add_argument("--state", "--state-dir", dest="state", metavar="DIR",
                   help=f"the coordinator's state_dir to {verb}")
    p.add_argument("--spool", metavar="DIR", help=f"the aggregation service's spool_dir to {verb}")
    p.add_argument("--ledger", metavar="FILE", help=f"a site's privacy ledger (worker.ledger_path) to {verb}")
