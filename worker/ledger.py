"""The worker's privacy ledger: ε spent and accountant history per job, kept across restarts.

Stored as one JSON file (never pickle), rewritten atomically (`fedbroker.files.write_atomic`), so a
crash leaves either the old or the new ledger, never half of one. A
ledger that cannot be read raises instead of starting empty: forgetting spent ε would let the
worker overspend its budget.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import threading
from collections.abc import Sequence
from typing import Any

from fedbroker.errors import ConfigError
from fedbroker.files import write_atomic

FORMAT_VERSION = 1
_Entry = dict[str, Any]  # {"epsilon": float, "history": [[noise_multiplier, sample_rate, steps], ...]}


class PrivacyLedger:
    """Per-job ε and RDP history. Safe across threads of one process; one process per file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._jobs: dict[str, _Entry] = self._load()

    def history(self, job_id: str) -> list[tuple[float, float, int]]:
        """The job's accountant history, to restore before its next round (empty for a new job)."""
        with self._lock:
            entry = self._jobs.get(job_id)
            return [(float(e[0]), float(e[1]), int(e[2])) for e in entry["history"]] if entry else []

    def epsilon(self, job_id: str) -> float:
        """ε spent on this worker's data by the job so far (0.0 for a new job)."""
        with self._lock:
            entry = self._jobs.get(job_id)
            return float(entry["epsilon"]) if entry else 0.0

    def total_epsilon(self) -> float:
        """Σ of the jobs' ε: basic sequential composition across jobs on the same data.

        This is a conservative upper bound (RDP composition of all histories would give a smaller
        number at one δ, but jobs may use different δ); a data owner can cap it safely.
        """
        with self._lock:
            return float(sum(e["epsilon"] for e in self._jobs.values()))

    def record(self, job_id: str, *, history: Sequence[Sequence[float]], epsilon: float) -> None:
        """Store the job's full history and total ε after a round; refuses to lower a job's ε.

        A lower ε can only come from a stale history (e.g. a retried task that started from an old
        copy); accepting it would erase spending, so it raises instead.
        """
        if not isinstance(job_id, str) or not job_id:
            raise ConfigError("job_id", f"must be a non-empty string, got {job_id!r}")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 <= epsilon < math.inf:
            raise ConfigError("epsilon", f"must be a finite number >= 0, got {epsilon!r}")
        entries = [_entry(i, e) for i, e in enumerate(history)]
        with self._lock:
            old = self._jobs.get(job_id)
            if old is not None and epsilon < old["epsilon"]:
                raise ConfigError(
                    "epsilon",
                    f"job {job_id!r} already spent {old['epsilon']:.6g}; refusing to record a lower {epsilon:.6g}",
                )
            jobs = dict(self._jobs)
            jobs[job_id] = {"epsilon": float(epsilon), "history": entries}
            self._write(jobs)
            self._jobs = jobs

    def jobs(self) -> dict[str, float]:
        """Job id → ε spent, for registration messages and metrics."""
        with self._lock:
            return {job: float(e["epsilon"]) for job, e in self._jobs.items()}

    def _load(self) -> dict[str, _Entry]:
        try:
            with open(self.path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise ConfigError(self.path, f"privacy ledger is unreadable ({exc}); refusing to start from zero") from None
        if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION or not isinstance(doc.get("jobs"), dict):
            raise ConfigError(self.path, f"not a privacy ledger of format version {FORMAT_VERSION}")
        jobs: dict[str, _Entry] = {}
        for job_id, e in doc["jobs"].items():
            try:
                eps = float(e["epsilon"])
                entries = [_entry(i, h) for i, h in enumerate(e["history"])]
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(self.path, f"job {job_id!r} has a malformed ledger entry ({exc})") from None
            jobs[job_id] = {"epsilon": eps, "history": entries}
        return jobs

    def _write(self, jobs: dict[str, _Entry]) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        doc = {"version": FORMAT_VERSION, "jobs": jobs}
        write_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True).encode())


def _entry(i: int, e: Sequence[float]) -> list[float | int]:
    if len(e) != 3:
        raise ConfigError(f"history[{i}]", f"must be (noise_multiplier, sample_rate, steps), got {e!r}")
    nm, q, steps = float(e[0]), float(e[1]), e[2]
    if isinstance(steps, float) and steps.is_integer():
        steps = int(steps)
    is_count = isinstance(steps, numbers.Integral) and not isinstance(steps, bool) and steps >= 0
    if not (nm > 0 and 0 < q <= 1 and is_count):
        raise ConfigError(f"history[{i}]", f"invalid accountant entry {e!r}")
    return [nm, q, int(steps)]
