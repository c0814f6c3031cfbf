"""Which aggregation replica serves which job: a lease `job:<job id>` per job in a database every replica reaches.

Two or more replicas share one spool folder (a ReadWriteMany volume) and the coordinator's database. A job is
served by the replica that holds its lease (`fedbroker.ha.lease`): the first call for a job on a replica that
does not own it takes the lease if it is free or lapsed, loads the job from the shared spool and serves it; a
lease held by a live replica is answered UNAVAILABLE with reason `not_owner`, naming that replica's advertised
address (`aggregator.advertise`), which clients follow only when it is one of their own targets.

Every spool write of an owned job runs inside `fenced(job_id)`: a database transaction that first checks the
job's lease is still ours at our term (`Lease.fence`). A replica that lost the job (paused past its lease, cut off
from the database) therefore writes nothing; on PostgreSQL the lease row stays share-locked until the write
is done, so a takeover never reads a half-written job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator

from sqlalchemy import Engine, create_engine, make_url
from sqlalchemy.exc import SQLAlchemyError

from fedbroker.aggregators import metrics
from fedbroker.errors import Unavailable, UnknownJob
from fedbroker.ha.lease import Lease, LeaseKeeper, LeaseLost, ensure_leases_table
from fedbroker.rpc.replicas import NOT_OWNER, OWNER_KEY

log = logging.getLogger(__name__)

LEASE_PREFIX = "job:"
_SEPARATOR = "|"                # a holder is "<advertised address>|<host>-<pid>-<random>"


class NotOwner(Unavailable):
    """Another live replica owns this job: call it (`owner`, its advertised address) instead."""

    reason = NOT_OWNER

    def __init__(self, message: str, *, owner: str) -> None:
        super().__init__(message)
        self.owner = owner
        self.trailers = ((OWNER_KEY, owner),) if owner else ()


def advertised(holder: str) -> str:
    """The advertised address a lease holder's name starts with ('' when it names none)."""
    return holder.split(_SEPARATOR, 1)[0] if _SEPARATOR in holder else ""


def lease_engine(database_url: str) -> Engine:
    """An engine on the coordinator's database with the `leases` table present (created when absent: the
    coordinator's migrations create it too). A plain `postgresql://` URL (CloudNativePG's `uri`) means psycopg 3."""
    url = make_url(database_url)
    if url.drivername == "postgresql":
        url = url.set(drivername="postgresql+psycopg")
    engine = create_engine(url, pool_pre_ping=True)
    ensure_leases_table(engine)
    return engine


