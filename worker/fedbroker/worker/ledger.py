"""The worker's privacy ledger: ε spent and accountant history per job, kept across restarts.

Stored as one JSON file (never pickle), rewritten atomically (`fedbroker.files.write_atomic`), so a
crash leaves either the old or the new ledger, never half of one. A
ledger that cannot be read raises instead of starting empty: forgetting spent ε would let the
worker overspend its budget.

Besides the jobs' training, the ledger charges one-off releases about the data (`record_release`, see
worker/sharing.py): the noised label histogram (pure ε-DP) and feature statistics (Gaussian, (ε, δ_s)), each
drawn once and kept here so that a later request or a restart re-sends the same release instead of drawing
(and spending) again. The total is the plain sum (basic composition): jobs' (ε_job, δ) and releases'
(ε_release, δ_release) compose to (Σε, δ + Σδ_release); the budget caps Σε.

Next to the ledger, a mark file (`<ledger>.mark`) holds the highest total ever written. A ledger whose
total is below its mark (an older copy restored, an edit), or a missing ledger whose mark says ε was
spent, is refused at load: ε never falls silently. Losing both is what the coordinator catches: a task
carries the ε it recorded for the worker, and the worker refuses to train below it.

The ledger names its worker (`worker_id`): a worker refuses another worker's ledger, and an operator who corrects
the ε the coordinator recorded for a worker (`fedbroker workers reset-epsilon`) can show it is that worker's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import numbers
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from fedbroker.errors import ConfigError
from fedbroker.files import write_atomic

log = logging.getLogger(__name__)
# A missing ledger may be a lost one: a warning, except where a run starts its workers afresh (`fresh_ledgers`).
NEW_LEDGER_LEVEL: ContextVar[int] = ContextVar("new_ledger_level", default=logging.WARNING)


@contextmanager
def fresh_ledgers() -> Iterator[None]:
    """Within it, a missing ledger is logged at INFO: the demo and simulate start workers in a new run folder,
    where every ledger is new by design (a real worker process keeps the warning)."""
    token = NEW_LEDGER_LEVEL.set(logging.INFO)
    try:
        yield
    finally:
        NEW_LEDGER_LEVEL.reset(token)

FORMAT_VERSION = 1
MARK_SUFFIX = ".mark"
_Entry = dict[str, Any]  # {"epsilon": float, "history": [[noise_multiplier, sample_rate, steps], ...]}
# A release: {"epsilon": ε spent on all its draws, "draw_epsilon": ε of the kept draw, "value": [...] (counts or
#             floats), "source_sha256": digest of what it was drawn from (stays on the owner's disk), and
#             "delta": δ of the kept draw (absent: 0, a pure ε-DP release, as every ledger before it had)}
_Release = dict[str, Any]
# Totals are sums of floats in dict order, which a reload may change: compare them with this slack.
_SLACK = 1e-9


def below(total: float, other: float) -> bool:
    """Whether ε `total` is below `other` by more than float summation order can explain."""
    return total < other - _SLACK * max(1.0, abs(other))


@dataclass(frozen=True)
class Shared:
    """One thing this site sent out about its data: to which job, what, when, and the ε it was charged (0 for
    what costs no ε, e.g. an evaluation score; a release sent to a second job is charged once, at its draw)."""

    job_id: str
    what: str           # histogram | statistics | evaluation | ...
    epsilon: float
    time_unix: float
    recipient: str      # coordinator | aggregator


@dataclass(frozen=True)
class Release:
    """A kept release (e.g. the noised label histogram): what was published and the ε (and δ) of that draw."""

    value: list[float]   # ints for counts
    draw_epsilon: float
    source_sha256: str
    delta: float = 0.0


class PrivacyLedger:
    """Per-job ε and RDP history. Safe across threads of one process; one process per file."""

    def __init__(self, path: str, *, worker_id: str | None = None) -> None:
        """`worker_id`: the worker keeping it (refused when the file names another; written into a file that
        names none). None: whoever's it is (an operator reading a site's ledger)."""
        self.path = path
        self.mark_path = path + MARK_SUFFIX
        self._lock = threading.Lock()
        self._releases: dict[str, _Release] = {}
        self._shared: list[dict[str, Any]] = []
        self.worker_id: str | None = None  # as the file names it
        self._jobs: dict[str, _Entry] = self._load()
        self._check_mark()
        if worker_id is not None and self.worker_id != worker_id:
            if self.worker_id is not None:
                raise ConfigError(self.path, f"privacy ledger of worker {self.worker_id!r}, not of {worker_id!r}: "
                                             f"refusing another worker's history")
            self.worker_id = worker_id
            if os.path.exists(self.path):
                with self._lock:
                    self._write(self._jobs, self._releases)

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
            return _total(self._jobs, self._releases)

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
            self._write(jobs, self._releases)
            self._jobs = jobs

    def release(self, name: str) -> Release | None:
        """The kept draw of a one-off release (None: never released)."""
        with self._lock:
            r = self._releases.get(name)
            return Release(list(r["value"]), float(r["draw_epsilon"]), str(r["source_sha256"]),
                           float(r.get("delta", 0.0))) if r else None

    def record_release(self, name: str, *, value: Sequence[float], epsilon: float, source: Sequence[float],
                       delta: float = 0.0) -> None:
        """Charge a new (ε, δ)-DP release of `source` (published as `value`: counts or finite floats) and keep it
        for later requests and restarts.

        A release replaced by a new draw still counts: its ε is added to what the name spent before."""
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 < epsilon < math.inf:
            raise ConfigError("epsilon", f"must be a finite number > 0, got {epsilon!r}")
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 <= delta < 1:
            raise ConfigError("delta", f"must be a number in [0, 1), got {delta!r}")
        values = [_number(v, f"value[{i}]") for i, v in enumerate(value)]
        with self._lock:
            spent = float(self._releases[name]["epsilon"]) if name in self._releases else 0.0
            releases = dict(self._releases)
            releases[name] = {"epsilon": spent + float(epsilon), "draw_epsilon": float(epsilon), "value": values,
                              "source_sha256": source_digest(source)}
            if delta:
                releases[name]["delta"] = float(delta)
            self._write(self._jobs, releases)
            self._releases = releases

    def note_shared(self, job_id: str, what: str, *, epsilon: float = 0.0, recipient: str = "coordinator") -> None:
        """Log that something about this data left the site (what a site's `fedbroker ledger` lists). It charges
        nothing: the ε is the one charged when the release was drawn (`record_release`), noted here for reading."""
        entry = {"job_id": str(job_id), "what": str(what), "epsilon": float(epsilon), "time_unix": time.time(),
                 "recipient": str(recipient)}
        with self._lock:
            self._write(self._jobs, self._releases, [*self._shared, entry])
            self._shared.append(entry)

    def shared(self) -> list[Shared]:
        """Everything `note_shared` logged, oldest first."""
        with self._lock:
            return [Shared(**e) for e in self._shared]

    def jobs(self) -> dict[str, float]:
        """Job id → ε spent, for registration messages and metrics."""
        with self._lock:
            return {job: float(e["epsilon"]) for job, e in self._jobs.items()}

    def _load(self) -> dict[str, _Entry]:
        try:
            with open(self.path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except FileNotFoundError:
            log.log(NEW_LEDGER_LEVEL.get(), "no privacy ledger at %s: starting a new one (a worker with history is "
                    "refused by its mark file, or by the ε its coordinator recorded)", self.path)
            return {}
        except (OSError, ValueError) as exc:
            raise ConfigError(self.path, f"privacy ledger is unreadable ({exc}); refusing to start from zero") from None
        if not isinstance(doc, dict) or doc.get("version") != FORMAT_VERSION or not isinstance(doc.get("jobs"), dict):
            raise ConfigError(self.path, f"not a privacy ledger of format version {FORMAT_VERSION}")
        if not isinstance(doc.get("worker_id", ""), str):
            raise ConfigError(self.path, "worker_id must be text")
        self.worker_id = doc.get("worker_id") or None
        jobs: dict[str, _Entry] = {}
        for job_id, e in doc["jobs"].items():
            try:
                eps = float(e["epsilon"])
                entries = [_entry(i, h) for i, h in enumerate(e["history"])]
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(self.path, f"job {job_id!r} has a malformed ledger entry ({exc})") from None
            jobs[job_id] = {"epsilon": eps, "history": entries}
        releases = doc.get("releases", {})
        if not isinstance(releases, dict):
            raise ConfigError(self.path, "releases must be a mapping")
        for name, r in releases.items():
            try:
                self._releases[name] = {"epsilon": float(r["epsilon"]), "draw_epsilon": float(r["draw_epsilon"]),
                                        "value": [_number(v, "value") for v in r["value"]],
                                        "source_sha256": str(r["source_sha256"])}
                if "delta" in r:
                    self._releases[name]["delta"] = float(r["delta"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(self.path, f"release {name!r} has a malformed ledger entry ({exc})") from None
        shared = doc.get("shared", [])
        if not isinstance(shared, list):
            raise ConfigError(self.path, "shared must be a list")
        for i, e in enumerate(shared):
            try:
                self._shared.append({"job_id": str(e["job_id"]), "what": str(e["what"]), "epsilon": float(e["epsilon"]),
                                     "time_unix": float(e["time_unix"]), "recipient": str(e["recipient"])})
            except (KeyError, TypeError, ValueError) as exc:
                raise ConfigError(self.path, f"shared[{i}] is a malformed ledger entry ({exc})") from None
        return jobs

    def _check_mark(self) -> None:
        """Refuse a ledger whose total is below the highest total written next to it (see the module)."""
        try:
            with open(self.mark_path, encoding="utf-8") as fh:
                marked = float(json.load(fh)["total_epsilon"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(self.mark_path, f"privacy ledger mark is unreadable ({exc}); refusing to start") from None
        total = _total(self._jobs, self._releases)
        if not os.path.exists(self.path) and marked > 0:
            raise ConfigError(self.path, f"privacy ledger is missing, but its mark {self.mark_path} says ε {marked:.6g} "
                                         f"was spent; restore the ledger (refusing to start from zero)")
        if below(total, marked):
            raise ConfigError(self.path, f"privacy ledger holds ε {total:.6g}, below the {marked:.6g} its mark "
                                         f"{self.mark_path} recorded: an older or edited ledger; restore the latest "
                                         f"one (refusing to start from less than was spent)")

    def _write(self, jobs: dict[str, _Entry], releases: dict[str, _Release],
               shared: list[dict[str, Any]] | None = None) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        doc: dict[str, Any] = {"version": FORMAT_VERSION, "jobs": jobs}
        if self.worker_id is not None:
            doc["worker_id"] = self.worker_id
        if releases:
            doc["releases"] = releases
        shared = self._shared if shared is None else shared
        if shared:
            doc["shared"] = shared
        write_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True).encode())
        # After the ledger: a crash in between leaves a mark below the ledger, which is allowed.
        write_atomic(self.mark_path, json.dumps({"total_epsilon": _total(jobs, releases)}).encode())


def _total(jobs: dict[str, _Entry], releases: dict[str, _Release]) -> float:
    return float(sum(e["epsilon"] for e in jobs.values()) + sum(r["epsilon"] for r in releases.values()))


def source_digest(values: Sequence[float]) -> str:
    """Identifies what a release was drawn from, so a changed data set draws (and pays for) a new one. Counts
    digest as the integers they are (as ledgers always did); other values as floats."""
    return hashlib.sha256(json.dumps([_number(v, "source") for v in values]).encode()).hexdigest()


def _number(value: object, what: str) -> int | float:
    """An integer kept as one (counts), any other real as a finite float; anything else raises ValueError."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value)):
        return float(value)
    raise ValueError(f"{what} must be a finite number, got {value!r}")


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
