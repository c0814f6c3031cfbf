"""What `aggregation.secure_group_size` needs (secure and robust together, by groups: fedbroker.secagg.groups).

A grouped job's robust rule sees G = ⌊n/g⌋ group means, each the secure sum of at least g sites over its
weight share; it never sees one site's update. Only the rules that are a robust *centre* of a few inputs with
a stated breakdown point make sense there:

- median, trimmed_mean, geometric_median: coordinate-wise or spatial centres; f bad groups out of G are
  outvoted while f < G/2 (trimmed mean: while f ≤ ⌈βG⌉);
- centered_clipping, bucketing (when the catalogue has them): robust centres of the same kind.

Refused, and why:

- multi_krum: it scores each input by its distance to its n − f − 2 nearest others and keeps the m best whole
  inputs; over G group means it needs G ≥ 2f + 3 and would discard whole groups of honest sites on a
  distance measured between just a handful of points;
- fltrust: its trust is one site's direction against the service's root update (Cao et al., NDSS 2021); a
  group mean dilutes an attacker's direction by g − 1 honest ones, so the score no longer isolates it;
- norm_bound: it bounds each input's norm, not a centre; it has no breakdown point over group means.
"""

from __future__ import annotations

from fedbroker.errors import ConfigError
from fedbroker.job.spec import AggregationConfig, ScheduleConfig
from fedbroker.secagg.groups import MIN_GROUP_SIZE, MIN_GROUPS

GROUP_RULES = ("median", "trimmed_mean", "geometric_median", "centered_clipping", "bucketing")
FIELD = "aggregation.secure_group_size"


def group_problems(aggregation: AggregationConfig, schedule: ScheduleConfig | None) -> list[ConfigError]:
    """Every problem of a grouped job's settings at once (none when secure_group_size is 0)."""
    g = aggregation.secure_group_size
    if not g:
        return []
    out = []
    if g < MIN_GROUP_SIZE:
        out.append(ConfigError(FIELD, f"is {g}, below {MIN_GROUP_SIZE}: the service learns each group's sum, so "
                                      f"a group's other members with the service learn a site's update from fewer "
                                      f"colluders"))
    if not aggregation.secure:
        out.append(ConfigError(FIELD, "needs aggregation.secure: true (it sizes the secure sums' groups)"))
    if aggregation.robust not in GROUP_RULES:
        out.append(ConfigError(FIELD, f"needs a robust rule that is a centre of the group means "
                                      f"({', '.join(GROUP_RULES)}), got aggregation.robust "
                                      f"{aggregation.robust!r}; docs/privacy.md says why the others are refused"))
    if schedule is None or g < MIN_GROUP_SIZE:
        return out
    least = MIN_GROUPS * g
    if schedule.min_workers < least:
        out.append(ConfigError("schedule.min_workers", f"is {schedule.min_workers}; groups of {g} need at least "
                                                       f"{least} sites ({MIN_GROUPS} groups: a robust rule over "
                                                       f"fewer group means is their mean)"))
    if 0 < schedule.clients_per_round < least:
        out.append(ConfigError("schedule.clients_per_round", f"is {schedule.clients_per_round}; groups of {g} "
                                                             f"need at least {least} per round"))
    return out
