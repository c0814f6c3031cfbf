"""A grouped secure round (aggregation.secure_group_size): one SecAgg+ session per group, a robust rule over
the group means at the close.

The round's participants are split by `fedbroker.secagg.groups.split` (the round's public seed over the
sorted participants), and each group runs today's `SecureSession` unchanged: its own masking graph, shares,
threshold and ring, sized for the group. A worker talks only to its group's session (`of`), so its roster,
its inbox and its masks are its group's. At the close every group is decided first (its survivors named, so
all groups unmask at once), then finished one by one: a group's sum divided by its survivors' weight share
is that group's weighted mean delta. A group that cannot be unmasked (below its threshold, a proven cheat
that leaves too few) fails alone and is named; the round closes over the remaining group means when at
least `MIN_GROUPS` remain (a robust rule over fewer is their mean), and fails by name otherwise.

What the service learns: each surviving group's sum, never one site's update. A poisoning site moves only
its group's mean, which the robust rule then weighs against the other groups'.

The secure metrics (`fedbroker.aggregators.metrics`) count each group as one secure round: its outcome, its
dropped workers per step; the close's stats give the round's groups, closed and failed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from fedbroker.aggregators.mean import Layout
from fedbroker.aggregators.robust import RobustInput, RobustResult, RobustRule
from fedbroker.aggregators.secure_session import SecureSession, refused
from fedbroker.close_report import SelectionRecord, Verdict
from fedbroker.errors import UploadRejected
from fedbroker.job.spec import ModelSpec, parameter_shapes
from fedbroker.secagg.groups import MIN_GROUPS, split
from fedbroker.secagg.secure_round import round_seed

log = logging.getLogger(__name__)


class GroupedSession:
    """The sessions of one grouped secure round, one per group, routed by worker (see the module docstring)."""

    def __init__(self, *, job_id: str, round_number: int, version: int, participants: frozenset[str], length: int,
                 opened: float, deadline: float, clock: Callable[[], float], group_size: int) -> None:
        """Split the participants; with fewer than MIN_GROUPS groups the round is failed from the start."""
        self.where = f"secure round {round_number} of job {job_id!r}"
        self.participants, self.length, self.group_size = participants, length, group_size
        self.seed = round_seed(job_id, round_number, version)
        self.failed: str | None = None
        count = len(participants) // group_size if group_size > 0 else 0
        self.groups = split(participants, group_size, self.seed) if count >= MIN_GROUPS else []
        if not self.groups:
            self.failed = (f"{self.where} failed: {len(participants)} participant(s) make {count} group(s) of at "
                           f"least {group_size}; a robust rule over the group means needs {MIN_GROUPS}")
        self.sessions: list[SecureSession] = []
        for index, members in enumerate(self.groups):
            session = SecureSession(job_id=job_id, round_number=round_number, version=version,
                                    participants=frozenset(members), length=length, opened=opened,
                                    deadline=deadline, clock=clock)
            session.where = f"{self.where}, group {index + 1} of {len(self.groups)}"
            self.sessions.append(session)
        self._by_worker = {w: s for s, members in zip(self.sessions, self.groups) for w in members}

    def of(self, worker_id: str) -> SecureSession:
        """The worker's group's session; refused when the round failed at its split or the worker is in none."""
        if self.failed is not None:
            raise refused(self.failed)
        session = self._by_worker.get(worker_id)
        if session is None:
            raise refused(f"{self.where}: worker {worker_id!r} is in none of its groups")
        return session

    def end(self, why: str) -> None:
        """The round ended without a close: every group's waiting workers are answered at once."""
        if self.failed is None:
            self.failed = f"{self.where} ended: {why}"
        for session in self.sessions:
            session.end(why)


@dataclass(frozen=True)
class GroupedClose:
    """What a grouped close made (the round book's `Combined`, less the spec, which it keeps)."""

    chosen: list[str]            # the surviving workers of the groups the rule kept
    weights: np.ndarray          # their coefficients: their group's kept weight × their share of the group
    state: dict[str, np.ndarray]
    stats: dict[str, float]
    selection: SelectionRecord
    verdicts: list[Verdict]
    excluded: list[str]


@dataclass(frozen=True)
class GroupMean:
    """One unmasked group: its surviving members, their raw weights and its weighted mean delta."""

    survivors: tuple[str, ...]
    raw: np.ndarray
    mean: np.ndarray
    error_max: float
    dropped: int


