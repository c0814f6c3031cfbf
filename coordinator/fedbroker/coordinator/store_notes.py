"""The part of the coordinator's state store (`StateStore`, which mixes it in) for a job's history (`fedbroker jobs
logs`): `write_event`, the one writer of its lines, which every store module calls in the transaction of what the
line reports, and the events a job's loop writes on their own: why a job waits, how a round's updates were chosen.

As in store.py, the write is one transaction, and `StoreAccess` is what every mixin may use of the store.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import Executable, Row
from sqlalchemy.engine import Connection

from fedbroker.coordinator.tables import events

T = TypeVar("T")


class StoreAccess:
    """What every table mixin uses of `StateStore`, which defines them: its transactions (`_write`), its reads
    (`_exec`) and its one-statement writes (`_run`)."""

    if TYPE_CHECKING:
        def _write(self, what: str, fn: Callable[[Connection], T]) -> T: ...
        def _exec(self, statement: Executable, params: Mapping[str, Any] | None = None) -> Sequence[Row[Any]]: ...
        def _run(self, what: str, statement: Executable, params: Mapping[str, Any] | None = None) -> int: ...


class JobNotes(StoreAccess):
    """Mixed into `StateStore`: one more line of a job's history (`fedbroker jobs logs`)."""

    def note_event(self, job_id: str, kind: str, message: str, *, round_number: int = 0, worker_id: str = "") -> None:
        """Record an event of the job (kind: `waiting`, `selection`, ...)."""
        self._write(f"record a {kind} event of job {job_id!r}", lambda conn: write_event(
            conn, job_id, kind, round_number=round_number, worker_id=worker_id, message=message))


def write_event(conn: Connection, job_id: str, kind: str, *, round_number: int = 0, worker_id: str = "",
                message: str = "") -> None:
    """One line of a job's history, written in the transaction `conn` of what it reports."""
    conn.execute(events.insert().values(job_id=job_id, time=time.time(), kind=str(kind), round=round_number,
                                        worker_id=worker_id, message=message))
