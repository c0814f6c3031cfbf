"""The store's fixtures: one store on each engine the coordinator's state lives on, so a store-level test runs on
both. `store_url`: a fresh SQLite file, or a fresh database on the machine's PostgreSQL (created and dropped by
`tests.postgres_node.scratch_database`; skipped locally without one, a failure on CI)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedbroker.coordinator.store import StateStore
from tests.postgres_node import scratch_database

BACKENDS = ("sqlite", "postgresql")


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database URL no other test uses: a SQLite file in the test's folder, or a scratch PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'coordinator.sqlite'}"
        return
    with scratch_database() as url:
        yield url


@pytest.fixture
def any_store(store_url: str) -> Iterator[StateStore]:
    """A store on each backend (the test runs once per backend), closed afterwards."""
    store = StateStore.from_url(store_url)
    try:
        yield store
    finally:
        store.close()
