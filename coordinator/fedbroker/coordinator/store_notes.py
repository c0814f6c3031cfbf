"""The part of the coordinator's state store (`StateStore`, which mixes it in) for a job's history (`fedbroker jobs
logs`): `write_event`, the one writer of its lines, which every store module calls in the transaction of what the
line reports, and the events a job's loop writes on their own: why a job waits, how a round's updates were chosen.

As in store.py, the write is one transaction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from sqlalchemy import insert

from fedbroker.coordinator import tables

T = TypeVar("T")


class StoreAccess:
    """What every table mixin uses of `StateStore`, which defines them: its transactions (`_write`), its reads
    (`_exec`) and its one-statement writes (`_run`)."""

    if TYPE_CHECKING:
        def _write(self, what: str, fn: Callable[[Any], T]) -> T: ...  # INTERIM: sqlite3 or SQLAlchemy
        def _exec(self, statement: Any, params: Any = None) -> Sequence[Any]: ...
        def _run(self, what: str, statement: Any, params: Any = None) -> int: ...


class JobNotes(StoreAccess):
    """Mixed into `StateStore`: one more line of a job's history (`fedbroker jobs logs`)."""

    def note_event(self, job_id: str, kind: str, message: str, *, round_number: int = 0, worker_id: str = "") -> None:
        """Record an event of the job (kind: `waiting`, `selection`, ...)."""
        self._write(f"record a {kind} event of job {job_id!r}", lambda db: write_event(
            db, job_id, kind, round_number=round_number, worker_id=worker_id, message=message))


def write_event(db: Any, job_id: str, kind: str, *, round_number: int = 0, worker_id: str = "",
                message: str = "") -> None:
    """One line of a job's history, written in the transaction `db` of what it reports."""
    db.execute(insert(tables.events).values(job_id=job_id, time=time.time(), kind=kind, round=round_number,
                                            worker_id=worker_id, message=message))
