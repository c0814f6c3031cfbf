"""Two coordinators on one database: the one holding the lease `coordinator` leads, the other stands by.

The leader is whoever holds the lease (fedbroker.ha.lease): it renews it every `lease_ttl_s / 3`, and every
write transaction of its store checks the lease's fencing term first (`Leadership.fence`, the store's fence
hook). A standby neither consumes the control queue nor runs jobs: it tries the lease every `lease_ttl_s / 3`
and answers every gRPC call with UNAVAILABLE, reason `standby`, naming the leader (standby_gate.py). When the
lease lapses (the leader died, hung, or lost the database for a whole lease), the standby takes it at the next
term, and only then starts its coordinator, which resumes every running job from the store at its current
round, as any restarted coordinator does (deploy/RELIABILITY.md).

A leader that loses its lease (a renewal finds it taken or cannot reach the database for a whole lease; or a
write is refused with `LeaseLost`) stops acting at once: `on_lost` ends the process with EXIT_LEASE_LOST, so
no job thread writes again, nothing more is consumed, and the deliveries it held go back to the queue. Its
supervisor (Kubernetes) restarts it, as a standby. The simplest safe design: a half-stopped leader that lingers
is what fencing exists to refuse, and an exit makes that refusal the rule instead of a race.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError

from fedbroker.coordinator import metrics
from fedbroker.ha.lease import Lease, LeaseKeeper, LeaseLost, ensure_leases_table

log = logging.getLogger(__name__)

LEASE_NAME = "coordinator"
# The exit status of a leader that lost its lease (EX_TEMPFAIL): not a crash, a supervisor restarts it as a standby.
EXIT_LEASE_LOST = 75


def holder_name(advertise: str) -> str:
    """This process's name on the lease: the address clients reach it at (what a standby tells them), then the
    host, pid and a random part, so two processes never share a name, even one restarted with the same pid."""
    return f"{advertise or socket.gethostname()} {socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}"


def leader_address(holder: str) -> str:
    """The address part of a holder's name (`holder_name`): where the leader serves."""
    return holder.split(" ", 1)[0]


def exit_now(why: str) -> None:
    """A leader that lost its lease ends here: every log line out first, then the process, at once (no
    atexit, no thread joins: nothing of the old term may run on)."""
    log.critical("this coordinator lost the lease %r and stops at once: %s (exit %d; restarted, it is a standby)",
                 LEASE_NAME, why, EXIT_LEASE_LOST)
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(EXIT_LEASE_LOST)


def bound_lock_waits(engine: Engine, *, ttl_s: float) -> None:
    """On PostgreSQL, bound every wait of this process's sessions to one lease: a transaction left open longer
    (a process frozen in the middle of one: a long pause, SIGSTOP) is ended by the server, releasing the lease row
    it had locked, and a lock waited on longer fails (the caller tries again). Without this, a leader frozen inside
    a renewal or a fenced write would hold the lease's row, and the standby's takeover would wait on it forever."""
    if engine.dialect.name != "postgresql":
        return  # SQLite: one file lock, released by a crashed process's OS; a frozen one is covered by busy_timeout
    milliseconds = max(1, int(ttl_s * 1000))

    @event.listens_for(engine, "connect")
    def _bounded(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"SET idle_in_transaction_session_timeout = {milliseconds}")
            cursor.execute(f"SET lock_timeout = {milliseconds}")
        finally:
            cursor.close()
        dbapi_connection.commit()

    engine.dispose()  # connections opened before (the store's migration) are opened again, bounded


