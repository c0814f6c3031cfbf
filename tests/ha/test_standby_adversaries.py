"""The standby coordinator's faults in real processes (deploy/SECURITY.md, "HA: standby coordinator"): three
coordinator processes on one PostgreSQL database of the test's own (the machine's server), with the in-process bus
(no jobs: the election alone is under test).

- A split network: the leader reaches the database through a proxy the test cuts. Its renewals fail; once its lease
  would have lapsed it stops itself (exit 75) and the standby, which still reaches the database, takes the lease at
  the next term.
- A paused leader (SIGSTOP: a long GC pause, a frozen VM): the standby takes the lapsed lease; woken (SIGCONT), the
  old leader finds its term gone at its next renewal and exits 75 without acting.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ProgrammingError

from fedbroker.coordinator.standby import EXIT_LEASE_LOST, leader_address
from fedbroker.ha.lease import LEASES
from tests.ha.coordinators import until
from tests.postgres_node import scratch_database
from tests.rabbitmq_node import free_ports
from tests.source_roots import PYTHONPATH

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

LEASE_TTL_S = 2.0


class Proxy:
    """A TCP forwarder to the database that the test can cut (a network split between one process and it)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.is_cut = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.is_cut:   # a connection that raced the cut: refused all the same
                client.close()
                return
            upstream = socket.create_connection(self.target)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)

    def cut(self) -> None:
        self.is_cut = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)   # wakes the blocked accept (a close alone would not)
        self.listener.close()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


class Coordinators:
    def __init__(self, url: str, tmp: Path) -> None:
        self.url, self.tmp = url, tmp
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.addresses: dict[str, str] = {}
        self.engine = create_engine(url)

    def spawn(self, name: str, url: str) -> None:
        (port,) = free_ports(1)
        self.addresses[name] = f"127.0.0.1:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FEDBROKER__")}
        env["PYTHONPATH"] = PYTHONPATH
        env.update({"FEDBROKER__COORDINATOR__LISTEN": self.addresses[name],
                    "FEDBROKER__COORDINATOR__STATE_DIR": str(self.tmp / "state"),
                    "FEDBROKER__COORDINATOR__DATABASE_URL": url, "FEDBROKER__COORDINATOR__LEASE_TTL_S": str(LEASE_TTL_S),
                    "FEDBROKER__AGGREGATOR__TARGET": "127.0.0.1:1", "FEDBROKER__LOG_LEVEL": "INFO"})
        log = (self.tmp / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen([sys.executable, "-m", "fedbroker", "coordinator"], env=env,
                                                stdout=log, stderr=subprocess.STDOUT)

    def lease(self) -> tuple[str, int] | None:
        """(the leading coordinator's name, its term), None before anyone leads."""
        try:
            with self.engine.connect() as conn:
                row = conn.execute(select(LEASES.c.holder, LEASES.c.term).where(LEASES.c.name == "coordinator")).first()
        except ProgrammingError:
            return None
        if row is None:
            return None
        name = next((n for n, a in self.addresses.items() if a == leader_address(row.holder)), "?")
        return name, int(row.term)

    def exited(self, name: str) -> int | None:
        return self.processes[name].poll()

    def close(self) -> None:
        for process in self.processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGCONT)
            if process.poll() is None:
                process.kill()
            process.wait(30)
        self.engine.dispose()


@pytest.fixture
def coordinators(tmp_path: Path) -> Iterator[Coordinators]:
    with scratch_database() as url:
        group = Coordinators(url, tmp_path)
        try:
            yield group
        finally:
            group.close()


def test_a_cut_off_leader_stops_itself_and_a_paused_one_wakes_fenced(coordinators: Coordinators, tmp_path: Path) -> None:
    group = coordinators
    parsed = make_url(group.url)
    proxy = Proxy(parsed.host or "127.0.0.1", parsed.port or 5432)
    try:
        group.spawn("cut", parsed.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False))
        until(lambda: (lease := group.lease()) is not None and lease[0] == "cut", what="the first to lead",
              within_s=90, logs=tmp_path)
        group.spawn("paused", group.url)
        until(lambda: "this coordinator waits" in (tmp_path / "paused.log").read_text(), what="a standby",
              within_s=90, logs=tmp_path)

        proxy.cut()   # the leader can no longer reach the database; the standby can
        until(lambda: group.exited("cut") is not None, what="the cut-off leader to stop", within_s=60, logs=tmp_path)
        assert group.exited("cut") == EXIT_LEASE_LOST
        until(lambda: group.lease() == ("paused", 2), what="the standby to lead at term 2", within_s=60, logs=tmp_path)
    finally:
        proxy.cut()

    group.spawn("standby", group.url)
    until(lambda: "this coordinator waits" in (tmp_path / "standby.log").read_text(), what="a new standby",
          within_s=90, logs=tmp_path)
    os.kill(group.processes["paused"].pid, signal.SIGSTOP)   # the leader freezes; its lease lapses
    until(lambda: group.lease() == ("standby", 3), what="the standby to take the lapsed lease", within_s=60,
          logs=tmp_path)
    os.kill(group.processes["paused"].pid, signal.SIGCONT)   # it wakes, believing it leads
    until(lambda: group.exited("paused") is not None, what="the woken leader to stop", within_s=60, logs=tmp_path)
    assert group.exited("paused") == EXIT_LEASE_LOST
    assert group.lease() == ("standby", 3), "the woken leader took nothing back"
    assert "lost the lease" in (tmp_path / "paused.log").read_text()
    assert group.exited("standby") is None


def test_a_leader_frozen_inside_a_write_does_not_hold_the_takeover_forever() -> None:
    """A leader frozen in the middle of a fenced write holds the lease row's share lock: the server ends its
    transaction once it has been idle for a lease (`bound_lock_waits`), and the standby takes the lease then."""
    from sqlalchemy import text

    from fedbroker.coordinator.standby import Leadership

    with scratch_database() as url:
        leader_engine, standby_engine = create_engine(url), create_engine(url)
        try:
            lost: list[str] = []
            leader = Leadership(leader_engine, ttl_s=LEASE_TTL_S, advertise="a:1", on_lost=lost.append)
            assert leader.try_lead()
            if leader._keeper is not None:
                leader._keeper.stop()   # frozen: it renews no more
            frozen = leader_engine.connect()
            frozen.begin()
            leader.fence(frozen)        # the share lock a fenced write holds, never committed
            later = [0.0]
            standby = Leadership(standby_engine, ttl_s=LEASE_TTL_S, advertise="b:1", clock=lambda: later[0])
            later[0] = leader.lease.clock() + 10 * LEASE_TTL_S   # by the standby's clock the lease has lapsed
            until(standby.try_lead, what="the standby to take the lease held by a frozen transaction", within_s=60,
                  logs=Path("/nonexistent"))
            assert standby.term == 2
            with pytest.raises(Exception, match="terminat|closed|connection"):   # the server ended it
                frozen.execute(text("SELECT 1"))
            standby.release()
        finally:
            leader_engine.dispose()
            standby_engine.dispose()
