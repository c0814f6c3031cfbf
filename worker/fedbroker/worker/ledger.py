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

A job with distributed DP (privacy.distributed) keeps, beside its ε, the parameters of each of its rounds
(`DistributedRound`: scale, dimension, clip, noise multiplier, sample rate, quorum, this site's noise share μ_i, ring
bits, δ), from which both of its figures can be recomputed: the `epsilon` it is charged (the distributed ε: the
secure sum carries the quorum's noise) and `local_floor_epsilon` (this site's own share alone: what it keeps were
every other site colluding with the server). A ledger holding such rounds is written as format 2, which an older
worker refuses instead of dropping them; every other ledger stays format 1, and both load.

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
DISTRIBUTED_FORMAT = 2   # a ledger holding distributed-DP rounds (module docstring)
READABLE_FORMATS = (FORMAT_VERSION, DISTRIBUTED_FORMAT)
MARK_SUFFIX = ".mark"
# {"epsilon": float, "history": [[noise_multiplier, sample_rate, steps], ...]}, and in a distributed-DP job
# "distributed": {"floor_epsilon": float, "rounds": [DistributedRound.to_dict(), ...]}
_Entry = dict[str, Any]
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
class DistributedRound:
    """One distributed-DP round as this site took part in it: what recomputes its ε (fedbroker/secagg/skellam.py)."""

    round: int
    scale: float             # γ: quantisation levels per unit of the gradient sum
    dim: int                 # d: coordinates of the sum
    clip: float              # C: each record's gradient is clipped to this L2 norm
    noise_multiplier: float  # z: the quorum's sum carries Skellam noise of std z·C (in units)
    sample_rate: float       # q: each record's Poisson probability
    quorum: int              # n_min: the fewest shares the sum carries
    mu: float                # μ_i: the Skellam variance (levels²) this site added per coordinate
    bits: int                # the ring 2^bits
    delta: float             # δ both figures are stated at
    mode: str = "distributed"  # this site's dp.mode in the round (local: μ_i is the whole dose)

    def to_dict(self) -> dict[str, Any]:
        """As the ledger file holds it."""
        return {f: getattr(self, f) for f in _ROUND_FIELDS}

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> DistributedRound:
        """From the ledger file; ConfigError naming `where` for anything malformed."""
        try:
            if not isinstance(raw, dict) or set(raw) != set(_ROUND_FIELDS):
                raise ValueError(f"needs exactly the fields {', '.join(_ROUND_FIELDS)}")
            out = cls(round=_whole(raw["round"]), scale=float(raw["scale"]), dim=_whole(raw["dim"]),
                      clip=float(raw["clip"]), noise_multiplier=float(raw["noise_multiplier"]),
                      sample_rate=float(raw["sample_rate"]), quorum=_whole(raw["quorum"]), mu=float(raw["mu"]),
                      bits=_whole(raw["bits"]), delta=float(raw["delta"]), mode=str(raw["mode"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(where, f"a malformed distributed-DP round ({exc})") from None
        out.check(where)
        return out

    def check(self, where: str) -> None:
        """Refuse values no round can have (a ledger edited by hand, a caller's slip)."""
        numbers_ok = all(math.isfinite(v) and v > 0 for v in (self.scale, self.clip, self.noise_multiplier, self.mu))
        if not (numbers_ok and self.dim >= 1 and 0 < self.sample_rate <= 1 and self.quorum >= 1
                and 8 <= self.bits <= 64 and 0 < self.delta < 1 and self.round >= 0
                and self.mode in ("local", "distributed")):
            raise ConfigError(where, f"an invalid distributed-DP round {self.to_dict()}")


_ROUND_FIELDS = ("round", "scale", "dim", "clip", "noise_multiplier", "sample_rate", "quorum", "mu", "bits", "delta",
                 "mode")


def _whole(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{value!r} is not a whole number")
    return int(value)


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
            jobs[job_id] = {**(old or {}), "epsilon": float(epsilon), "history": entries}
            self._write(jobs, self._releases)
            self._jobs = jobs

    def record_distributed(self, job_id: str, *, step: DistributedRound, epsilon: float, floor_epsilon: float) -> None:
        """Append a distributed-DP round to the job's and store both figures after it: `epsilon` (distributed, the
        one the budget counts) and `floor_epsilon` (its own share alone). Refuses to lower either."""
        if not isinstance(job_id, str) or not job_id:
            raise ConfigError("job_id", f"must be a non-empty string, got {job_id!r}")
        for name, value in (("epsilon", epsilon), ("floor_epsilon", floor_epsilon)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ConfigError(name, f"must be a finite number >= 0, got {value!r}")
        step.check("step")
        with self._lock:
            old = self._jobs.get(job_id, {"epsilon": 0.0, "history": []})
            before = old.get("distributed", {"floor_epsilon": 0.0, "rounds": []})
            if epsilon < old["epsilon"] or floor_epsilon < before["floor_epsilon"]:
                raise ConfigError("epsilon", f"job {job_id!r} already spent {old['epsilon']:.6g} (floor "
                                             f"{before['floor_epsilon']:.6g}); refusing to record less")
            jobs = dict(self._jobs)
            jobs[job_id] = {**old, "epsilon": float(epsilon), "distributed": {
                "floor_epsilon": float(floor_epsilon), "rounds": [*before["rounds"], step.to_dict()]}}
            self._write(jobs, self._releases)
            self._jobs = jobs

    def distributed_rounds(self, job_id: str) -> list[DistributedRound]:
        """The job's distributed-DP rounds on this site, oldest first (empty for any other job)."""
        with self._lock:
            entry = self._jobs.get(job_id, {}).get("distributed")
            return [DistributedRound.from_dict(r, "rounds") for r in entry["rounds"]] if entry else []

    def floors(self) -> dict[str, float]:
        """Job id → local-floor ε, for the jobs with distributed DP (the figure if every other site colluded)."""
        with self._lock:
            return {job: float(e["distributed"]["floor_epsilon"]) for job, e in self._jobs.items() if "distributed" in e}

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

    def releases(self) -> dict[str, float]:
        """Release name → ε spent on all its draws (what the total counts; `release` gives the kept draw)."""
        with self._lock:
            return {name: float(r["epsilon"]) for name, r in self._releases.items()}

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
        if not isinstance(doc, dict) or doc.get("version") not in READABLE_FORMATS or not isinstance(doc.get("jobs"), dict):
            raise ConfigError(self.path, f"not a privacy ledger of format version {' or '.join(map(str, READABLE_FORMATS))}")
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
            if isinstance(e, dict) and "distributed" in e:
                jobs[job_id]["distributed"] = self._load_distributed(job_id, e["distributed"])
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

    def _load_distributed(self, job_id: str, raw: Any) -> dict[str, Any]:
        where = f"{self.path}: job {job_id!r}"
        if not isinstance(raw, dict) or not isinstance(raw.get("rounds"), list):
            raise ConfigError(where, "a malformed distributed-DP entry (needs floor_epsilon and rounds)")
        try:
            floor = float(raw["floor_epsilon"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(where, f"a malformed distributed-DP entry ({exc})") from None
        return {"floor_epsilon": floor, "rounds": [DistributedRound.from_dict(r, where).to_dict() for r in raw["rounds"]]}

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
        distributed = any("distributed" in e for e in jobs.values())
        doc: dict[str, Any] = {"version": DISTRIBUTED_FORMAT if distributed else FORMAT_VERSION, "jobs": jobs}
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
