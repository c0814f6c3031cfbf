"""fedbroker.coordinator.schema: a state's version is its Alembic revision (SQLite: or its user_version when that
is higher), a newer one is refused naming both versions, an invalid one as written by no release."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from fedbroker.coordinator.schema import SchemaTooNew, Versions, current_version, file_version, revision_number
from fedbroker.errors import Conflict

VERSIONS = Versions("test state", 4)


def test_a_known_version_passes_and_a_newer_one_is_refused_naming_both() -> None:
    for known in range(5):
        VERSIONS.check(known, "s")
    with pytest.raises(SchemaTooNew, match=r"s: the test state is at schema version 7, newer than the 4") as refused:
        VERSIONS.check(7, "s")
    assert (refused.value.found, refused.value.known) == (7, 4)


def test_a_negative_version_is_no_release_of_ours() -> None:
    with pytest.raises(Conflict, match="schema version -1, which no fedbroker release writes"):
        VERSIONS.check(-1, "s")


def test_a_revision_is_its_number_and_a_foreign_one_is_refused() -> None:
    assert revision_number(None, "s") == 0 and revision_number("0004", "s") == 4
    with pytest.raises(Conflict, match="records Alembic revision 'ae1f3c', which no fedbroker release writes"):
        revision_number("ae1f3c", "s")


def test_a_sqlite_files_version_is_the_higher_of_user_version_and_its_revision(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    db = sqlite3.connect(path, isolation_level=None)
    assert file_version(db, "s") == 0
    db.execute("PRAGMA user_version = 3")  # the release before Alembic
    assert file_version(db, "s") == 3
    db.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
    db.execute("INSERT INTO alembic_version VALUES ('0005')")
    assert file_version(db, "s") == 5
    db.execute("PRAGMA user_version = 99")  # edited by hand: still refused as newer, not read as 5
    assert file_version(db, "s") == 99
    with create_engine(f"sqlite:///{path}").connect() as conn:
        assert current_version(conn, "s") == 99
    db.execute("PRAGMA user_version = -1")
    assert file_version(db, "s") == -1
    db.close()
