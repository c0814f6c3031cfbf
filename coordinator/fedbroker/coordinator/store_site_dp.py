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
restarts between the two records it again with the same key, so no round is lost or counted twice. Each write
is one transaction, with the `site_dp` event `jobs show` reads ("site-level ε = …, δ = …").
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import select
from sqlalchemy.engine import Connection

from fedbroker.coordinator import tables
from fedbroker.coordinator.records import WorkerRecord
from fedbroker.coordinator.store_notes import StoreAccess, write_event
from fedbroker.coordinator.store_sql import replace
from fedbroker.job.spec import JobSpec
from fedbroker.privacy import epsilon_of, merge_steps

SITE_DELTA = 1e-5  # δ of the site-level guarantee: far below 1/(sites) for any consortium under 10^5 sites


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



    def record_site_dp_round(self, job_id: str, round_number: int, *, asked: int, registered: int,
                             noise_multiplier: float) -> SiteEpsilon:
        """Record a site-DP round (idempotent per round) and the job's ε over all its rounds, in one transaction."""
        q = sample_rate(asked, registered)
        rounds = tables.site_dp_rounds

        def write(conn: Connection) -> SiteEpsilon:
            replace(conn, rounds, {"job_id": job_id, "round": round_number, "asked": asked, "registered": registered,
                                   "noise_multiplier": float(noise_multiplier), "time": time.time()})
            rows = conn.execute(select(rounds.c.asked, rounds.c.registered, rounds.c.noise_multiplier)
                                .where(rounds.c.job_id == job_id).order_by(rounds.c.round)).all()
            history = [(float(z), sample_rate(int(a), int(r))) for a, r, z in rows]
            got = SiteEpsilon(job_id, site_level_epsilon(history), SITE_DELTA, len(history))
            replace(conn, tables.site_dp_epsilon, {"job_id": job_id, "epsilon": got.epsilon, "delta": got.delta,
                                                   "rounds": got.rounds, "time": time.time()})
            write_event(conn, job_id, "site_dp", round_number=round_number,
                        message=f"{got.describe()} (this round: noise multiplier {noise_multiplier:g}, "
                                f"q = {asked}/{max(registered, asked)} = {q:.4g})")
            return got

        return self._write(f"record site-level DP of round {round_number} of job {job_id!r}", write)

    def site_dp_epsilon(self, job_id: str) -> SiteEpsilon | None:
        """The job's site-level guarantee so far; None for a job without site-level DP (or before its first round)."""
        e = tables.site_dp_epsilon
        rows = self._exec(select(e.c.epsilon, e.c.delta, e.c.rounds).where(e.c.job_id == job_id))
        if not rows:
            return None
        got = rows[0]
        return SiteEpsilon(job_id, float(got.epsilon), float(got.delta), int(got.rounds))

    def site_dp_rounds(self, job_id: str) -> list[tuple[int, int, int, float]]:
        """The job's recorded rounds: (round, asked, registered, noise multiplier), in order."""
        r = tables.site_dp_rounds
        rows = self._exec(select(r.c.round, r.c.asked, r.c.registered, r.c.noise_multiplier)
                          .where(r.c.job_id == job_id).order_by(r.c.round))
        return [(int(row.round), int(row.asked), int(row.registered), float(row.noise_multiplier)) for row in rows]