class JobOwnership:
    """This replica's leases on jobs (see the module docstring). The book binds what to do on a takeover
    (`take`: load the job from the spool) and on a loss (`drop`: forget it), and what exists (`exists`)."""

    def __init__(self, engine: Engine, *, advertise: str, ttl_s: float = 10.0) -> None:
        if not advertise or _SEPARATOR in advertise:
            raise ValueError(f"aggregator.advertise must be this replica's address as clients list it (host:port, "
                             f"no {_SEPARATOR!r}), not {advertise!r}")
        self.engine = engine
        self.advertise = advertise
        self.ttl_s = ttl_s
        self.holder = f"{advertise}{_SEPARATOR}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._leases: dict[str, Lease] = {}
        self._keepers: dict[str, LeaseKeeper] = {}
        self._taking: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()  # the three dicts
        self._exists: Callable[[str], bool] = lambda job_id: False
        self._take: Callable[[str], None] = lambda job_id: None
        self._drop: Callable[[str], None] = lambda job_id: None

    def bind(self, *, exists: Callable[[str], bool], take: Callable[[str], None],
             drop: Callable[[str], None]) -> None:
        """The book's side: does the shared spool hold the job, load it (a takeover), forget it (a loss)."""
        self._exists, self._take, self._drop = exists, take, drop

    def owns(self, job_id: str) -> bool:
        """Whether this replica holds the job's lease (as far as it knows: its next fenced write proves it)."""
        with self._lock:
            lease = self._leases.get(job_id)
        return lease is not None and lease.held

    def ensure(self, job_id: str, *, create: bool = False) -> None:
        """Own the job before serving a call for it: take its lease when free or lapsed and load it (`take`);
        NotOwner when a live replica holds it; UnknownJob when the spool holds no such job and `create` is off
        (a worker's call naming a job nobody installed takes no lease); Unavailable while the database is not
        reachable (every client retries it)."""
        if self.owns(job_id):
            return
        try:
            self._ensure(job_id, create=create)
        except SQLAlchemyError as exc:
            raise Unavailable(f"the lease database is unreachable ({type(exc).__name__}): job {job_id!r} cannot be "
                              f"served until it is back") from exc

    def _ensure(self, job_id: str, *, create: bool) -> None:
        with self._lock:
            taking = self._taking.setdefault(job_id, threading.Lock())
        with taking:
            if self.owns(job_id):
                return
            lease = Lease(self.engine, LEASE_PREFIX + job_id, self.holder, ttl_s=self.ttl_s)
            self._refuse_if_held(lease)
            if not create and not self._exists(job_id):
                raise UnknownJob(f"unknown job {job_id!r}")
            if not lease.acquire():
                self._refuse_if_held(lease)
                raise Unavailable(f"the lease of job {job_id!r} is changing hands: retry")
            with self._lock:
                self._leases[job_id] = lease
            try:
                self._take(job_id)
            except BaseException:
                with self._lock:
                    self._leases.pop(job_id, None)
                lease.release()
                raise
            keeper = LeaseKeeper(lease, on_lost=lambda: self._lost(job_id, lease))
            with self._lock:
                self._keepers[job_id] = keeper
            keeper.start()
            metrics.JOBS_OWNED.inc()
            log.info("job %s: owned by this replica (%s) at term %s", job_id, self.advertise, lease.term)

    def _refuse_if_held(self, lease: Lease) -> None:
        now = lease.holder_now()
        if now is None:
            return
        holder, term, expires = now
        if holder != self.holder and expires > lease.clock():
            owner = advertised(holder)
            raise NotOwner(f"job {lease.name[len(LEASE_PREFIX):]!r} is served by the aggregation replica at "
                           f"{owner or holder} (term {term}): call it there", owner=owner)

    @contextlib.contextmanager
    def fenced(self, job_id: str) -> Iterator[None]:
        """One spool write of the job, inside a transaction that checks the job's lease is still ours first:
        LeaseLost (nothing written) when it is not, and the job is forgotten here."""
        with self._lock:
            lease = self._leases.get(job_id)
        if lease is None:
            raise LeaseLost(f"this replica does not own job {job_id!r}: the write was refused")
        try:
            with self.engine.begin() as conn:
                lease.fence(conn)
                yield
        except SQLAlchemyError as exc:  # no fence, no write: the caller's client retries
            raise Unavailable(f"the lease database is unreachable ({type(exc).__name__}): the write of job "
                              f"{job_id!r} was refused") from exc
        except LeaseLost:
            # the caller may hold the book's lock: forget the job on a thread of its own
            threading.Thread(target=self._lost, args=(job_id, lease), name=f"lost-{job_id}", daemon=True).start()
            raise

    def _lost(self, job_id: str, lease: Lease) -> None:
        with self._lock:
            if self._leases.get(job_id) is not lease:
                return  # already forgotten (or owned again under a new lease)
            del self._leases[job_id]
            keeper = self._keepers.pop(job_id, None)
        if keeper is not None:
            keeper.stop()
        lease.term = None
        metrics.JOBS_OWNED.dec()
        log.warning("job %s: this replica (%s) lost its lease; another replica serves it now", job_id, self.advertise)
        self._drop(job_id)

    def owned(self) -> list[str]:
        """The jobs this replica owns now."""
        with self._lock:
            return sorted(j for j, lease in self._leases.items() if lease.held)

    def stop(self) -> None:
        """A clean shutdown: stop renewing and release every lease, so another replica takes each job at once."""
        with self._lock:
            leases, keepers = dict(self._leases), dict(self._keepers)
            self._leases.clear()
            self._keepers.clear()
        for keeper in keepers.values():
            keeper.stop()
        for lease in leases.values():
            lease.release()
        metrics.JOBS_OWNED.dec(len(leases))
