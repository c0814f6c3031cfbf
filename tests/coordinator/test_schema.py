"""fedbroker.coordinator.schema: migrations numbered in order, applied once each at open, a newer file refused."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fedbroker.coordinator.schema import Migration, MigrationFailed, Schema, SchemaTooNew, sql, user_version
from fedbroker.errors import Conflict


def connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


SCHEMA = Schema("test state", [
    Migration(1, "a table", sql("CREATE TABLE IF NOT EXISTS t (a INTEGER)")),
    Migration(2, "a column", sql("ALTER TABLE t ADD COLUMN b TEXT NOT NULL DEFAULT 'x'")),
])


def test_a_new_file_gets_every_migration_and_the_latest_version(tmp_path: Path) -> None:
    db = connect(tmp_path / "s.sqlite")
    assert SCHEMA.migrate(db, path="s") == (0, 2)
    assert [r[1] for r in db.execute("PRAGMA table_info(t)")] == ["a", "b"]


def test_opening_again_applies_nothing_twice(tmp_path: Path) -> None:
    db = connect(tmp_path / "s.sqlite")
    SCHEMA.migrate(db, path="s")
    assert SCHEMA.migrate(db, path="s") == (2, 2)  # migration 2 is not idempotent: a second run would raise


def test_a_file_at_an_older_version_gets_only_the_later_migrations(tmp_path: Path) -> None:
    db = connect(tmp_path / "s.sqlite")
    Schema("test state", SCHEMA.migrations[:1]).migrate(db, path="s")
    db.execute("INSERT INTO t (a) VALUES (5)")
    assert SCHEMA.migrate(db, path="s") == (1, 2)
    assert db.execute("SELECT a, b FROM t").fetchall() == [(5, "x")]


def test_a_file_of_a_newer_release_is_refused_naming_both_versions(tmp_path: Path) -> None:
    db = connect(tmp_path / "s.sqlite")
    db.execute("PRAGMA user_version = 7")
    with pytest.raises(SchemaTooNew, match=r"s.sqlite: the test state is at schema version 7, newer than the 2"):
        SCHEMA.migrate(db, path=str(tmp_path / "s.sqlite"))
    assert user_version(db) == 7  # untouched


def test_a_failing_migration_is_rolled_back_and_leaves_the_version_before_it(tmp_path: Path) -> None:
    broken = Schema("test state", [*SCHEMA.migrations, Migration(3, "a bad one", sql(
        "CREATE TABLE u (c INTEGER)", "INSERT INTO nowhere VALUES (1)"))])
    db = connect(tmp_path / "s.sqlite")
    with pytest.raises(MigrationFailed, match=r"migration 3 of the test state \(a bad one\) failed and was rolled back"):
        broken.migrate(db, path="s")
    assert user_version(db) == 2 and not db.in_transaction
    assert db.execute("SELECT name FROM sqlite_master WHERE name = 'u'").fetchall() == []  # its first step undone


@pytest.mark.parametrize("numbers", [[2], [1, 1], [1, 3], [2, 1]])
def test_migrations_must_be_numbered_one_two_in_order(numbers: list[int]) -> None:
    with pytest.raises(ValueError, match="numbered 1, 2"):
        Schema("x", [Migration(n, "m", sql()) for n in numbers])


def test_a_negative_version_is_no_release_of_ours(tmp_path: Path) -> None:
    db = connect(tmp_path / "s.sqlite")
    db.execute("PRAGMA user_version = -1")
    with pytest.raises(Conflict, match="schema version -1, which no fedbroker release writes"):
        SCHEMA.migrate(db, path="s")
