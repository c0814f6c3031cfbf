"""Federated evaluation's rules, shared by the coordinator, the CLI and `simulate`: which rounds the sites score,
how their scores combine, which round is best, when a job stops early, and what a submitter is warned of.

Each site scores a global model on its own held-out split and reports (accuracy, mean cross-entropy, count);
the federated score of a round is the count-weighted mean, i.e. the score on the union of the sites' splits.
No site's samples leave it, and a score costs no ε (docs/privacy.md says what a score reveals).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fedbroker.errors import ConfigError
from fedbroker.job.spec import EvaluationConfig, JobSpec

SITES = ("participants", "category")   # evaluation.sites
POLICIES = ("allow", "deny")           # worker.evaluation


def due(evaluation: EvaluationConfig, number: int, last: int) -> bool:
    """Whether the sites score round (async: version) `number` of a job of `last`: every `every`-th, and the
    last one, so a finished job's final model always has a score; never with `every` 0."""
    return evaluation.every > 0 and (number % evaluation.every == 0 or number == last)


@dataclass(frozen=True)
class SiteScore:
    """One site's report: its accuracy and mean loss on `num_samples` held-out samples."""

    accuracy: float
    loss: float
    num_samples: int


@dataclass(frozen=True)
class Combined:
    """A round's federated score: the sites' scores weighted by their counts."""

    accuracy: float
    loss: float
    num_samples: int
    sites: int


def combine(scores: Iterable[SiteScore]) -> Combined | None:
    """Σ nᵢ·accᵢ / Σ nᵢ (and likewise the loss) over the sites that scored; None when none did."""
    kept = [s for s in scores if s.num_samples > 0]
    total = sum(s.num_samples for s in kept)
    if not total:
        return None
    return Combined(accuracy=sum(s.accuracy * s.num_samples for s in kept) / total,
                    loss=sum(s.loss * s.num_samples for s in kept) / total, num_samples=total, sites=len(kept))


@dataclass(frozen=True)
class Scored:
    """A closed round's scores: federated (None: no site scored it) and central (None: no evaluation set)."""

    round: int
    federated: float | None
    central: float | None


def scores_used(rounds: Sequence[Scored]) -> tuple[str, list[tuple[int, float]]]:
    """("federated" | "central", [(round, accuracy)]): the federated scores when any round has one, else the
    central ones (a job without sites' scores, or with an evaluation set only)."""
    federated = [(r.round, r.federated) for r in rounds if r.federated is not None]
    if federated:
        return "federated", federated
    return "central", [(r.round, r.central) for r in rounds if r.central is not None]


def best_round(rounds: Sequence[Scored]) -> tuple[int, float, str] | None:
    """(round, accuracy, "federated" | "central") of the best-scored round, the earliest of equals; None when
    no round has a score."""
    basis, scored = scores_used(rounds)
    if not scored:
        return None
    best = max(scored, key=lambda item: (item[1], -item[0]))
    return best[0], best[1], basis


@dataclass(frozen=True)
class EarlyStop:
    """Why a job stops early: its best round and score, and the scored rounds after it that did no better."""

    best_round: int
    best: float
    since: int
    basis: str

    def reason(self) -> str:
        """The job's event message."""
        return (f"stopped early: no better {self.basis} accuracy in {self.since} evaluated round(s) after round "
                f"{self.best_round} ({self.best:.4f}; evaluation.patience)")


def early_stop(rounds: Sequence[Scored], patience: int) -> EarlyStop | None:
    """An `EarlyStop` once `patience` (> 0) scored rounds followed the best one without a higher accuracy;
    `rounds` are those whose score is final (every site asked answered, or its deadline passed)."""
    if patience <= 0:
        return None
    found = best_round(rounds)
    if found is None:
        return None
    best, accuracy, basis = found
    since = sum(1 for r, _ in scores_used(rounds)[1] if r > best)
    return EarlyStop(best, accuracy, since, basis) if since >= patience else None


def submission_warnings(job: JobSpec) -> list[str]:
    """What the submitter should know but the job may do: trained on the sites' own data with no evaluation
    set and no federated evaluation, nothing will ever score it."""
    if not job.evaluation.dataset and job.evaluation.every == 0:
        return ["evaluation.every is 0 and the job names no evaluation.dataset: no round of this job will be "
                "scored (set evaluation.every to let the sites score the global model on their held-out data)"]
    return []


def check_policy(value: object) -> str:
    """`worker.evaluation`, checked: "allow" or "deny"."""
    if value not in POLICIES:
        raise ConfigError("worker.evaluation", f"must be 'allow' or 'deny', got {value!r}")
    return str(value)
