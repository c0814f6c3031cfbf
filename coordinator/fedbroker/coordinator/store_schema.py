"""The coordinator's state's schema, moved to Alembic: `upgrade` brings any database to the head revision when a
store opens, inside the store's write transaction (SQLite: BEGIN IMMEDIATE; PostgreSQL: the store's advisory
lock), so two processes opening one database at once apply each step once and a failure leaves nothing half done.

The route from the releases before Alembic: their SQLite file (`user_version` 0-3, no `alembic_version` table)
is upgraded by Alembic from "no revision", and the first revision (0004, `migrations/versions/v0004_baseline.py`)
creates each missing table and adds each missing column, which is what their hand-written steps did; nothing is
stamped without being checked. A revision a release has shipped is never edited or renumbered (deploy/OPERATING.md,
"Hosts: backup, restore, upgrade").
"""

from __future__ import annotations

import logging

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from fedbroker.coordinator.migrations import SCRIPT_LOCATION
from fedbroker.coordinator.schema import MigrationFailed, Versions, current_version

log = logging.getLogger(__name__)

HEAD = 4  # the schema version (Alembic revision) this code writes: the newest file in migrations/versions
SCHEMA = Versions("coordinator's state", HEAD)


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic's configuration with no alembic.ini: the packaged migrations, on `connection` when given."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    config.attributes["connection"] = connection
    return config


def upgrade(conn: Connection, *, path: str) -> tuple[int, int]:
    """Bring the database behind `conn` (inside its write transaction) to `HEAD`; (before, after). A database of
    a newer release is refused (`SchemaTooNew`) before anything is written."""
    before = current_version(conn, path)
    SCHEMA.check(before, path)
    if before < HEAD:
        try:
            command.upgrade(alembic_config(conn), f"{HEAD:04d}")
        except SQLAlchemyError as exc:
            raise MigrationFailed(f"{path}: migrating the {SCHEMA.what} from schema version {before} to {HEAD} "
                                  f"failed and was rolled back: {exc}") from exc
        log.info("%s: %s migrated from schema version %d to %d", path, SCHEMA.what, before, HEAD)
    if conn.dialect.name == "sqlite":  # a release from before Alembic then refuses the file as newer
        conn.exec_driver_sql(f"PRAGMA user_version = {HEAD:d}")
    return before, HEAD
