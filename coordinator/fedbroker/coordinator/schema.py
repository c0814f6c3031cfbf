"""Schema versions of the coordinator's state: what a store or a backup of it may be opened at, and how to read one.

A state's schema version is a number: 1-3 were the `PRAGMA user_version` steps of the releases before Alembic
(0: a file from before versions), and from 4 on it is the Alembic revision the database is at (revision ids are
the numbers, zero-padded: `store_schema`). On SQLite both are kept: each upgrade also sets `user_version` to the
revision's number, so a release from before Alembic refuses a file this code has written (its own
`SchemaTooNew`) instead of reading tables it does not know. A file whose version is above the last one this code
knows was written by a newer release: it is refused (`SchemaTooNew`, naming both versions), neither read nor
written.
"""

from __future__ import annotations

import sqlite3

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

from fedbroker.errors import Conflict, FedbrokerError

VERSION_TABLE = "alembic_version"


class SchemaTooNew(Conflict):
    """A state written by a newer release than this code (its schema version is above the last one known)."""

    def __init__(self, what: str, path: str, found: int, known: int) -> None:
        self.found = found
        self.known = known
        super().__init__(f"{path}: the {what} is at schema version {found}, newer than the {known} this fedbroker "
                         f"knows: it was written by a newer release; run that release (or restore a backup taken "
                         f"before the upgrade)")


class MigrationFailed(FedbrokerError):
    """A migration raised: it was rolled back and the state stays at the version before it."""

    reason = "unavailable"


class Versions:
    """The versions a kind of state may be at: 0 … `latest`."""

    def __init__(self, what: str, latest: int) -> None:
        self.what = what
        self.latest = latest

    def check(self, found: int, path: str) -> None:
        """Refuse a version this code does not know (`SchemaTooNew`), or one no release writes."""
        if found > self.latest:
            raise SchemaTooNew(self.what, path, found, self.latest)
        if found < 0:  # no release writes one: another program's file, or one edited by hand
            raise Conflict(f"{path}: the {self.what} is at schema version {found}, which no fedbroker release "
                           f"writes (invalid, not newer): not a file this fedbroker will read or change")


def revision_number(revision: str | None, path: str) -> int:
    """An Alembic revision id as its schema version (None: no revision recorded, 0)."""
    if revision is None:
        return 0
    if not revision.isdigit():
        raise Conflict(f"{path}: the coordinator's state records Alembic revision {revision!r}, which no fedbroker "
                       f"release writes: not a database this fedbroker will read or change")
    return int(revision)


def current_version(conn: Connection, path: str) -> int:
    """The schema version of the database behind `conn` (SQLite: the higher of `user_version` and the revision,
    unless `user_version` is negative, which no release writes)."""
    revision = None
    if inspect(conn).has_table(VERSION_TABLE):
        revision = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar()
    found = revision_number(revision, path)
    if conn.dialect.name != "sqlite":
        return found
    legacy = int(conn.exec_driver_sql("PRAGMA user_version").scalar() or 0)
    return legacy if legacy < 0 else max(legacy, found)


def user_version(db: sqlite3.Connection) -> int:
    """A SQLite file's `PRAGMA user_version` (0: written before versions, or new and empty)."""
    return int(db.execute("PRAGMA user_version").fetchone()[0])


def file_version(db: sqlite3.Connection, path: str) -> int:
    """`current_version` of a SQLite file opened with the standard library (backups, restores)."""
    legacy = user_version(db)
    if legacy < 0:
        return legacy
    revision = None
    if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (VERSION_TABLE,)).fetchone():
        row = db.execute(f"SELECT version_num FROM {VERSION_TABLE}").fetchone()
        revision = None if row is None else str(row[0])
    return max(legacy, revision_number(revision, path))
