"""The part of the coordinator's state store (`StateStore`, which mixes it in) that an operator reads about the
sites (`fedbroker sites`): what each runs and when it restarted (`site_info`), its own bounded history
(`site_events`: registered, restarted, expired, returned, refused, failed, ...) and the warnings and errors it
forwarded (`site_logs`). A silent site's `silent` holds when it was last heard before its silence (0: not silent).

Everything here is written for sites that registered (a row in `workers`), and each site keeps only its newest
`KEEP_EVENTS` events and `KEEP_LOGS` log records, every text cut and stripped of control characters
(fedbroker.printable): a hostile site can fill neither the disk nor the operator's terminal. Identical events in a
row are one row with a count, so a repeated refusal (or a flood of forged messages naming the site) does not
push the rest of its history out.

As in store.py, every write is one transaction and no database row leaves the store: reads return records.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Row, Table, delete, func, insert, select, update
from sqlalchemy.engine import Connection

from fedbroker.coordinator import tables
from fedbroker.coordinator.records import SiteEvent, SiteInfo, SiteLogRecord
from fedbroker.coordinator.store_notes import StoreAccess
from fedbroker.coordinator.store_sql import upsert
from fedbroker.printable import printable

KEEP_EVENTS = 200          # a site's newest events kept
KEEP_LOGS = 500            # a site's newest forwarded log records kept
MAX_EVENT_CHARS = 500      # an event's message
MAX_LOG_CHARS = 500        # a log record's text (the worker cuts it shorter)
MAX_LOGGER_CHARS = 100
MAX_VERSION_CHARS = 64
MAX_USER_CHARS = 140
MAX_LOGS_READ = 1000       # one read of a site's log records
ERROR_LEVELS = ("ERROR", "CRITICAL")

class SiteTables(StoreAccess):
    """Mixed into `StateStore`: its transactions (`_write`) and reads (`_exec`) over the three site tables."""



    def note_registration(self, worker_id: str, *, software_version: str, started: float, broker_user: str,
                          summary: str, changes: Sequence[str] = ()) -> None:
        """A registration: the first one is a `registered` event (`summary`: what the site holds); a new process
        (`started` changed) a `restarted` one; a changed registration (`changes`, a new version) `re-registered`;
        a silent site heard again `returned`."""
        version = printable(software_version, limit=MAX_VERSION_CHARS)
        user = printable(broker_user, limit=MAX_USER_CHARS)
        now = time.time()
        info = tables.site_info

        def write(conn: Connection) -> None:
            row = conn.execute(select(info.c.silent, info.c.software_version, info.c.started, info.c.broker_user)
                               .where(info.c.worker_id == worker_id)).first()
            if row is None:
                conn.execute(insert(info).values(worker_id=worker_id, software_version=version, first_registered=now,
                                                 started=started, broker_user=user))
                _site_event(conn, worker_id, "registered", summary + (f"; fedbroker {version}" if version else ""), now)
                return
            silent, was_version, was_started, was_user = row
            if silent:  # when it was last heard before its silence
                _site_event(conn, worker_id, "returned", f"registered again after {now - silent:.0f}s of silence", now)
            said = list(changes)
            if version and was_version and version != was_version:
                said.insert(0, f"fedbroker {was_version} → {version}")
            restarted = bool(started and was_started and abs(started - was_started) > 1e-3)
            if restarted:
                _site_event(conn, worker_id, "restarted", "a new worker process registered"
                            + (f" ({'; '.join(said)})" if said else ""), now)
            elif said:
                _site_event(conn, worker_id, "re-registered", "; ".join(said), now)
            conn.execute(update(info).where(info.c.worker_id == worker_id).values(
                software_version=version or was_version, started=started or was_started, broker_user=user or was_user,
                silent=0, restarts=info.c.restarts + int(restarted)))

        self._write(f"record the registration of site {worker_id!r}", write)

    def note_heard(self, worker_id: str) -> bool:
        """A heartbeat from a site: a silent one is `returned` (True); else nothing is written."""
        info = tables.site_info
        silence = select(info.c.silent).where(info.c.worker_id == worker_id)
        if not any(row.silent for row in self._exec(silence)):
            return False
        now = time.time()

        def write(conn: Connection) -> bool:
            silent = conn.execute(silence).scalar() or 0
            if not silent:
                return False
            conn.execute(update(info).where(info.c.worker_id == worker_id).values(silent=0))
            _site_event(conn, worker_id, "returned", f"heartbeats again after {now - silent:.0f}s of silence", now)
            return True

        return self._write(f"record that site {worker_id!r} is heard again", write)

    def mark_silent(self, *, timeout_s: float) -> list[str]:
        """Every registered site not heard for `timeout_s` and not yet marked gets an `expired` event (once, until
        it is heard again); the ids marked now."""
        now = time.time()
        w, info = tables.workers, tables.site_info

        def write(conn: Connection) -> list[str]:
            rows = conn.execute(select(w.c.worker_id, w.c.last_seen)
                                .select_from(w.outerjoin(info, info.c.worker_id == w.c.worker_id))
                                .where(w.c.last_seen < now - timeout_s, func.coalesce(info.c.silent, 0) == 0)
                                .order_by(w.c.worker_id)).all()
            for site, last_seen in rows:
                _ensure_site(conn, site, now)
                conn.execute(update(info).where(info.c.worker_id == site).values(  # when it was last heard
                    silent=max(float(last_seen), 1.0)))
                _site_event(conn, site, "expired", f"no heartbeat for {now - last_seen:.0f}s "
                                                   f"(coordinator.heartbeat_timeout_s is {timeout_s:g})", now)
            return [str(site) for site, _ in rows]

        return self._write("record the sites whose heartbeats stopped", write)

    def note_site_event(self, worker_id: str, kind: str, message: str, *, error: bool = False) -> bool:
        """One line of a registered site's history (`error`: also its last error); False for an id that never
        registered (nothing is written: an unknown id takes no room)."""
        now = time.time()

        def write(conn: Connection) -> bool:
            if not _registered(conn, worker_id):
                return False
            _ensure_site(conn, worker_id, now)
            text = _site_event(conn, worker_id, kind, message, now)
            if error:
                _last_error(conn, worker_id, f"{kind}: {text}", now)
            return True

        return self._write(f"record a {kind} event of site {worker_id!r}", write)

    def add_site_log(self, worker_id: str, *, sender: str, claimed: str, site_time: float, level: str, logger: str,
                     message: str, dropped_before: int) -> int | None:
        """Keep a log record a registered site forwarded (its newest KEEP_LOGS); its seq, None for an unknown id.
        An ERROR or CRITICAL one is also the site's last error."""
        now = time.time()
        text, name = printable(message, limit=MAX_LOG_CHARS), printable(logger, limit=MAX_LOGGER_CHARS)
        info = tables.site_info

        def write(conn: Connection) -> int | None:
            if not _registered(conn, worker_id):
                return None
            _ensure_site(conn, worker_id, now)
            key = conn.execute(insert(tables.site_logs).values(
                worker_id=worker_id, received=now, site_time=site_time, level=level, logger=name, message=text,
                sender=printable(sender, limit=MAX_USER_CHARS), claimed=printable(claimed, limit=MAX_USER_CHARS),
                dropped_before=max(0, dropped_before))).inserted_primary_key
            _prune(conn, tables.site_logs, worker_id, KEEP_LOGS)
            conn.execute(update(info).where(info.c.worker_id == worker_id).values(log_records=info.c.log_records + 1))
            if level in ERROR_LEVELS:
                _last_error(conn, worker_id, f"{name}: {text}", now)
            return int(key[0]) if key else 0

        return self._write(f"record a log record of site {worker_id!r}", write)

    def site_infos(self) -> dict[str, SiteInfo]:
        """Every site's info row, by worker id (a site registered before these tables has none until it is heard)."""
        return {info.worker_id: info for info in map(_site_info, self._exec(select(tables.site_info)))}

    def site_events(self, worker_id: str) -> list[SiteEvent]:
        """The site's kept events, oldest first."""
        events = tables.site_events
        rows = self._exec(select(events).where(events.c.worker_id == worker_id).order_by(events.c.seq))
        return [_site_event_record(r) for r in rows]

    def site_logs(self, worker_id: str, *, after: int = 0, limit: int = 200) -> list[SiteLogRecord]:
        """The site's newest `limit` kept log records with a seq above `after`, oldest first."""
        logs = tables.site_logs
        newest = self._exec(select(logs).where(logs.c.worker_id == worker_id, logs.c.seq > after)
                            .order_by(logs.c.seq.desc()).limit(max(1, min(limit, MAX_LOGS_READ))))
        return [_site_log_record(r) for r in reversed(newest)]