class Leadership:
    """This process's side of the election: wait to lead, keep the lease while leading, and fence writes.

    `on_lost(why)` is called once, from whichever thread finds the lease gone (the keeper's, or a job thread's
    refused write); in a process it is `exit_now`, in a test whatever records it."""

    def __init__(self, engine: Engine, *, ttl_s: float, advertise: str = "",
                 on_lost: Callable[[str], None] = exit_now, clock: Callable[[], float] = time.time) -> None:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= 3600:
            raise ValueError(f"coordinator.lease_ttl_s must be seconds in (0, 3600], got {ttl_s!r}")
        ensure_leases_table(engine)  # where the store's migrations have not made it yet
        bound_lock_waits(engine, ttl_s=float(ttl_s))
        self.lease = Lease(engine, LEASE_NAME, holder_name(advertise), ttl_s=float(ttl_s), clock=clock)
        self.on_lost = on_lost
        self.leading = threading.Event()
        self.led_at: float | None = None   # time.time() when this process took the lease
        self._leader = ""                  # the leader as last read by this standby ("" unknown)
        self._keeper: LeaseKeeper | None = None
        self._lost = threading.Lock()      # held once on_lost has been called: it is never called twice
        metrics.LEADER.set(0)
        metrics.LEASE_TERM.set(0)

    @property
    def holder(self) -> str:
        """This process's name on the lease."""
        return self.lease.holder

    @property
    def term(self) -> int | None:
        """The fencing term this process leads at (None: standby)."""
        return self.lease.term

    def leader(self) -> str:
        """Where the leader serves, as this process last saw it ("" unknown); itself when it leads."""
        return leader_address(self.holder) if self.leading.is_set() else self._leader

    def try_lead(self) -> bool:
        """One attempt at the lease; whether this process leads now (from the first success on, the lease is kept
        renewed). A database that cannot be reached is a failed attempt (logged): a standby waits through it."""
        if self.leading.is_set():
            return True
        try:
            if self.lease.acquire():
                self._took()
                return True
            seen = self.lease.holder_now()
        except SQLAlchemyError as exc:
            log.warning("standby: the lease %r could not be read (%s); trying again", LEASE_NAME, exc)
            return False
        leader = leader_address(seen[0]) if seen else ""
        if leader != self._leader:
            log.info("standby: %s leads (term %d); this coordinator waits", leader, seen[1] if seen else 0)
        self._leader = leader
        return False

    def wait_to_lead(self, stop: threading.Event) -> bool:
        """Until this process holds the lease (True) or `stop` is set (False), trying every `ttl_s / 3`: a lapsed
        lease is taken at most `ttl_s / 3` after it lapsed. Leading, the lease is kept renewed (LeaseKeeper)."""
        while not stop.is_set():
            if self.try_lead():
                return True
            stop.wait(self.lease.ttl_s / 3)
        return False

    def _took(self) -> None:
        self.led_at = time.time()
        term = self.lease.term or 0
        log.warning("this coordinator (%s) now leads, at term %d", self.holder, term)
        metrics.LEADER.set(1)
        metrics.LEASE_TERM.set(term)
        self.leading.set()
        self._keeper = LeaseKeeper(self.lease, on_lost=lambda: self.lose(
            f"its renewal found the lease taken, or the database unreachable for {self.lease.ttl_s:g}s"))
        self._keeper.start()

    def fence(self, conn: Connection) -> None:
        """The store's fence hook, first in every write transaction: refused (`LeaseLost`, nothing written) unless
        this process still leads at its term; a refusal also stops the process (`lose`)."""
        try:
            self.lease.fence(conn)
        except LeaseLost as exc:
            if self.led_at is not None:  # a standby never writes; if it tried, the refusal is enough
                self.lose(str(exc))
            raise

    def lose(self, why: str) -> None:
        """The lease is gone: stop leading, once. Nothing of this process may act on the old term again."""
        if not self._lost.acquire(blocking=False):
            return
        self.leading.clear()
        metrics.LEADER.set(0)
        metrics.LEASE_TERM.set(0)
        if self._keeper is not None:
            self._keeper.stop()
        self.on_lost(why)

    def release(self) -> None:
        """A clean shutdown: stop renewing and give the lease up, so the standby takes over at its next try
        instead of a whole lease later. Called only after the coordinator has stopped writing."""
        if self._keeper is not None:
            self._keeper.stop()
        self.leading.clear()
        self.lease.release()
        metrics.LEADER.set(0)
        metrics.LEASE_TERM.set(0)
