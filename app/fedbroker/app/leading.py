"""A coordinator process on a shared database (`coordinator.database_url`): it serves its gRPC port at once, as a
standby (standby_gate.py), elects itself on the lease `coordinator` in a thread of its own (coordinator/standby.py),
and only once it leads starts what acts: the coordinator's job threads (which resume every
running job at its current round), the control queue's consumer and the bus.

The store's fence hook is set before the store is used at all, so every write this process ever makes is checked
against the lease's term; a standby makes none. A leader that loses the lease exits (standby.exit_now).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from fedbroker.app.launch import CoordinatorProcess
from fedbroker.bus import Bus
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.standby import LEASE_NAME, Leadership
from fedbroker.coordinator.standby_gate import StandbyGate

log = logging.getLogger(__name__)


def advertised(listen: str) -> str:
    """The address a standby names this process by: `listen`, with a wildcard host replaced by this host's name."""
    host, _, port = listen.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = socket.gethostname()
    return f"{host}:{port}"


@dataclass
class LeadingProcess(CoordinatorProcess):
    """A coordinator that leads or stands by; `stop` hands the lease over at once when it led."""

    leadership: Leadership = field(kw_only=True)
    stopping: threading.Event = field(kw_only=True, default_factory=threading.Event)
    election: threading.Thread | None = field(kw_only=True, default=None)

    def elect(self) -> None:
        """Wait for the lease in a thread, and start acting once it is held."""
        self.election = threading.Thread(target=self._lead, name="coordinator-election", daemon=True)
        self.election.start()

    def _lead(self) -> None:
        if not self.leadership.wait_to_lead(self.stopping):
            return
        log.info("leading at term %s: resuming the running jobs and consuming the control queue",
                 self.leadership.term)
        self.coordinator.start()
        self.bus.start()
        self.coordinator.log_consumer_timeout()

    def stop(self) -> None:
        """Stop electing; a leader stops scheduling and consuming, then gives the lease up (the standby takes over
        at its next try), then the port and the bus close."""
        self.stopping.set()
        if self.election is not None:
            self.election.join(timeout=30)
        led = self.leadership.leading.is_set()
        if led:
            self.coordinator.stop()
        self.server.stop(grace=1)
        self.bus.close()
        if led:
            self.leadership.release()
        self.coordinator.store.close()


def start_leading(coordinator: Coordinator, bus: Bus, leadership: Leadership, *, address: str,
                  serve: Callable[..., tuple[grpc.Server, int]]) -> LeadingProcess:
    """Serve `coordinator` (built, not started) behind a standby's gate, and elect: it acts once it leads."""
    server, port = serve(coordinator, address=address,
                         gate=StandbyGate(leadership.leading.is_set, leadership.leader))
    log.info("coordinator listening on port %d as %s; waiting for the lease %r (lease_ttl_s %g)", port,
             leadership.holder, LEASE_NAME, leadership.lease.ttl_s)
    process = LeadingProcess(coordinator, server, port, bus, leadership=leadership)
    process.elect()
    return process
