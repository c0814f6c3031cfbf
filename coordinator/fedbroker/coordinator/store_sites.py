"""The part of the coordinator's state store (`StateStore`, which mixes it in) that an operator reads about the
sites (`fedbroker sites`): what each runs and when it restarted (`site_info`), its own bounded history
(`site_events`: registered, restarted, expired, returned, refused, failed, ...) and the warnings and errors it
forwarded (`site_logs`). A silent site's `silent` holds when it was last heard before its silence (0: not silent).

Everything here is written for sites that registered (a row in `workers`), and each site keeps only its newest
`KEEP_EVENTS` events and `KEEP_LOGS` log records, every text cut and stripped of control characters
(fedbroker.printable): a hostile site can fill neither the disk nor the operator's terminal. Identical events in a
row are one row with a count, so a repeated refusal (or a flood of forged messages naming the site) does not
push the rest of its history out.

Its tables are created on first use. As in store.py, every write is one transaction and no SQLite row leaves the
store: reads return records.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence

from fedbroker.coordinator.records import SiteEvent, SiteInfo, SiteLogRecord
from fedbroker.coordinator.store_notes import StoreAccess
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

SCHEMA = """
CREATE TABLE IF NOT EXISTS site_info (
    worker_id TEXT PRIMARY KEY, software_version TEXT NOT NULL DEFAULT '', first_registered REAL NOT NULL,
    started REAL NOT NULL DEFAULT 0, restarts INTEGER NOT NULL DEFAULT 0, broker_user TEXT NOT NULL DEFAULT '',
    silent REAL NOT NULL DEFAULT 0, last_error TEXT NOT NULL DEFAULT '', last_error_time REAL,
    log_records INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS site_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, worker_id TEXT NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL,
    message TEXT NOT NULL DEFAULT '', count INTEGER NOT NULL DEFAULT 1, first_time REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS site_events_by_worker ON site_events (worker_id, seq);
CREATE TABLE IF NOT EXISTS site_logs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, worker_id TEXT NOT NULL, received REAL NOT NULL, site_time REAL NOT NULL,
    level TEXT NOT NULL, logger TEXT NOT NULL, message TEXT NOT NULL, sender TEXT NOT NULL DEFAULT '',
    claimed TEXT NOT NULL DEFAULT '', dropped_before INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS site_logs_by_worker ON site_logs (worker_id, seq);
"""


class SiteTables(StoreAccess):
    """Mixed into `StateStore`: its transactions (`_write`) and reads (`_exec`) over the three site tables."""

    _site_tables_ready = False

    def _site_tables(self) -> None:
        if not self._site_tables_ready:
            self._write("create its site tables", lambda db: [db.execute(s) for s in SCHEMA.split(";") if s.strip()])
            self._site_tables_ready = True

    def note_registration(self, worker_id: str, *, software_version: str, started: float, broker_user: str,
                          summary: str, changes: Sequence[str] = ()) -> None:
        """A registration: the first one is a `registered` event (`summary`: what the site holds); a new process
        (`started` changed) a `restarted` one; a changed registration (`changes`, a new version) `re-registered`;
        a silent site heard again `returned`."""
        self._site_tables()
        version = printable(software_version, limit=MAX_VERSION_CHARS)
        user = printable(broker_user, limit=MAX_USER_CHARS)
        now = time.time()

        def write(db: sqlite3.Connection) -> None:
            row = db.execute("SELECT silent, software_version, started, broker_user FROM site_info WHERE worker_id = ?",
                             (worker_id,)).fetchone()
            if row is None:
                db.execute("INSERT INTO site_info (worker_id, software_version, first_registered, started, broker_user)"
                           " VALUES (?, ?, ?, ?, ?)", (worker_id, version, now, started, user))
                _site_event(db, worker_id, "registered", summary + (f"; fedbroker {version}" if version else ""), now)
                return
            silent, was_version, was_started, was_user = row
            if silent:  # when it was last heard before its silence
                _site_event(db, worker_id, "returned", f"registered again after {now - silent:.0f}s of silence", now)
            said = list(changes)
            if version and was_version and version != was_version:
                said.insert(0, f"fedbroker {was_version} → {version}")
            restarted = bool(started and was_started and abs(started - was_started) > 1e-3)
            if restarted:
                _site_event(db, worker_id, "restarted", "a new worker process registered"
                            + (f" ({'; '.join(said)})" if said else ""), now)
            elif said:
                _site_event(db, worker_id, "re-registered", "; ".join(said), now)
            db.execute("UPDATE site_info SET software_version = ?, started = ?, broker_user = ?, silent = 0,"
                       " restarts = restarts + ? WHERE worker_id = ?",
                       (version or was_version, started or was_started, user or was_user, int(restarted), worker_id))

        self._write(f"record the registration of site {worker_id!r}", write)

    def note_heard(self, worker_id: str) -> bool:
        """A heartbeat from a site: a silent one is `returned` (True); else nothing is written."""
        self._site_tables()
        if not any(silent for (silent,) in self._exec("SELECT silent FROM site_info WHERE worker_id = ?", (worker_id,))):
            return False
        now = time.time()

        def write(db: sqlite3.Connection) -> bool:
            (silent,) = db.execute("SELECT silent FROM site_info WHERE worker_id = ?", (worker_id,)).fetchone() or (0,)
            if not silent:
                return False
            db.execute("UPDATE site_info SET silent = 0 WHERE worker_id = ?", (worker_id,))
            _site_event(db, worker_id, "returned", f"heartbeats again after {now - silent:.0f}s of silence", now)
            return True

        return self._write(f"record that site {worker_id!r} is heard again", write)

    def mark_silent(self, *, timeout_s: float) -> list[str]:
        """Every registered site not heard for `timeout_s` and not yet marked gets an `expired` event (once, until
        it is heard again); the ids marked now."""
        self._site_tables()
        now = time.time()

        def write(db: sqlite3.Connection) -> list[str]:
            rows = db.execute("SELECT w.worker_id, w.last_seen FROM workers w LEFT JOIN site_info s ON"
                              " s.worker_id = w.worker_id WHERE w.last_seen < ? AND COALESCE(s.silent, 0) = 0"
                              " ORDER BY w.worker_id", (now - timeout_s,)).fetchall()
            for site, last_seen in rows:
                _ensure_site(db, site, now)
                db.execute("UPDATE site_info SET silent = ? WHERE worker_id = ?",  # when it was last heard
                           (max(float(last_seen), 1.0), site))
                _site_event(db, site, "expired", f"no heartbeat for {now - last_seen:.0f}s "
                                                 f"(coordinator.heartbeat_timeout_s is {timeout_s:g})", now)
            return [str(site) for site, _ in rows]

        return self._write("record the sites whose heartbeats stopped", write)

    def note_site_event(self, worker_id: str, kind: str, message: str, *, error: bool = False) -> bool:
        """One line of a registered site's history (`error`: also its last error); False for an id that never
        registered (nothing is written: an unknown id takes no room)."""
        self._site_tables()
        now = time.time()

        def write(db: sqlite3.Connection) -> bool:
            if db.execute("SELECT 1 FROM workers WHERE worker_id = ?", (worker_id,)).fetchone() is None:
                return False
            _ensure_site(db, worker_id, now)
            text = _site_event(db, worker_id, kind, message, now)
            if error:
                db.execute("UPDATE site_info SET last_error = ?, last_error_time = ? WHERE worker_id = ?",
                           (f"{kind}: {text}", now, worker_id))
            return True

        return self._write(f"record a {kind} event of site {worker_id!r}", write)

    def add_site_log(self, worker_id: str, *, sender: str, claimed: str, site_time: float, level: str, logger: str,
                     message: str, dropped_before: int) -> int | None:
        """Keep a log record a registered site forwarded (its newest KEEP_LOGS); its seq, None for an unknown id.
        An ERROR or CRITICAL one is also the site's last error."""
        self._site_tables()
        now = time.time()
        text, name = printable(message, limit=MAX_LOG_CHARS), printable(logger, limit=MAX_LOGGER_CHARS)

        def write(db: sqlite3.Connection) -> int | None:
            if db.execute("SELECT 1 FROM workers WHERE worker_id = ?", (worker_id,)).fetchone() is None:
                return None
            _ensure_site(db, worker_id, now)
            seq = db.execute(
                "INSERT INTO site_logs (worker_id, received, site_time, level, logger, message, sender, claimed,"
                " dropped_before) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (worker_id, now, site_time, level, name, text, printable(sender, limit=MAX_USER_CHARS),
                 printable(claimed, limit=MAX_USER_CHARS), max(0, dropped_before))).lastrowid
            _prune(db, "site_logs", worker_id, KEEP_LOGS)
            db.execute("UPDATE site_info SET log_records = log_records + 1 WHERE worker_id = ?", (worker_id,))
            if level in ERROR_LEVELS:
                db.execute("UPDATE site_info SET last_error = ?, last_error_time = ? WHERE worker_id = ?",
                           (f"{name}: {text}", now, worker_id))
            return int(seq or 0)

        return self._write(f"record a log record of site {worker_id!r}", write)

    def site_infos(self) -> dict[str, SiteInfo]:
        """Every site's info row, by worker id (a site registered before these tables has none until it is heard)."""
        self._site_tables()
        return {info.worker_id: info for info in map(_site_info, self._exec("SELECT * FROM site_info"))}

    def site_events(self, worker_id: str) -> list[SiteEvent]:
        """The site's kept events, oldest first."""
        self._site_tables()
        rows = self._exec("SELECT * FROM site_events WHERE worker_id = ? ORDER BY seq", (worker_id,))
        return [_site_event_record(r) for r in rows]

    def site_logs(self, worker_id: str, *, after: int = 0, limit: int = 200) -> list[SiteLogRecord]:
        """The site's newest `limit` kept log records with a seq above `after`, oldest first."""
        self._site_tables()
        rows = self._exec("SELECT * FROM (SELECT * FROM site_logs WHERE worker_id = ? AND seq > ? ORDER BY seq DESC"
                          " LIMIT ?) ORDER BY seq", (worker_id, after, max(1, min(limit, MAX_LOGS_READ))))
        return [_site_log_record(r) for r in rows]


