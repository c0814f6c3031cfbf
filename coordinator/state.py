"""The coordinator's durable state in one embedded SQLite file: jobs, workers, rounds, participants.

Every write commits at once (WAL mode), so a restarted coordinator finds each job where it stopped:
the last closed round and its checkpoint, and the round that was open (its participants and deadline),
which it resumes instead of starting over.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, name TEXT NOT NULL, spec_json TEXT NOT NULL,
    status TEXT NOT NULL, rounds_total INTEGER NOT NULL, rounds_done INTEGER NOT NULL DEFAULT 0,
    model_spec_json TEXT NOT NULL, error TEXT NOT NULL DEFAULT '', created REAL NOT NULL, updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY, categories_json TEXT NOT NULL, histogram_json TEXT NOT NULL,
    dp_enabled INTEGER NOT NULL, dp_json TEXT NOT NULL, epsilon_spent REAL NOT NULL, device TEXT NOT NULL,
    num_samples INTEGER NOT NULL, registered REAL NOT NULL, last_seen REAL NOT NULL, state TEXT NOT NULL DEFAULT 'idle'
);
CREATE TABLE IF NOT EXISTS rounds (
    job_id TEXT NOT NULL, round INTEGER NOT NULL, status TEXT NOT NULL,
    participants INTEGER NOT NULL, uploaded INTEGER NOT NULL DEFAULT 0, aggregated INTEGER NOT NULL DEFAULT 0,
    accuracy REAL, loss REAL, mean_train_loss REAL, seconds REAL, model_version INTEGER,
    checkpoint TEXT, stats_json TEXT NOT NULL DEFAULT '{}', started REAL NOT NULL, closed REAL,
    deadline REAL,
    PRIMARY KEY (job_id, round)
);
CREATE TABLE IF NOT EXISTS participants (
    job_id TEXT NOT NULL, round INTEGER NOT NULL, worker_id TEXT NOT NULL, status TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '', epsilon REAL, train_loss REAL, num_samples INTEGER,
    PRIMARY KEY (job_id, round, worker_id)
);
"""


@dataclass(frozen=True)
class WorkerRecord:
    worker_id: str
    categories: list[str]
    histogram: list[int]
    dp_enabled: bool
    dp: dict[str, float]
    epsilon_spent: float
    device: str
    num_samples: int
    last_seen: float
    state: str


