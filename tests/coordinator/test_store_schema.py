"""The coordinator's state file is versioned: an unversioned file of any earlier layout is migrated at open, a
file of a newer release is refused, and the state is kept on the way."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fedbroker.coordinator.schema import SchemaTooNew
from fedbroker.coordinator.store import StateStore
from fedbroker.coordinator.store_schema import SCHEMA

# The oldest layout a release wrote: before rounds kept a deadline, workers their data's shape, jobs their submitter.
OLDEST = """
CREATE TABLE jobs (job_id TEXT PRIMARY KEY, name TEXT NOT NULL, spec_json TEXT NOT NULL, status TEXT NOT NULL,
    rounds_total INTEGER NOT NULL, rounds_done INTEGER NOT NULL DEFAULT 0, model_spec_json TEXT NOT NULL,
    error TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL);
CREATE TABLE workers (worker_id TEXT PRIMARY KEY, categories_json TEXT NOT NULL, histogram_json TEXT NOT NULL,
    dp_enabled INTEGER NOT NULL, dp_json TEXT NOT NULL, epsilon_spent REAL NOT NULL, device TEXT NOT NULL,
    num_samples INTEGER NOT NULL, registered REAL NOT NULL, last_seen REAL NOT NULL, state TEXT NOT NULL DEFAULT 'idle');
CREATE TABLE rounds (job_id TEXT NOT NULL, round INTEGER NOT NULL, status TEXT NOT NULL,
    participants INTEGER NOT NULL, uploaded INTEGER NOT NULL DEFAULT 0, aggregated INTEGER NOT NULL DEFAULT 0,
    accuracy REAL, loss REAL, mean_train_loss REAL, seconds REAL, model_version INTEGER,
    checkpoint TEXT, stats_json TEXT NOT NULL DEFAULT '{}', started REAL NOT NULL, closed REAL,
    PRIMARY KEY (job_id, round));
INSERT INTO jobs VALUES ('j-1', 'old', '{}', 'completed', 2, 2, '{}', '', 1.0, 2.0);
INSERT INTO workers VALUES ('w0', '["digits"]', '[1,2]', 0, '{}', 0.5, 'cpu', 3, 1.0, 2.0, 'idle');
"""


def test_an_unversioned_file_of_the_oldest_layout_is_migrated_and_keeps_its_rows(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.sqlite"
    sqlite3.connect(path).executescript(OLDEST)
    store = StateStore(str(path))
    try:
        assert store.schema_version() == SCHEMA.latest
        job = store.job("j-1")
        assert job is not None and job.submitter == "" and job.rounds_done == 2
        (worker,) = store.workers()
        assert worker.input_shape == () and worker.num_classes == 0 and worker.epsilon_spent == 0.5
        store.open_round("j-2", 1, ["w0"], deadline=99.0)  # the late columns are there to write
        assert store.round("j-2", 1).deadline == 99.0
        assert store.events("j-1") == []  # the tables it lacked exist now
    finally:
        store.close()


def test_a_state_file_of_a_newer_release_is_refused_and_left_as_it_is(tmp_path: Path) -> None:
    StateStore.in_directory(str(tmp_path)).close()
    path = tmp_path / "coordinator.sqlite"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA.latest + 1}")
    db.close()
    with pytest.raises(SchemaTooNew, match=rf"at schema version {SCHEMA.latest + 1}, newer than the {SCHEMA.latest}"):
        StateStore.in_directory(str(tmp_path))
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA.latest + 1
    db.execute(f"PRAGMA user_version = {SCHEMA.latest}")
    db.close()
    StateStore.in_directory(str(tmp_path)).close()  # the refusal released the folder's lock
