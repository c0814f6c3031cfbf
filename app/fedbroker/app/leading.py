"""A coordinator process on a shared database (`coordinator.database_url`): it serves its gRPC port at once, as a
standby (standby_gate.py), elects itself on the lease `coordinator` in a thread of its own (coordinator/standby.py),
and only once it leads starts what acts: the coordinator's job threads (which resume every running job at its
current round), the control queue's consumer and the bus (launch.start_coordinator hands that start over).

The store's fence hook is set before the store is used at all, so every write this process ever makes is checked
against the lease's term; a standby makes none. A leader that loses the lease exits (standby.exit_now).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable

from fedbroker.coordinator.standby import LEASE_NAME, Leadership
from fedbroker.coordinator.standby_gate import StandbyGate

log = logging.getLogger(__name__)


def advertised(listen: str) -> str:
    """The address a standby names this process by: `listen`, with a wildcard host replaced by this host's name."""
    host, _, port = listen.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = socket.gethostname()
    return f"{host}:{port}"


class Election:
    """Waits for the lease in a thread of its own and calls `act` once it is held (from that thread)."""

    def __init__(self, leadership: Leadership, act: Callable[[], None]) -> None:
        self.leadership = leadership
        self.gate = StandbyGate(leadership.leading.is_set, leadership.leader)
        self._act = act
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._lead, name="coordinator-election", daemon=True)

    def start(self, port: int) -> None:
        """Begin electing (the gRPC port, `port`, already serves behind `gate`)."""
        log.info("coordinator listening on port %d as %s; waiting for the lease %r (lease_ttl_s %g)", port,
                 self.leadership.holder, LEASE_NAME, self.leadership.lease.ttl_s)
        self._thread.start()

    def _lead(self) -> None:
        if self.leadership.wait_to_lead(self._stopping):
            log.info("leading at term %s: resuming the running jobs and consuming the control queue",
                     self.leadership.term)
            self._act()

    def stop(self) -> bool:
        """Stop electing; whether this process led (and so has a coordinator to stop, then a lease to release)."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        return self.leadership.leading.is_set()