class StateStore:
    def __init__(self, path: str) -> None:
        self.path = path
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
            columns = {r["name"] for r in self._db.execute("PRAGMA table_info(rounds)").fetchall()}
            if "deadline" not in columns:  # a state file written before rounds kept their deadline
                self._db.execute("ALTER TABLE rounds ADD COLUMN deadline REAL")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _exec(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ----- jobs -----

    def add_job(self, job_id: str, name: str, spec_json: str, rounds_total: int, model_spec_json: str) -> None:
        now = time.time()
        self._exec(
            "INSERT INTO jobs (job_id, name, spec_json, status, rounds_total, model_spec_json, created, updated)"
            " VALUES (?, ?, ?, 'pending', ?, ?, ?, ?)",
            (job_id, name, spec_json, rounds_total, model_spec_json, now, now),
        )

    def set_job_status(self, job_id: str, status: str, error: str = "") -> None:
        self._exec("UPDATE jobs SET status = ?, error = ?, updated = ? WHERE job_id = ?", (status, error, time.time(), job_id))

    def job(self, job_id: str) -> sqlite3.Row | None:
        rows = self._exec("SELECT * FROM jobs WHERE job_id = ?", (job_id,))
        return rows[0] if rows else None

    def jobs(self, status: str | None = None) -> list[sqlite3.Row]:
        if status:
            return self._exec("SELECT * FROM jobs WHERE status = ? ORDER BY created", (status,))
        return self._exec("SELECT * FROM jobs ORDER BY created")

    # ----- workers -----

    def upsert_worker(self, *, worker_id: str, categories: Iterable[str], histogram: Iterable[int], dp_enabled: bool,
                      dp: dict[str, float], epsilon_spent: float, device: str, num_samples: int) -> None:
        now = time.time()
        self._exec(
            "INSERT INTO workers (worker_id, categories_json, histogram_json, dp_enabled, dp_json, epsilon_spent,"
            " device, num_samples, registered, last_seen) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT(worker_id) DO UPDATE SET categories_json=excluded.categories_json,"
            " histogram_json=excluded.histogram_json, dp_enabled=excluded.dp_enabled, dp_json=excluded.dp_json,"
            " epsilon_spent=excluded.epsilon_spent, device=excluded.device, num_samples=excluded.num_samples,"
            " last_seen=excluded.last_seen",
            (worker_id, json.dumps(list(categories)), json.dumps([int(c) for c in histogram]), int(dp_enabled),
             json.dumps(dp), epsilon_spent, device, num_samples, now, now),
        )

    def touch_worker(self, worker_id: str, *, epsilon_spent: float, state: str) -> bool:
        with self._lock:
            cur = self._db.execute(
                "UPDATE workers SET last_seen = ?, epsilon_spent = ?, state = ? WHERE worker_id = ?",
                (time.time(), epsilon_spent, state, worker_id),
            )
            return cur.rowcount > 0

    def workers(self, category: str | None = None, *, seen_within_s: float | None = None) -> list[WorkerRecord]:
        rows = self._exec("SELECT * FROM workers ORDER BY worker_id")
        now = time.time()
        out = []
        for r in rows:
            record = WorkerRecord(
                r["worker_id"], json.loads(r["categories_json"]), json.loads(r["histogram_json"]), bool(r["dp_enabled"]),
                json.loads(r["dp_json"]), r["epsilon_spent"], r["device"], r["num_samples"], r["last_seen"], r["state"],
            )
            if category is not None and category not in record.categories:
                continue
            if seen_within_s is not None and now - record.last_seen > seen_within_s:
                continue
            out.append(record)
        return out

    # ----- rounds -----

    def open_round(self, job_id: str, round_number: int, participants: Sequence[str], *,
                   deadline: float | None = None, started: float | None = None) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM participants WHERE job_id = ? AND round = ?", (job_id, round_number))
            self._db.execute(
                "INSERT OR REPLACE INTO rounds (job_id, round, status, participants, started, deadline)"
                " VALUES (?, ?, 'open', ?, ?, ?)",
                (job_id, round_number, len(participants), started if started is not None else time.time(), deadline),
            )
            self._db.executemany(
                "INSERT INTO participants (job_id, round, worker_id, status) VALUES (?, ?, ?, 'published')",
                [(job_id, round_number, w) for w in participants],
            )
            self._db.execute("COMMIT")

    def round(self, job_id: str, round_number: int) -> sqlite3.Row | None:
        rows = self._exec("SELECT * FROM rounds WHERE job_id = ? AND round = ?", (job_id, round_number))
        return rows[0] if rows else None

    def set_round_deadline(self, job_id: str, round_number: int, deadline: float) -> None:
        self._exec("UPDATE rounds SET deadline = ? WHERE job_id = ? AND round = ?", (deadline, job_id, round_number))

    def set_uploaded(self, job_id: str, round_number: int, workers: Sequence[str]) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany(
                "UPDATE participants SET status = 'uploaded' WHERE job_id = ? AND round = ? AND worker_id = ?"
                " AND status = 'published'",
                [(job_id, round_number, w) for w in workers],
            )
            self._db.execute("UPDATE rounds SET uploaded = ? WHERE job_id = ? AND round = ?",
                             (len(workers), job_id, round_number))
            self._db.execute("COMMIT")

    def reset_uploads(self, job_id: str, round_number: int) -> None:
        """The aggregation service lost the round's uploads (it restarted without its spool): wait for them again."""
        self._exec("UPDATE participants SET status = 'published' WHERE job_id = ? AND round = ? AND status = 'uploaded'",
                   (job_id, round_number))

    def record_outcome(self, job_id: str, round_number: int, worker_id: str, status: str, reason: str) -> bool:
        """A refusal or failure reported by a worker; False when (job, round, worker) was never asked."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE participants SET status = ?, reason = ? WHERE job_id = ? AND round = ? AND worker_id = ?"
                " AND status IN ('published', 'failed', 'missed')",  # a straggler may explain itself after the close
                (status, reason, job_id, round_number, worker_id),
            )
            return cur.rowcount > 0

    def participants(self, job_id: str, round_number: int | None = None) -> list[sqlite3.Row]:
        if round_number is None:
            return self._exec("SELECT * FROM participants WHERE job_id = ? ORDER BY round, worker_id", (job_id,))
        return self._exec("SELECT * FROM participants WHERE job_id = ? AND round = ? ORDER BY worker_id",
                          (job_id, round_number))

    def close_round(self, job_id: str, round_number: int, *, model_version: int, aggregated: Sequence[str],
                    updates: Iterable[tuple[str, int, float, float]], accuracy: float | None, loss: float | None,
                    seconds: float, checkpoint: str, stats: dict[str, float], model_spec_json: str) -> None:
        """Record a closed round and advance the job in one transaction: resume starts after it."""
        updates = list(updates)
        mean_loss = sum(u[3] for u in updates) / len(updates) if updates else None
        chosen = set(aggregated)
        with self._lock:
            self._db.execute("BEGIN")
            for worker_id, num_samples, epsilon, train_loss in updates:
                self._db.execute(
                    "UPDATE participants SET status = ?, epsilon = ?, train_loss = ?, num_samples = ?"
                    " WHERE job_id = ? AND round = ? AND worker_id = ?",
                    ("aggregated" if worker_id in chosen else "uploaded", epsilon, train_loss, num_samples,
                     job_id, round_number, worker_id),
                )
            self._db.execute(
                "UPDATE participants SET status = 'missed', reason = 'no upload before the round closed'"
                " WHERE job_id = ? AND round = ? AND status = 'published'", (job_id, round_number),
            )
            self._db.execute(
                "UPDATE rounds SET status = 'closed', uploaded = ?, aggregated = ?, accuracy = ?, loss = ?,"
                " mean_train_loss = ?, seconds = ?, model_version = ?, checkpoint = ?, stats_json = ?, closed = ?"
                " WHERE job_id = ? AND round = ?",
                (len(updates), len(chosen), accuracy, loss, mean_loss, seconds, model_version, checkpoint,
                 json.dumps(stats), time.time(), job_id, round_number),
            )
            self._db.execute(
                "UPDATE jobs SET rounds_done = ?, model_spec_json = ?, updated = ? WHERE job_id = ?",
                (round_number, model_spec_json, time.time(), job_id),
            )
            self._db.execute("COMMIT")

    def fail_round(self, job_id: str, round_number: int, seconds: float) -> None:
        self._exec("UPDATE rounds SET status = 'failed', seconds = ?, closed = ? WHERE job_id = ? AND round = ?",
                   (seconds, time.time(), job_id, round_number))

    def rounds(self, job_id: str | None = None) -> list[sqlite3.Row]:
        if job_id:
            return self._exec("SELECT * FROM rounds WHERE job_id = ? ORDER BY round", (job_id,))
        return self._exec("SELECT * FROM rounds ORDER BY job_id, round")

    def last_checkpoint(self, job_id: str) -> sqlite3.Row | None:
        rows = self._exec(
            "SELECT * FROM rounds WHERE job_id = ? AND status = 'closed' ORDER BY round DESC LIMIT 1", (job_id,)
        )
        return rows[0] if rows else None
