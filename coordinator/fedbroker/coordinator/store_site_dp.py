"""The part of the coordinator's state store (`StateStore`, which mixes it in) that accounts a job's site-level DP
(privacy.site, DP-FedAvg at the aggregation service): per round, the sites asked and the sites registered for
the job's category; per job, the ε at δ = SITE_DELTA of every round so far, composed.

The unit protected is a whole site (all of its data, across the job). Each round is the sampled Gaussian
mechanism of noise multiplier z (the update's and, with adaptive clipping, the clipped count's noise together
cost exactly z: `aggregators.site_dp`) at sample rate q = asked / registered: the coordinator's draw is taken
as Poisson-like sampling of the category's sites (with every site in every round, q = 1 and there is no
amplification). The rounds compose by RDP, with the same arithmetic (Opacus's RDP of the sampled Gaussian,
its default orders) as a site's record-level ε (`fedbroker.privacy`), one step per round.

A round is recorded before the round's close is (sync_rounds), keyed by (job, round): a coordinator that
restarts between the two records it again with the same key, so no round is lost or counted twice. Its tables
are created on first use (a state file written before them gets them then); each write is one transaction,
with the `site_dp` event `jobs show` reads ("site-level ε = …, δ = …").
"""

from __future__ import annotations

import math
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fedbroker.coordinator.records import WorkerRecord
from fedbroker.coordinator.store_notes import StoreAccess, write_event
from fedbroker.job.spec import JobSpec
from fedbroker.privacy import epsilon_of, merge_steps

SITE_DELTA = 1e-5  # δ of the site-level guarantee: far below 1/(sites) for any consortium under 10^5 sites

SCHEMA = """
CREATE TABLE IF NOT EXISTS site_dp_rounds (
    job_id TEXT NOT NULL, round INTEGER NOT NULL, asked INTEGER NOT NULL, registered INTEGER NOT NULL,
    noise_multiplier REAL NOT NULL, time REAL NOT NULL, PRIMARY KEY (job_id, round)
);
CREATE TABLE IF NOT EXISTS site_dp_epsilon (
    job_id TEXT PRIMARY KEY, epsilon REAL NOT NULL, delta REAL NOT NULL, rounds INTEGER NOT NULL, time REAL NOT NULL
);
"""


@dataclass(frozen=True)
class SiteEpsilon:
    """A job's site-level guarantee so far."""

    job_id: str
    epsilon: float   # math.inf when a round had no noise (noise_multiplier 0: clipping only)
    delta: float
    rounds: int

    def describe(self) -> str:
        """The line `jobs show` prints."""
        eps = "∞ (a round without noise: clipping only)" if math.isinf(self.epsilon) else f"{self.epsilon:.4g}"
        return (f"site-level ε = {eps}, δ = {self.delta:g} after {self.rounds} round(s); the unit protected is a "
                f"whole site, trusting the aggregation service")


def sample_rate(asked: int, registered: int) -> float:
    """q of a round: the sites asked over the sites registered for the category (1 when every site is asked)."""
    if asked < 1:
        raise ValueError(f"a round asks at least one site, got {asked}")
    return min(1.0, asked / max(registered, asked))


def site_level_epsilon(rounds: Sequence[tuple[float, float]], *, delta: float = SITE_DELTA) -> float:
    """ε after `rounds`, each (noise multiplier z, sample rate q): the sampled Gaussian, one step per round,
    composed by RDP. Infinite when any round had z = 0."""
    if any(z <= 0 for z, _ in rounds):
        return math.inf
    history: list[tuple[float, float, int]] = []
    for z, q in rounds:
        history = merge_steps(history, noise_multiplier=z, sample_rate=q, steps=1)
    return epsilon_of(history, delta=delta)


class _Store(Protocol):
    def workers(self, category: str | None = None, *, seen_within_s: float | None = None) -> list[WorkerRecord]: ...

    def record_site_dp_round(self, job_id: str, round_number: int, *, asked: int, registered: int,
                             noise_multiplier: float) -> SiteEpsilon: ...


def account_round(store: _Store, job_id: str, job: JobSpec, *, round_number: int,
                  participants: Sequence[str]) -> SiteEpsilon | None:
    """A closed round of a site-DP job accounted (None for any other job): the sites it asked, over the sites
    registered for the job's category now."""
    site = job.privacy.site
    if not site.enabled:
        return None
    return store.record_site_dp_round(job_id, round_number, asked=len(set(participants)),
                                      registered=len(store.workers(job.category)),
                                      noise_multiplier=site.noise_multiplier)


class SiteDPTables(StoreAccess):
    """Mixed into `StateStore`: a site-DP job's rounds and its composed ε."""

    _site_dp_tables_ready = False

    def _site_dp_tables(self) -> None:
        if not self._site_dp_tables_ready:
            def create(db: sqlite3.Connection) -> None:
                for statement in (s for s in SCHEMA.split(";") if s.strip()):
                    db.execute(statement)

            self._write("create its site-DP tables", create)
            self._site_dp_tables_ready = True

    def record_site_dp_round(self, job_id: str, round_number: int, *, asked: int, registered: int,
                             noise_multiplier: float) -> SiteEpsilon:
        """Record a site-DP round (idempotent per round) and the job's ε over all its rounds, in one transaction."""
        self._site_dp_tables()
        q = sample_rate(asked, registered)

        def write(db: sqlite3.Connection) -> SiteEpsilon:
            db.execute("INSERT OR REPLACE INTO site_dp_rounds (job_id, round, asked, registered, noise_multiplier, "
                       "time) VALUES (?, ?, ?, ?, ?, ?)",
                       (job_id, round_number, asked, registered, float(noise_multiplier), time.time()))
            rows = db.execute("SELECT asked, registered, noise_multiplier FROM site_dp_rounds WHERE job_id = ?"
                              " ORDER BY round", (job_id,)).fetchall()
            history = [(float(z), sample_rate(int(a), int(r))) for a, r, z in rows]
            got = SiteEpsilon(job_id, site_level_epsilon(history), SITE_DELTA, len(history))
            db.execute("INSERT OR REPLACE INTO site_dp_epsilon (job_id, epsilon, delta, rounds, time)"
                       " VALUES (?, ?, ?, ?, ?)", (job_id, got.epsilon, got.delta, got.rounds, time.time()))
            write_event(db, job_id, "site_dp", round_number=round_number,
                        message=f"{got.describe()} (this round: noise multiplier {noise_multiplier:g}, "
                                f"q = {asked}/{max(registered, asked)} = {q:.4g})")
            return got

        return self._write(f"record site-level DP of round {round_number} of job {job_id!r}", write)

    def site_dp_epsilon(self, job_id: str) -> SiteEpsilon | None:
        """The job's site-level guarantee so far; None for a job without site-level DP (or before its first round)."""
        self._site_dp_tables()
        rows = self._exec("SELECT epsilon, delta, rounds FROM site_dp_epsilon WHERE job_id = ?", (job_id,))
        if not rows:
            return None
        (epsilon, delta, rounds), = rows
        return SiteEpsilon(job_id, float(epsilon), float(delta), int(rounds))

    def site_dp_rounds(self, job_id: str) -> list[tuple[int, int, int, float]]:
        """The job's recorded rounds: (round, asked, registered, noise multiplier), in order."""
        self._site_dp_tables()
        rows = self._exec("SELECT round, asked, registered, noise_multiplier FROM site_dp_rounds WHERE job_id = ?"
                          " ORDER BY round", (job_id,))
        return [(int(n), int(a), int(r), float(z)) for n, a, r, z in rows]
