"""The part of the coordinator's state store (`StateStore`, which mixes it in) for events a job's loop writes on
their own, not as part of another write: why a job waits, how a round's updates were chosen.

As in store.py, the write is one transaction.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

T = TypeVar("T")


class JobNotes:
    """Mixed into `StateStore`: one more line of a job's history (`fedbroker jobs logs`)."""

    if TYPE_CHECKING:
        def _write(self, what: str, fn: Callable[[sqlite3.Connection], T]) -> T: ...
        def _exec(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]: ...

    def note_event(self, job_id: str, kind: str, message: str, *, round_number: int = 0, worker_id: str = "") -> None:
        """Record an event of the job (kind: `waiting`, `selection`, ...)."""
        def write(db: sqlite3.Connection) -> None:
            db.execute("INSERT INTO events (job_id, time, kind, round, worker_id, message) VALUES (?, ?, ?, ?, ?, ?)",
                       (job_id, time.time(), kind, round_number, worker_id, message))

        self._write(f"record a {kind} event of job {job_id!r}", write)
