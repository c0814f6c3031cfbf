"""Leases: one holder at a time, a lapsed lease moves with its term raised, and a fenced write of the old holder
is refused — on SQLite and on PostgreSQL (a database created and dropped on the machine's server)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine

from fedbroker.ha.lease import METADATA, Lease, LeaseLost, ensure_leases_table
from tests.postgres_node import scratch_database


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: object) -> Iterator[Engine]:
    if request.param == "sqlite":
        engine = create_engine(f"sqlite:///{tmp_path}/leases.sqlite")
        METADATA.create_all(engine)
        yield engine
        engine.dispose()
        return
    with scratch_database() as url:
        engine = create_engine(url)
        METADATA.create_all(engine)
        yield engine
        engine.dispose()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_one_holder_until_the_lease_lapses_then_the_term_rises(engine: Engine) -> None:
    clock = Clock()
    first = Lease(engine, "coordinator", "a", ttl_s=10, clock=clock)
    second = Lease(engine, "coordinator", "b", ttl_s=10, clock=clock)
    assert first.acquire() and first.term == 1
    assert not second.acquire() and second.term is None
    clock.now += 5
    assert first.acquire() and first.term == 1          # a renewal keeps the term
    clock.now += 9.9
    assert not second.acquire()                          # renewed at +5: held until +15
    clock.now += 0.2
    assert second.acquire() and second.term == 2
    assert not first.acquire() and first.term is None    # the old holder learns it lost the lease
    assert second.holder_now() == ("b", 2, pytest.approx(clock.now + 10))


def test_a_write_fenced_by_a_lost_lease_is_refused_and_a_release_lets_the_successor_in(engine: Engine) -> None:
    clock = Clock()
    first = Lease(engine, "job:j1", "a", ttl_s=10, clock=clock)
    second = Lease(engine, "job:j1", "b", ttl_s=10, clock=clock)
    assert first.acquire()
    with engine.begin() as conn:
        first.fence(conn)                                # held: the write may go on
    clock.now += 11
    assert second.acquire()
    stale = first.term
    with pytest.raises(LeaseLost, match=r"held by b at term 2"), engine.begin() as conn:
        first.term = stale                               # a paused holder that still believes it holds term 1
        first.fence(conn)
    second.release()
    assert first.acquire() and first.term == 3           # released: no need to wait the ttl out


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_replicas_starting_at_once_on_an_empty_database_all_find_the_leases_table(backend: str,
                                                                                   tmp_path: object) -> None:
    """Two aggregation replicas started together once raced to create the table, and the loser exited with
    'table leases already exists'; now every contender comes up, whoever created it."""
    def contend(url: str) -> list[BaseException]:
        engines = [create_engine(url) for _ in range(6)]
        start, failures = threading.Barrier(len(engines)), []

        def one(engine: Engine) -> None:
            start.wait()
            try:
                ensure_leases_table(engine)
                assert Lease(engine, "job:j", f"h{id(engine)}").holder_now() is None
            except BaseException as exc:  # collected and reported below
                failures.append(exc)

        threads = [threading.Thread(target=one, args=(e,)) for e in engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in engines:
            e.dispose()
        return failures

    if backend == "sqlite":
        assert contend(f"sqlite:///{tmp_path}/empty.sqlite") == []
    else:
        with scratch_database() as url:
            assert contend(url) == []
