"""The coordinator's store on both engines (SQLite and PostgreSQL): the migrations build exactly the tables of
tables.py, a fence runs in every write transaction and a lost lease stops the write before it lands, and what a
write records is all there or not at all."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

from fedbroker.coordinator import tables
from fedbroker.coordinator.store import StateStore, StateUnavailable
from fedbroker.coordinator.store_schema import HEAD, alembic_config
from fedbroker.ha.lease import Lease, LeaseLost


def test_the_head_revision_is_the_schema_version_this_code_writes() -> None:
    assert ScriptDirectory.from_config(alembic_config()).get_current_head() == f"{HEAD:04d}"


def test_the_migrations_build_exactly_the_tables_of_tables_py(any_store: StateStore) -> None:
    assert any_store.schema_version() == HEAD
    with any_store.engine.connect() as conn:
        differences = compare_metadata(MigrationContext.configure(conn), tables.METADATA)
        assert differences == []
        assert set(inspect(conn).get_table_names()) == {*tables.METADATA.tables, "alembic_version"}


def test_opening_again_changes_nothing_and_keeps_every_row(store_url: str) -> None:
    first = StateStore.from_url(store_url)
    first.add_job("j", "j", "{}", 1, "{}")
    first.close()
    again = StateStore.from_url(store_url)
    try:
        assert again.schema_version() == HEAD and [j.job_id for j in again.jobs()] == ["j"]
    finally:
        again.close()


def test_a_fence_runs_first_in_every_write_and_a_lost_lease_writes_nothing(any_store: StateStore) -> None:
    seen: list[bool] = []

    def fence(conn: Connection) -> None:
        seen.append(conn.in_transaction())

    any_store.fence = fence
    any_store.add_job("kept", "kept", "{}", 1, "{}")
    assert seen == [True]

    def lost(conn: Connection) -> None:
        raise LeaseLost("lease coordinator: held by another coordinator")

    any_store.fence = lost
    tries: list[float] = []
    with any_store.retrying_writes(for_s=3600, sleep=tries.append), pytest.raises(LeaseLost):
        any_store.add_job("refused", "refused", "{}", 1, "{}")
    assert tries == []  # never retried: the lead is gone, not the database
    assert [j.job_id for j in any_store.jobs()] == ["kept"] and any_store.events("refused") == []


def test_a_lease_on_the_stores_engine_fences_its_writes(store_url: str) -> None:
    leader = StateStore.from_url(store_url)
    try:
        lease = Lease(leader.engine, "coordinator", "a", ttl_s=30.0)
        assert lease.acquire()
        leader.fence = lease.fence
        leader.add_job("by-a", "a", "{}", 1, "{}")
        rival = Lease(leader.engine, "coordinator", "b", ttl_s=30.0, clock=lambda: 1e12)  # a's lease lapsed for b
        assert rival.acquire()
        with pytest.raises(LeaseLost):
            leader.add_job("by-a-late", "a", "{}", 1, "{}")
        assert [j.job_id for j in leader.jobs()] == ["by-a"]
    finally:
        leader.close()


def test_a_write_that_fails_halfway_leaves_nothing_of_it(any_store: StateStore) -> None:
    any_store.add_job("dup", "dup", "{}", 1, "{}")

    def half(conn: Connection) -> None:
        conn.execute(tables.events.insert().values(job_id="dup", time=1.0, kind="half"))
        conn.execute(tables.jobs.insert().values(job_id="dup", name="x", spec_json="{}", status="pending",
                                                 rounds_total=1, model_spec_json="{}", created=1.0, updated=1.0))

    with pytest.raises(StateUnavailable, match="could not write twice: .*rolled back"):
        any_store._write("write twice", half)
    assert [e.kind for e in any_store.events("dup")] == ["submitted"]
    with any_store.engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM jobs")).scalar() == 1
