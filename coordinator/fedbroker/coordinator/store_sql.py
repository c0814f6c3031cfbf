"""The engines the coordinator's state lives on, and the few statements SQLite and PostgreSQL spell differently.

SQLite (the embedded default, a file in the state directory): WAL, `synchronous=FULL`, a busy timeout, and every
write transaction opened with `BEGIN IMMEDIATE`, so it holds the write lock from its first statement and two
writers never deadlock halfway. PostgreSQL (clusters, `coordinator.database_url`): connections checked before
use (`pool_pre_ping`, so one a restarted server dropped is replaced instead of failing a write) and a connect
timeout, so an unreachable server fails a write in seconds, never hangs a job's thread. Each write transaction
there first takes one transaction-scoped advisory lock: writes are serialized as SQLite's are, so the store's
read-then-write transactions mean the same on both engines.

The helpers below are the only dialect-aware code: `greatest` (SQLite's two-argument MAX, PostgreSQL's GREATEST)
and `upsert` (each dialect's `INSERT … ON CONFLICT`); `replace` is SQLite's `INSERT OR REPLACE`, portably.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import ColumnElement, Engine, Table, create_engine, event, pool
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import GenericFunction

from fedbroker.coordinator.state_dir import owner_only

CONNECT_TIMEOUT_S = 10       # PostgreSQL: a server that does not answer fails the write after this long
WRITE_LOCK_KEY = 0x46454442  # PostgreSQL: the advisory lock every write transaction holds ("FEDB")
_IMMEDIATE = "fedbroker_immediate"  # the execution option that opens a SQLite transaction with BEGIN IMMEDIATE


def database_url(location: str) -> URL:
    """A path (SQLite file, or `:memory:`) or a SQLAlchemy URL as a URL; `postgresql://` means psycopg 3."""
    if "://" not in location:
        return URL.create("sqlite+pysqlite", database=location)
    url = make_url(location)
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    if url.get_backend_name() not in ("sqlite", "postgresql"):
        raise ValueError(f"the coordinator's state lives on SQLite or PostgreSQL, not {url.get_backend_name()!r} "
                         f"({url.render_as_string(hide_password=True)})")
    return url


def describe(url: URL) -> str:
    """How messages name the store: the file, or the URL without its password."""
    if url.get_backend_name() == "sqlite":
        return url.database or ":memory:"
    return url.render_as_string(hide_password=True)


def make_engine(url: URL, *, busy_timeout_s: float) -> Engine:
    """The engine of a store (module docstring): SQLite's pragmas and BEGIN IMMEDIATE, PostgreSQL's pool checks."""
    if url.get_backend_name() == "postgresql":
        return create_engine(url, pool_pre_ping=True, pool_size=8, max_overflow=8, pool_timeout=busy_timeout_s,
                             connect_args={"connect_timeout": CONNECT_TIMEOUT_S})
    path = url.database or ":memory:"
    memory = path == ":memory:"
    if not memory:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))  # SQLite keeps the mode
        for name in (path, f"{path}-wal", f"{path}-shm"):                      # and gives it to -wal and -shm
            owner_only(name, 0o600)
    engine = create_engine(url, connect_args={"timeout": busy_timeout_s, "check_same_thread": False},
                           poolclass=pool.StaticPool if memory else pool.QueuePool,
                           **({} if memory else {"pool_size": 4, "max_overflow": 8}))

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_connection: Any, record: Any) -> None:
        dbapi_connection.isolation_level = None  # we say when a transaction begins (below), not the driver
        cursor = dbapi_connection.cursor()
        if not memory:
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_IMMEDIATE) else "BEGIN")

    return engine


def begin_write(conn: Connection) -> None:
    """Mark `conn` (before it begins) so its transaction takes the write lock at once: BEGIN IMMEDIATE on SQLite;
    on PostgreSQL the store's advisory lock, taken by `lock_writes` as the first statement."""
    conn.execution_options(**{_IMMEDIATE: True})


def lock_writes(conn: Connection) -> None:
    """PostgreSQL: wait for the store's write lock, held to the end of this transaction (SQLite holds its own)."""
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({WRITE_LOCK_KEY})")


class greatest(GenericFunction[Any]):
    """The larger of its arguments: `max(a, b)` on SQLite, `GREATEST(a, b)` on PostgreSQL (no NULLs here)."""

    name = "greatest"
    inherit_cache = True


@compiles(greatest, "sqlite")
def _greatest_on_sqlite(element: greatest, compiler: SQLCompiler, **kw: Any) -> str:
    return f"max({compiler.process(element.clauses, **kw)})"


def upsert(conn: Connection, table: Table, values: Mapping[str, Any] | Sequence[Mapping[str, Any]], *,
           keys: Sequence[str], update: Callable[[Any], Mapping[str, Any]] | None = None) -> int:
    """INSERT … ON CONFLICT (`keys`): DO UPDATE SET `update(excluded)` (excluded: the row that was refused, as
    `excluded.c.col`), or DO NOTHING when `update` is None (SQLite's INSERT OR IGNORE); rows changed."""
    rows = [values] if isinstance(values, Mapping) else list(values)
    if not rows:
        return 0
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    statement = dialect.insert(table)
    if update is None:
        statement = statement.on_conflict_do_nothing(index_elements=list(keys))
    else:
        statement = statement.on_conflict_do_update(index_elements=list(keys), set_=dict(update(statement.excluded)))
    return int(conn.execute(statement, rows).rowcount or 0)


def replace(conn: Connection, table: Table, values: Mapping[str, Any]) -> None:
    """SQLite's INSERT OR REPLACE on both engines: the row with the same primary key (if any) deleted, this one
    inserted (columns not given take their defaults, as REPLACE leaves them)."""
    key: list[ColumnElement[bool]] = [column == values[column.name] for column in table.primary_key.columns]
    conn.execute(table.delete().where(*key))
    conn.execute(table.insert().values(**values))
