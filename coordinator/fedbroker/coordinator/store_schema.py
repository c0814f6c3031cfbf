"""The coordinator's state file's schema (`fedbroker.coordinator.schema`): its migrations, in the order they apply.

Version 1 is the layout of every release before versions (their files read `user_version` 0): the tables, and
the columns older files lacked, each created only where missing, so any unversioned file becomes version 1.
A store that needs a table or column adds a migration at the end of `MIGRATIONS`; one a release has shipped is
never edited or renumbered (deploy/OPERATING.md, "Hosts: backup, restore, upgrade").
"""

from __future__ import annotations

import sqlite3

from fedbroker.coordinator import store_epsilon, store_shares, store_sites
from fedbroker.coordinator.schema import Migration, Schema
from fedbroker.coordinator.store_evaluation import create_evaluation_tables

TABLES = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, name TEXT NOT NULL, spec_json TEXT NOT NULL,
    status TEXT NOT NULL, rounds_total INTEGER NOT NULL, rounds_done INTEGER NOT NULL DEFAULT 0,
    model_spec_json TEXT NOT NULL, error TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY, categories_json TEXT NOT NULL, histogram_json TEXT NOT NULL,
    dp_enabled INTEGER NOT NULL, dp_json TEXT NOT NULL, epsilon_spent REAL NOT NULL, device TEXT NOT NULL,
    num_samples INTEGER NOT NULL, registered REAL NOT NULL, last_seen REAL NOT NULL, state TEXT NOT NULL DEFAULT 'idle',
    input_shape_json TEXT NOT NULL DEFAULT '[]', num_classes INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS rounds (
    job_id TEXT NOT NULL, round INTEGER NOT NULL, status TEXT NOT NULL,
    participants INTEGER NOT NULL, uploaded INTEGER NOT NULL DEFAULT 0, aggregated INTEGER NOT NULL DEFAULT 0,
    accuracy REAL, loss REAL, mean_train_loss REAL, seconds REAL, model_version INTEGER,
    checkpoint TEXT, stats_json TEXT NOT NULL DEFAULT '{}', started REAL NOT NULL, closed REAL,
    deadline REAL,
    PRIMARY KEY (job_id, round)
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL,
    round INTEGER NOT NULL DEFAULT 0, worker_id TEXT NOT NULL DEFAULT '', message TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, seq);
CREATE TABLE IF NOT EXISTS participants (
    job_id TEXT NOT NULL, round INTEGER NOT NULL, worker_id TEXT NOT NULL, status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '', epsilon REAL, train_loss REAL, num_samples INTEGER,
    PRIMARY KEY (job_id, round, worker_id)
);
"""
# Columns that unversioned files written before them lack: (table, column, its declaration).
_LATE_COLUMNS = (
    ("rounds", "deadline", "REAL"),
    ("workers", "input_shape_json", "TEXT NOT NULL DEFAULT '[]'"),
    ("workers", "num_classes", "INTEGER NOT NULL DEFAULT 0"),
    ("jobs", "submitter", "TEXT NOT NULL DEFAULT ''"),
)


def _statements(script: str) -> list[str]:
    return [s for s in script.split(";") if s.strip()]


def _unversioned_layout(db: sqlite3.Connection) -> None:
    """Version 1: every table and column of the releases before versions, added where missing."""
    for statement in [*_statements(TABLES), *_statements(store_epsilon.SCHEMA), *_statements(store_shares.SCHEMA)]:
        db.execute(statement)
    create_evaluation_tables(db)
    for table, column, declaration in _LATE_COLUMNS:
        if column not in {r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")


def _site_tables(db: sqlite3.Connection) -> None:
    """Version 2: what an operator reads about the sites (`fedbroker sites`)."""
    for statement in _statements(store_sites.SCHEMA):
        db.execute(statement)


def _evaluation_samples(db: sqlite3.Connection) -> None:
    """Version 3: each site's registered held-out split, the bound of its evaluation reports."""
    db.execute("ALTER TABLE workers ADD COLUMN evaluation_samples INTEGER NOT NULL DEFAULT 0")


MIGRATIONS: list[Migration] = [
    Migration(1, "the tables and columns of the releases before schema versions", _unversioned_layout),
    Migration(2, "the sites' own record: version, restarts, events and forwarded warnings", _site_tables),
    Migration(3, "each site's registered held-out split (the bound of its evaluation reports)", _evaluation_samples),
]

SCHEMA = Schema("coordinator's state", MIGRATIONS)
