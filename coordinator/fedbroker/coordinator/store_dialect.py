"""The two writes whose SQL differs between SQLite and PostgreSQL, written once for both: an insert that leaves a
row already there alone, and one that replaces it (each keyed by the table's primary key or a unique index).

SQLite's `INSERT OR IGNORE` / `INSERT OR REPLACE` do not exist on PostgreSQL; both servers know
`INSERT … ON CONFLICT (keys) DO NOTHING / DO UPDATE`, which SQLAlchemy builds per dialect."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

Values = Mapping[str, Any]


def _insert(conn: Connection, table: Table) -> postgresql.Insert | sqlite.Insert:
    if conn.dialect.name == "postgresql":
        return postgresql.insert(table)
    if conn.dialect.name == "sqlite":
        return sqlite.insert(table)
    raise ValueError(f"the coordinator's store runs on SQLite or PostgreSQL, not {conn.dialect.name}")


def insert_ignoring(conn: Connection, table: Table, values: Values | Sequence[Values], *,
                    keys: Sequence[str]) -> int:
    """Insert the row(s) whose `keys` are not taken yet, leave the others as they are; how many went in
    (a single row: 1 or 0)."""
    rows = [values] if isinstance(values, Mapping) else list(values)
    if not rows:
        return 0
    statement = _insert(conn, table).on_conflict_do_nothing(index_elements=list(keys))
    if len(rows) == 1:
        return conn.execute(statement.values(**rows[0])).rowcount
    return sum(conn.execute(statement.values(**row)).rowcount for row in rows)


def upsert(conn: Connection, table: Table, values: Values, *, keys: Sequence[str]) -> None:
    """Insert the row, or overwrite every column `values` names of the row whose `keys` it shares."""
    statement = _insert(conn, table).values(**values)
    changed = {name: statement.excluded[name] for name in values if name not in keys}
    conn.execute(statement.on_conflict_do_update(index_elements=list(keys), set_=changed))
