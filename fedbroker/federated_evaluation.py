"""Federated evaluation's rules, shared by the coordinator, the CLI and `simulate`: which rounds the sites score,
how their scores combine, which round is best, when a job stops early, and what a submitter is warned of.

Each site scores a global model on its own held-out split and reports (its headline score, mean loss, count)
and the task's sums (`fedbroker.tasks.scores`: counts, intersections, error sums, score histograms); the
federated score of a round is made from the sites' summed sums, i.e. the score on the union of the sites'
splits exactly (Dice from summed intersections, never an average of averages). A report without sums (a site
from before tasks) is combined as before, by the count-weighted mean. The job's `evaluation.score` names the
headline that picks the best round and stops early (its direction from `fedbroker.tasks.scores.DIRECTIONS`), and
`evaluation.threshold` where sensitivity and specificity are read. No site's samples leave it, and a score
costs no ε (docs/privacy.md says what a score reveals).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from fedbroker.errors import ConfigError
from fedbroker.job.spec import EvaluationConfig, JobSpec
from fedbroker.job.task import TaskConfig
from fedbroker.tasks.scores import THRESHOLD, add_sums, headline
from fedbroker.tasks.scores import scores as task_scores

SITES = ("participants", "category")   # evaluation.sites
POLICIES = ("allow", "deny")           # worker.evaluation


def due(evaluation: EvaluationConfig, number: int, last: int) -> bool:
    """Whether the sites score round (async: version) `number` of a job of `last`: every `every`-th, and the
    last one, so a finished job's final model always has a score; never with `every` 0."""
    return evaluation.every > 0 and (number % evaluation.every == 0 or number == last)


@dataclass(frozen=True)
class SiteScore:
    """One site's report: its headline score and mean loss on `num_samples` held-out samples, and its sums."""

    accuracy: float
    loss: float
    num_samples: int
    sums: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Combined:
    """A round's federated score: `accuracy` is the job's headline score (`metric`: `evaluation.score`, or the
    task's own: accuracy, macro_f1, mae or dice), `scores` every score of the task made from the sites' summed
    sums (empty without sums)."""

    accuracy: float
    loss: float
    num_samples: int
    sites: int
    metric: str = "accuracy"
    scores: Mapping[str, float] = field(default_factory=dict)


def combine(scores: Iterable[SiteScore], task: TaskConfig | None = None, *, score: str = "",
            threshold: float = THRESHOLD) -> Combined | None:
    """The task's scores of the sites' summed sums when every site that scored sent sums (`score`: the job's
    `evaluation.score`, "" for the task's own; `threshold`: `evaluation.threshold`); else Σ nᵢ·accᵢ / Σ nᵢ (and
    likewise the loss), as before tasks. None when no site scored."""
    task = task or TaskConfig()
    name = headline(task, score)[0]
    kept = [s for s in scores if s.num_samples > 0]
    total = sum(s.num_samples for s in kept)
    if not total:
        return None
    if all(s.sums for s in kept):
        made = task_scores(task, add_sums(s.sums for s in kept), threshold=threshold)
        value = made.get(name, math.nan)
        return Combined(accuracy=value if math.isfinite(value) else 0.0, loss=made["loss"], num_samples=total,
                        sites=len(kept), metric=name, scores=made)
    return Combined(accuracy=sum(s.accuracy * s.num_samples for s in kept) / total,
                    loss=sum(s.loss * s.num_samples for s in kept) / total, num_samples=total, sites=len(kept),
                    metric=task.metric)


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


def best_round(rounds: Sequence[Scored], *, higher_is_better: bool = True) -> tuple[int, float, str] | None:
    """(round, score, "federated" | "central") of the best-scored round (the lowest score for an error, MAE),
    the earliest of equals; None when no round has a score."""
    basis, scored = scores_used(rounds)
    if not scored:
        return None
    sign = 1.0 if higher_is_better else -1.0
    best = max(scored, key=lambda item: (sign * item[1], -item[0]))
    return best[0], best[1], basis


@dataclass(frozen=True)
class EarlyStop:
    """Why a job stops early: its best round and score, and the scored rounds after it that did no better."""

    best_round: int
    best: float
    since: int
    basis: str
    metric: str = "accuracy"

    def reason(self) -> str:
        """The job's event message."""
        return (f"stopped early: no better {self.basis} {self.metric} in {self.since} evaluated round(s) after round "
                f"{self.best_round} ({self.best:.4f}; evaluation.patience)")


def early_stop(rounds: Sequence[Scored], patience: int, *, task: TaskConfig | None = None,
               score: str = "") -> EarlyStop | None:
    """An `EarlyStop` once `patience` (> 0) scored rounds followed the best one without a better score (the job's
    `evaluation.score`, else the task's headline: higher, or lower for an error or the loss); `rounds` are those
    whose score is final (every site asked answered, or its deadline passed)."""
    if patience <= 0:
        return None
    task = task or TaskConfig()
    name, higher = headline(task, score)
    found = best_round(rounds, higher_is_better=higher)
    if found is None:
        return None
    best, accuracy, basis = found
    since = sum(1 for r, _ in scores_used(rounds)[1] if r > best)
    return EarlyStop(best, accuracy, since, basis, name) if since >= patience else None


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
