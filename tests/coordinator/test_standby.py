"""The coordinator's election (coordinator/standby.py) on a SQLite file, as two processes would see it: one
leads, the other stands by naming it; a lapsed lease moves at the next term; the old leader's next write is
refused and stops it once; a released lease moves at once; a standby rides out an unreachable database.

Time is a clock each contender is handed, never a sleep: the lease's expiry is judged by the taker's clock."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, create_engine, text

from fedbroker.coordinator.standby import EXIT_LEASE_LOST, LEASE_NAME, Leadership, holder_name, leader_address
from fedbroker.ha.lease import LeaseLost

TTL_S = 60.0   # long: no renewal runs during a test unless the test asks for one


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = create_engine(f"sqlite:///{tmp_path / 'coordinator.sqlite'}")
    yield engine
    engine.dispose()


class Contender:
    """One coordinator's Leadership with its own clock and a record of each time it was told it lost."""

    def __init__(self, engine: Engine, address: str, *, ttl_s: float = TTL_S) -> None:
        self.clock = Clock()
        self.lost: list[str] = []
        self.told = threading.Event()
        self.leadership = Leadership(engine, ttl_s=ttl_s, advertise=address, on_lost=self._on_lost, clock=self.clock)

    def _on_lost(self, why: str) -> None:
        self.lost.append(why)
        self.told.set()

    def lead(self) -> bool:
        return self.leadership.try_lead()

    def write(self, engine: Engine) -> None:
        """A write transaction of the store, fenced first as the store's hook does."""
        with engine.begin() as conn:
            self.leadership.fence(conn)
            conn.execute(text("CREATE TABLE IF NOT EXISTS journal (entry TEXT)"))
            conn.execute(text("INSERT INTO journal VALUES ('written')"))


def gauge(name: str) -> float | None:
    return REGISTRY.get_sample_value(name)


def test_one_leads_and_the_standby_names_it(engine: Engine) -> None:
    a, b = Contender(engine, "10.0.0.1:50052"), Contender(engine, "10.0.0.2:50052")
    assert a.lead()
    assert gauge("fedbroker_coordinator_leader") == 1
    assert gauge("fedbroker_coordinator_lease_term") == 1
    assert not b.leadership.try_lead()
    assert b.leadership.leader() == "10.0.0.1:50052"
    assert a.leadership.leader() == "10.0.0.1:50052"
    a.write(engine)   # the leader's writes pass the fence
    with pytest.raises(LeaseLost):  # a standby's would not (and a standby is not stopped for it: it never led)
        b.write(engine)
    assert b.lost == []
    a.leadership.release()


def test_a_lapsed_lease_moves_at_the_next_term_and_the_old_leaders_next_write_is_refused_once(engine: Engine) -> None:
    a, b = Contender(engine, "a:1"), Contender(engine, "b:1")
    assert a.lead()
    b.clock.now += TTL_S + 1   # a stopped renewing (paused, cut off): by b's clock the lease has lapsed
    assert b.lead()
    assert b.leadership.term == 2
    assert gauge("fedbroker_coordinator_lease_term") == 2
    with pytest.raises(LeaseLost, match="no longer held"):  # a paused leader wakes: its write is refused whole
        a.write(engine)
    with pytest.raises(LeaseLost):
        a.write(engine)
    assert len(a.lost) == 1, "the old leader is stopped once, however many writes it still tries"
    assert not a.leadership.leading.is_set()
    b.write(engine)
    with engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM journal")).scalar() == 1, "only the new leader's write landed"
    b.leadership.release()


def test_a_renewal_that_finds_the_lease_taken_stops_the_old_leader(engine: Engine) -> None:
    a = Contender(engine, "a:1", ttl_s=0.3)   # renews every 0.1 s
    b = Contender(engine, "b:1", ttl_s=TTL_S)
    assert a.lead()
    b.clock.now = a.clock.now + 1   # a's lease (0.3 s) has lapsed by b's clock
    assert b.lead()
    assert a.told.wait(30), "the old leader's keeper did not report the lost lease"
    assert a.lost and "taken" in a.lost[0]
    assert not a.leadership.leading.is_set()
    b.leadership.release()