# ----- rows into records (the only place that reads a row of these tables by column name) -----

def _site_event_record(r: Row[Any]) -> SiteEvent:
    m = r._mapping
    return SiteEvent(seq=m["seq"], worker_id=m["worker_id"], time=m["time"], kind=m["kind"], message=m["message"],
                     count=m["count"], first_time=m["first_time"])


def _site_log_record(r: Row[Any]) -> SiteLogRecord:
    m = r._mapping
    return SiteLogRecord(seq=m["seq"], worker_id=m["worker_id"], received=m["received"], site_time=m["site_time"],
                         level=m["level"], logger=m["logger"], message=m["message"], sender=m["sender"],
                         claimed=m["claimed"], dropped_before=m["dropped_before"])


def _site_info(r: Row[Any]) -> SiteInfo:
    m = r._mapping
    return SiteInfo(worker_id=m["worker_id"], software_version=m["software_version"],
                    first_registered=m["first_registered"], started=m["started"], restarts=m["restarts"],
                    broker_user=m["broker_user"], silent=bool(m["silent"]), last_error=m["last_error"],
                    last_error_time=m["last_error_time"], log_records=m["log_records"])


def _registered(conn: Connection, worker_id: str) -> bool:
    w = tables.workers
    return conn.execute(select(1).where(w.c.worker_id == worker_id)).first() is not None


