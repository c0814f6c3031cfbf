"""Versioned SQLite state: an ordered list of migrations, applied at open, recorded in `PRAGMA user_version`.

Every SQLite file the project keeps declares a `Schema`: its name (for messages) and its migrations, numbered
1, 2, … in the order they apply. Opening a file runs, in one `BEGIN IMMEDIATE` transaction each, every
migration above the file's `user_version`, then sets `user_version` to that migration's number, so a crash
between two leaves the file at the last one that committed and the next open goes on from there. A file
written before versions existed reads 0: migration 1 brings it to the first versioned layout (and must
therefore be idempotent over every earlier unversioned layout, e.g. `CREATE TABLE IF NOT EXISTS`).

A file whose version is above the last migration this code knows was written by a newer release: it is
refused (`SchemaTooNew`, naming both versions) instead of being read, or worse written, by code that does
not know its tables. A store adds a migration by appending to its schema's list: never renumber or edit one
that a release has shipped.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fedbroker.errors import Conflict, FedbrokerError

log = logging.getLogger(__name__)


class SchemaTooNew(Conflict):
    """A state file written by a newer release than this code (its schema version is above the last one known)."""

    def __init__(self, what: str, path: str, found: int, known: int) -> None:
        self.found = found
        self.known = known
        super().__init__(f"{path}: the {what} is at schema version {found}, newer than the {known} this fedbroker "
                         f"knows: it was written by a newer release; run that release (or restore a backup taken "
                         f"before the upgrade)")


class MigrationFailed(FedbrokerError):
    """A migration raised: it was rolled back and the file stays at the version before it."""

    reason = "unavailable"


@dataclass(frozen=True)
class Migration:
    """One step: `apply(connection)` inside the transaction that also records `version`."""

    version: int
    what: str
    apply: Callable[[sqlite3.Connection], None]


def sql(*statements: str) -> Callable[[sqlite3.Connection], None]:
    """A migration made of plain SQL statements (each one statement, run in order)."""
    def apply(db: sqlite3.Connection) -> None:
        for statement in statements:
            db.execute(statement)
    return apply


class Schema:
    """A SQLite file's migrations, numbered 1…N in order (checked here: a gap or a duplicate is a bug)."""

    def __init__(self, what: str, migrations: Sequence[Migration]) -> None:
        numbers = [m.version for m in migrations]
        if numbers != list(range(1, len(migrations) + 1)):
            raise ValueError(f"the {what}'s migrations must be numbered 1, 2, … in order, got {numbers}")
        self.what = what
        self.migrations = tuple(migrations)

    @property
    def latest(self) -> int:
        """The version a file has once every migration applied."""
        return len(self.migrations)

    def check(self, found: int, path: str) -> None:
        """Refuse a version this code does not know (`SchemaTooNew`)."""
        if found > self.latest:
            raise SchemaTooNew(self.what, path, found, self.latest)
        if found < 0:  # no release writes one: another program's file, or one edited by hand
            raise Conflict(f"{path}: the {self.what} is at schema version {found}, which no fedbroker release "
                           f"writes (invalid, not newer): not a file this fedbroker will read or change")

    def migrate(self, db: sqlite3.Connection, *, path: str) -> tuple[int, int]:
        """Bring the file behind `db` (autocommit mode: `isolation_level=None`) to `latest`; (before, after).

        Each migration runs in its own `BEGIN IMMEDIATE` transaction that re-reads the version first, so two
        processes opening one file at once apply each step once."""
        before = user_version(db)
        self.check(before, path)
        for migration in self.migrations[before:]:
            db.execute("BEGIN IMMEDIATE")
            try:
                current = user_version(db)
                self.check(current, path)
                if current < migration.version:
                    migration.apply(db)
                    db.execute(f"PRAGMA user_version = {int(migration.version)}")
                db.execute("COMMIT")
            except BaseException as exc:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                if isinstance(exc, sqlite3.Error):
                    raise MigrationFailed(f"{path}: migration {migration.version} of the {self.what} "
                                          f"({migration.what}) failed and was rolled back: {exc}") from exc
                raise
            if current < migration.version:
                log.info("%s: %s migrated to schema version %d (%s)", path, self.what, migration.version,
                         migration.what)
        return before, user_version(db)


def user_version(db: sqlite3.Connection) -> int:
    """The file's schema version (0: written before versions, or new and empty)."""
    return int(db.execute("PRAGMA user_version").fetchone()[0])
