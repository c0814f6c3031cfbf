"""Leases with fencing terms, kept in the coordinator's database: who leads, and which replica owns a job.

A lease is one row (name, holder, term, expires). It is held by `holder` until `expires` (seconds since the
epoch, by the holder's clock: clocks need only agree within a fraction of the lease's length, as Kubernetes'
own leases assume). A holder renews it well before it lapses; anyone may take a lapsed lease, and taking it
raises the term by one, in a compare-and-set on the term, so two contenders can never both win.

Time only decides *when* a lease may move; the term decides *who may write*. Every write transaction of the
holder calls `Lease.fence(connection)` first: it reads the row (on PostgreSQL under a share lock, so a takeover
waits until that transaction has committed) and raises `LeaseLost` unless the holder and term are still this
lease's. A paused leader that wakes after its lease lapsed is therefore refused on its very next write, however
wrong its clock: no round is opened or closed twice, no ε recorded twice.

Names in use: `coordinator` (the leading coordinator, `coordinator.standby`) and `job:<job id>` (the aggregation
replica that serves a job).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sqlalchemy import BigInteger, Column, Engine, Float, MetaData, String, Table, inspect, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.schema import CreateTable

from fedbroker.errors import Unavailable

log = logging.getLogger(__name__)

METADATA = MetaData()
LEASES = Table(
    "leases", METADATA,
    Column("name", String(200), primary_key=True),
    Column("holder", String(200), nullable=False),
    Column("term", BigInteger, nullable=False),
    Column("expires", Float, nullable=False),
)


def ensure_leases_table(engine: Engine) -> None:
    """Create the `leases` table where it is missing (the coordinator's migrations create it too). Several
    processes starting at once on one database may all try: `IF NOT EXISTS` settles it on SQLite, and on
    PostgreSQL the loser of a concurrent create fails on the catalogue, so a failure with the table present is
    somebody else's success."""
    try:
        with engine.begin() as conn:
            conn.execute(CreateTable(LEASES, if_not_exists=True))
    except SQLAlchemyError:
        if not inspect(engine).has_table(LEASES.name):
            raise


class LeaseLost(Unavailable):
    """This process no longer holds the lease it wrote under: nothing of the write was recorded."""

    reason = "lease_lost"


class Lease:
    """One named lease as seen by one contender (`holder`, unique per process: host, pid and a random part).

    `acquire()` takes or renews it; `fence(conn)` is the check every write transaction makes; `release()` lets
    a successor in at once (a clean shutdown) instead of after `ttl_s`."""

    def __init__(self, engine: Engine, name: str, holder: str, *, ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0:
            raise ValueError(f"a lease's ttl_s must be positive, not {ttl_s}")
        self.engine = engine
        self.name = name
        self.holder = holder
        self.ttl_s = ttl_s
        self.clock = clock
        self.term: int | None = None  # the term this contender holds, None while it holds none

    @property
    def held(self) -> bool:
        """Whether this contender believes it holds the lease (its next fenced write proves it)."""
        return self.term is not None

    def acquire(self) -> bool:
        """Take the lease if it is free or lapsed, renew it if this contender holds it; whether it holds it now.
        A renewal that finds its term taken over drops the lease (`held` turns False)."""
        now = self.clock()
        try:
            with self.engine.begin() as conn:
                row = conn.execute(select(LEASES.c.holder, LEASES.c.term, LEASES.c.expires)
                                   .where(LEASES.c.name == self.name).with_for_update()).first()
                if row is None:
                    conn.execute(LEASES.insert().values(name=self.name, holder=self.holder, term=1,
                                                        expires=now + self.ttl_s))
                    self._took(1)
                    return True
                holder, term, expires = row
                if holder == self.holder and term == self.term:
                    conn.execute(update(LEASES).where(LEASES.c.name == self.name, LEASES.c.term == term)
                                 .values(expires=now + self.ttl_s))
                    return True
                if expires > now:
                    self._lost(f"held by {holder} (term {term}) for {expires - now:.1f}s more")
                    return False
                changed = conn.execute(update(LEASES).where(LEASES.c.name == self.name, LEASES.c.term == term)
                                       .values(holder=self.holder, term=term + 1, expires=now + self.ttl_s)).rowcount
                if changed != 1:
                    self._lost(f"taken by another contender at term {term + 1}")
                    return False
                self._took(term + 1)
                return True
        except IntegrityError:  # another contender inserted the first row in the same instant
            self._lost("taken by another contender at term 1")
            return False

    def _took(self, term: int) -> None:
        if self.term != term:
            log.info("lease %s: held by %s at term %d", self.name, self.holder, term)
        self.term = term

    def _lost(self, why: str) -> None:
        if self.term is not None:
            log.warning("lease %s: lost by %s (term %d): %s", self.name, self.holder, self.term, why)
        self.term = None

    def fence(self, conn: Connection) -> None:
        """Inside a write transaction: raise `LeaseLost` unless this contender still holds the lease at its term
        (on PostgreSQL the row stays share-locked to the end of the transaction, so no takeover commits between
        this check and the write's commit)."""
        term = self.term
        row = conn.execute(select(LEASES.c.holder, LEASES.c.term).where(LEASES.c.name == self.name)
                           .with_for_update(read=True)).first()
        if term is None or row is None or (row.holder, row.term) != (self.holder, term):
            now_held = "nobody" if row is None else f"{row.holder} at term {row.term}"
            raise LeaseLost(f"lease {self.name!r} is no longer held by {self.holder} (held by {now_held}): "
                            f"this write was refused and nothing of it recorded")

    def release(self) -> None:
        """Give the lease up now (its row lapses at once), if this contender holds it."""
        term = self.term
        if term is None:
            return
        try:
            with self.engine.begin() as conn:
                conn.execute(update(LEASES).where(LEASES.c.name == self.name, LEASES.c.holder == self.holder,
                                                  LEASES.c.term == term).values(expires=0.0))
        except SQLAlchemyError as exc:
            log.warning("lease %s: release failed (%s); it lapses in %.0fs", self.name, exc, self.ttl_s)
        self.term = None

    def holder_now(self) -> tuple[str, int, float] | None:
        """(holder, term, expires) as the database has it, or None before anyone took the lease."""
        with self.engine.connect() as conn:
            row = conn.execute(select(LEASES.c.holder, LEASES.c.term, LEASES.c.expires)
                               .where(LEASES.c.name == self.name)).first()
        return None if row is None else (str(row.holder), int(row.term), float(row.expires))


class LeaseKeeper:
    """Renews a held lease every `ttl_s / 3` on a thread of its own; calls `on_lost` once if a renewal fails
    (taken over, or the database unreachable until the lease would have lapsed)."""

    def __init__(self, lease: Lease, on_lost: Callable[[], None]) -> None:
        self.lease = lease
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{lease.name}", daemon=True)

    def start(self) -> None:
        """Start renewing."""
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing (the lease itself is kept until `release()` or until it lapses)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.lease.ttl_s)

    def _run(self) -> None:
        period = self.lease.ttl_s / 3
        last_renewed = time.monotonic()
        while not self._stop.wait(period):
            try:
                if self.lease.acquire():
                    last_renewed = time.monotonic()
                    continue
            except SQLAlchemyError as exc:
                log.warning("lease %s: renewal failed (%s)", self.lease.name, exc)
                if time.monotonic() - last_renewed < self.lease.ttl_s:
                    continue  # the database may be back before the lease lapses
                self.lease.term = None
            if not self._stop.is_set():
                self.on_lost()
            return