def _ensure_site(conn: Connection, worker_id: str, now: float) -> None:
    """A site registered before these tables existed gets its row when first written about."""
    upsert(conn, tables.site_info, {"worker_id": worker_id, "first_registered": now}, keys=("worker_id",))


def _last_error(conn: Connection, worker_id: str, text: str, now: float) -> None:
    info = tables.site_info
    conn.execute(update(info).where(info.c.worker_id == worker_id).values(last_error=text, last_error_time=now))


def _site_event(conn: Connection, worker_id: str, kind: str, message: str, now: float) -> str:
    """Append (or count again, when it repeats the newest) an event, keep the newest KEEP_EVENTS; the text kept."""
    text = printable(message, limit=MAX_EVENT_CHARS)
    events = tables.site_events
    last = conn.execute(select(events.c.seq, events.c.kind, events.c.message).where(events.c.worker_id == worker_id)
                        .order_by(events.c.seq.desc()).limit(1)).first()
    if last is not None and (last.kind, last.message) == (kind, text):
        conn.execute(update(events).where(events.c.seq == last.seq).values(count=events.c.count + 1, time=now))
        return text
    conn.execute(insert(events).values(worker_id=worker_id, time=now, kind=kind, message=text, first_time=now))
    _prune(conn, events, worker_id, KEEP_EVENTS)
    return text


def _prune(conn: Connection, table: Table, worker_id: str, keep: int) -> None:
    """Delete the site's rows of `table` (site_events or site_logs) older than its newest `keep`."""
    oldest_kept = (select(table.c.seq).where(table.c.worker_id == worker_id).order_by(table.c.seq.desc())
                   .limit(1).offset(keep).scalar_subquery())
    conn.execute(delete(table).where(table.c.worker_id == worker_id, table.c.seq <= oldest_kept))