def finish_groups(grouped: GroupedSession, *, unmask_s: float) -> tuple[list[GroupMean], dict[str, str]]:
    """Name every group's survivors, then unmask each group's sum: (the groups unmasked, group → why it failed).
    A group's failure is its own; the caller decides whether enough groups remain."""
    if grouped.failed is not None:
        raise refused(grouped.failed)
    failed: dict[str, str] = {}
    for session in grouped.sessions:  # all at once, so every group's survivors send their shares together
        try:
            session.decide()
        except UploadRejected as exc:
            failed[session.where] = str(exc)
    means = []
    for session in grouped.sessions:
        if session.where in failed:
            continue
        try:
            result = session.finish(wait_s=unmask_s)
        except UploadRejected as exc:
            failed[session.where] = str(exc)
            continue
        share = session.scale_sum(result.survivors)
        if share <= 0:
            failed[session.where] = f"{session.where}: the survivors' weights sum to 0"
            continue
        raw = np.array([session.weights[w][1] for w in result.survivors], dtype=np.float64)
        means.append(GroupMean(result.survivors, raw, result.total / share, result.error_max / share,
                               len(result.dropped)))
    for where, why in sorted(failed.items()):
        log.warning("%s failed alone: %s", where, why)
    return means, failed


def combine_grouped(grouped: GroupedSession, *, rule: RobustRule, rule_name: str, selection_method: str,
                    accepted: int, current: Mapping[str, np.ndarray], spec: ModelSpec, unmask_s: float,
                    round_number: int) -> GroupedClose:
    """The next global model: x_global + the robust rule over the surviving groups' mean deltas."""
    means, failed = finish_groups(grouped, unmask_s=unmask_s)
    if len(means) < MIN_GROUPS:
        why = (f"{grouped.where} failed: {len(means)} of {len(grouped.sessions)} group(s) could be unmasked; "
               f"{rule_name} over the group means needs {MIN_GROUPS}: " + "; ".join(failed[w] for w in sorted(failed)))
        grouped.failed = why
        raise refused(why)
    rng = np.random.default_rng([int.from_bytes(grouped.seed[:8], "little"), round_number])
    weights = np.array([g.raw.sum() for g in means])
    result = rule.aggregate(RobustInput(deltas=np.stack([g.mean for g in means]), weights=weights, rng=rng))
    layout = Layout(parameter_shapes(spec))
    state = {name: (np.asarray(current[name], dtype=np.float64) + result.delta[start:stop].reshape(shape))
             .astype(np.float32)
             for (name, shape), (start, stop) in zip(layout.shapes.items(), layout.offsets.values())}
    chosen, coefficients, verdicts = _by_worker(means, result, rule_name)
    excluded = sorted({w for s in grouped.sessions for w in s.excluded})
    stats = {"accepted": float(accepted), "aggregated": float(sum(len(g.survivors) for g in means)),
             "secure_dropped": float(sum(g.dropped for g in means)),
             "secure_error_max": max(g.error_max for g in means),
             "secure_threshold": float(min(s.params.threshold for s in grouped.sessions)),
             "secure_groups": float(len(grouped.sessions)), "secure_groups_closed": float(len(means)),
             "secure_groups_failed": float(len(failed)),
             "robust_discarded": float(result.discarded().sum()),
             "robust_downweighted": float(result.downweighted().sum()),
             **{f"robust_{k}": v for k, v in result.notes.items()}}
    selection = SelectionRecord(method=selection_method, accepted=accepted, chosen=len(chosen))
    return GroupedClose(chosen, coefficients, state, stats, selection, verdicts, excluded)


def _by_worker(means: list[GroupMean], result: RobustResult,
               rule_name: str) -> tuple[list[str], np.ndarray, list[Verdict]]:
    """Each surviving worker's part: its group's kept (and expected) weight times its share of its group; the
    workers of a group the rule discarded are not among the chosen."""
    chosen: list[str] = []
    coefficients: list[float] = []
    verdicts = []
    discarded = result.discarded()
    for group, kept, expected, out in zip(means, result.kept_weight, result.expected, discarded):
        shares = group.raw / group.raw.sum()
        for worker, share in zip(group.survivors, shares):
            verdicts.append(Verdict(worker, rule_name, float(kept * share), float(expected * share)))
            if not out:
                chosen.append(worker)
                coefficients.append(float(kept * share))
    return chosen, np.array(coefficients), verdicts