# ----- rows into records (the only place that reads a row of these tables by column name) -----

def _site_event_record(r: sqlite3.Row) -> SiteEvent:
    return SiteEvent(seq=r["seq"], worker_id=r["worker_id"], time=r["time"], kind=r["kind"], message=r["message"],
                     count=r["count"], first_time=r["first_time"])


def _site_log_record(r: sqlite3.Row) -> SiteLogRecord:
    return SiteLogRecord(seq=r["seq"], worker_id=r["worker_id"], received=r["received"], site_time=r["site_time"],
                         level=r["level"], logger=r["logger"], message=r["message"], sender=r["sender"],
                         claimed=r["claimed"], dropped_before=r["dropped_before"])


def _site_info(r: sqlite3.Row) -> SiteInfo:
    return SiteInfo(worker_id=r["worker_id"], software_version=r["software_version"],
                    first_registered=r["first_registered"], started=r["started"], restarts=r["restarts"],
                    broker_user=r["broker_user"], silent=bool(r["silent"]), last_error=r["last_error"],
                    last_error_time=r["last_error_time"], log_records=r["log_records"])


def _ensure_site(db: sqlite3.Connection, worker_id: str, now: float) -> None:
    """A site registered before these tables existed gets its row when first written about."""
    db.execute("INSERT OR IGNORE INTO site_info (worker_id, first_registered) VALUES (?, ?)", (worker_id, now))


