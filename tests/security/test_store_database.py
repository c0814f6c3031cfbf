"""The coordinator's database as an attack surface (deploy/SECURITY.md, "HA: the coordinator's store"): what a
site or a submitter writes is data in every statement (all of them parametrized, on SQLite and PostgreSQL), and
the PostgreSQL password lives in a mounted secret file that no message, log line or mark file repeats."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from fedbroker.backup import BackupRefused
from fedbroker.config import CoordinatorConfig, DPPolicy
from fedbroker.coordinator.state_backup import backup_state
from fedbroker.coordinator.state_dir import DATABASE_MARK
from fedbroker.coordinator.store import StateStore, StateUnavailable
from fedbroker.errors import ConfigError, FedbrokerError
from fedbroker.rpc.auth import read_secret
from tests.coordinator.conftest import any_store, store_url  # noqa: F401 - the fixtures, on both engines
from tests.postgres_node import scratch_database

HOSTILE = ["x'); DROP TABLE jobs; --", "' OR '1'='1", 'w"; DELETE FROM workers; --', "%s %(x)s :name ? $1",
           "ε\\'\\\\; SELECT pg_sleep(30); --"]
PASSWORD = "pw-7e1f-not-for-logs"


def test_hostile_strings_are_stored_as_data_on_both_engines(any_store: StateStore) -> None:  # noqa: F811
    for i, text in enumerate(HOSTILE):
        any_store.add_job(text, text, "{}", 1, "{}", submitter=text)
        any_store.upsert_worker(worker_id=text, categories=[text], histogram=[1], dp=DPPolicy(), epsilon_spent=0.0,
                                device=text, num_samples=1)
        any_store.open_round(text, 1, [text, f"w{i}"], deadline=1.0)
        any_store.note_event(text, "selection", text, round_number=1, worker_id=text)
    assert sorted(j.job_id for j in any_store.jobs()) == sorted(HOSTILE)
    assert sorted(w.worker_id for w in any_store.workers()) == sorted(HOSTILE)
    for text in HOSTILE:
        job = any_store.job(text)
        assert job is not None and (job.name, job.submitter) == (text, text)
        assert [e.message for e in any_store.events(text)][-1] == text
        assert [p.worker_id for p in any_store.participants(text, 1)] == sorted([text, f"w{HOSTILE.index(text)}"])
        assert any_store.recorded_epsilon(text) == 0.0
    with pytest.raises(Exception, match="Not an executable object"):
        any_store._exec("SELECT * FROM jobs")  # type: ignore[arg-type]  # no SQL text built from a string runs


def test_the_database_password_comes_from_a_secret_file_and_is_never_repeated(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    with scratch_database() as url:
        secret = tmp_path / "database-url"
        secret.write_text(url.replace("postgres@", f"postgres:{PASSWORD}@", 1) + "\n")
        secret.chmod(0o600)
        section = CoordinatorConfig(database_url_file=str(secret))
        assert PASSWORD not in repr(section)
        given = read_secret(section.database_url, section.database_url_file, field="coordinator.database_url")
        state_dir = tmp_path / "state"
        store = StateStore.for_coordinator(str(state_dir), given)
        try:
            store.add_job("j", "j", "{}", 1, "{}")
            assert PASSWORD not in store.path and "***" in store.path
            mark = (state_dir / DATABASE_MARK).read_text()
            assert PASSWORD not in mark and (state_dir / DATABASE_MARK).stat().st_mode & 0o077 == 0
            with pytest.raises(BackupRefused, match="use pg_dump or your operator's backups") as refused:
                backup_state(state_dir, tmp_path / "backup")
            with pytest.raises(ConfigError, match="keeps its state in") as elsewhere:
                StateStore.in_directory(str(state_dir))  # an empty SQLite file there would pass for its state
        finally:
            store.close()
        unreachable = given.replace(":5432/", ":1/", 1)
        with pytest.raises(StateUnavailable) as failed:
            StateStore.from_url(unreachable)
    said = [str(refused.value), str(elsewhere.value), str(failed.value), caplog.text]
    assert all(PASSWORD not in text for text in said), said
    with pytest.raises(FedbrokerError, match="not both"):
        CoordinatorConfig(database_url="postgresql+psycopg://u@h/d", database_url_file=str(secret))
    with pytest.raises(ConfigError, match="the value is not shown") as bad:
        CoordinatorConfig(database_url=f"mysql://u:{PASSWORD}@h/d")
    assert PASSWORD not in str(bad.value)