def test_a_released_lease_moves_at_once(engine: Engine) -> None:
    a, b = Contender(engine, "a:1"), Contender(engine, "b:1")
    assert a.lead()
    a.leadership.release()
    assert gauge("fedbroker_coordinator_leader") == 0
    assert b.lead(), "a clean shutdown hands over without waiting out the lease"
    assert b.leadership.term == 2
    assert a.lost == []
    b.leadership.release()


def test_wait_to_lead_takes_the_lease_when_it_lapses(engine: Engine) -> None:
    a, b = Contender(engine, "a:1"), Contender(engine, "b:1", ttl_s=0.3)
    assert a.lead()
    stop = threading.Event()
    took: list[bool] = []
    waiter = threading.Thread(target=lambda: took.append(b.leadership.wait_to_lead(stop)))
    waiter.start()
    assert not b.leadership.leading.wait(0.5)  # a still holds it: b waits, trying every 0.1 s
    b.clock.now += TTL_S + 1
    assert b.leadership.leading.wait(30)
    waiter.join(30)
    assert took == [True]
    b.leadership.release()


def test_a_standby_rides_out_an_unreachable_database(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    b = Contender(engine, "b:1")
    engine.dispose()
    (tmp_path / "db.sqlite").unlink()
    (tmp_path / "db.sqlite").mkdir()   # the database cannot be opened now
    assert not b.leadership.try_lead()  # a failed try, not an exception
    stop = threading.Event()
    stop.set()
    assert not b.leadership.wait_to_lead(stop)


def test_holder_names_carry_the_address_and_are_unique() -> None:
    first, second = holder_name("10.0.0.1:50052"), holder_name("10.0.0.1:50052")
    assert first != second
    assert leader_address(first) == "10.0.0.1:50052"
    assert EXIT_LEASE_LOST not in (0, 1, 2) and LEASE_NAME == "coordinator"


def test_a_bad_lease_length_is_refused(engine: Engine) -> None:
    with pytest.raises(ValueError, match="lease_ttl_s"):
        Leadership(engine, ttl_s=0)


def test_a_forged_lease_row_stops_the_leader_and_none_of_its_writes_lands(engine: Engine) -> None:
    """Whoever can write the database (the coordinators' own credentials; never a site) can rewrite the lease row:
    the leader then refuses its own next write and stops. A forged row can stop a leader, never make two lead."""
    a = Contender(engine, "a:1")
    assert a.lead()
    a.write(engine)
    with engine.begin() as conn:
        conn.execute(text("UPDATE leases SET holder = 'forger:1 x', term = term + 1 WHERE name = 'coordinator'"))
    with pytest.raises(LeaseLost, match="forger"):
        a.write(engine)
    assert len(a.lost) == 1 and not a.leadership.leading.is_set()
    b = Contender(engine, "b:1")
    assert not b.leadership.try_lead() and b.leadership.leader() == "forger:1", "the forged lease holds until it lapses"
    with engine.connect() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM journal")).scalar() == 1


def test_no_site_can_reach_the_lease() -> None:
    """A site holds no database credentials and runs no code that touches the store or the lease: its only way to
    the coordinator is the control queue, whose handler imports neither."""
    import ast

    import fedbroker.coordinator.control_handler as handler
    from fedbroker.config import WorkerConfig
    from tests.source_roots import ROOT

    def imports(path: Path) -> set[str]:
        tree = ast.parse(path.read_text())
        return {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}

    forbidden = ("sqlalchemy", "psycopg", "fedbroker.ha", "fedbroker.coordinator")
    for path in sorted((ROOT / "worker").rglob("*.py")):
        assert not [m for m in imports(path) if m.startswith(forbidden)], f"{path} reaches the coordinator's database"
    assert not [m for m in imports(Path(handler.__file__)) if m.startswith(("fedbroker.ha", "fedbroker.coordinator.standby"))]
    assert not [f for f in WorkerConfig.__dataclass_fields__ if "database" in f or "lease" in f]