def _site_event(db: sqlite3.Connection, worker_id: str, kind: str, message: str, now: float) -> str:
    """Append (or count again, when it repeats the newest) an event, keep the newest KEEP_EVENTS; the text kept."""
    text = printable(message, limit=MAX_EVENT_CHARS)
    last = db.execute("SELECT seq, kind, message FROM site_events WHERE worker_id = ? ORDER BY seq DESC LIMIT 1",
                      (worker_id,)).fetchone()
    if last is not None and tuple(last)[1:] == (kind, text):
        db.execute("UPDATE site_events SET count = count + 1, time = ? WHERE seq = ?", (now, last[0]))
        return text
    db.execute("INSERT INTO site_events (worker_id, time, kind, message, first_time) VALUES (?, ?, ?, ?, ?)",
               (worker_id, now, kind, text, now))
    _prune(db, "site_events", worker_id, KEEP_EVENTS)
    return text


def _prune(db: sqlite3.Connection, table: str, worker_id: str, keep: int) -> None:
    """Delete the site's rows of `table` (a constant of this module) older than its newest `keep`."""
    db.execute(f"DELETE FROM {table} WHERE worker_id = ? AND seq <= (SELECT seq FROM {table} WHERE worker_id = ?"
               f" ORDER BY seq DESC LIMIT 1 OFFSET ?)", (worker_id, worker_id, keep))
