"""The random split of a secure round's participants into groups (aggregation.secure_group_size).

A robust rule needs several inputs to outvote a bad one, and secure aggregation gives the service one sum. The
middle way: split the round's sites into groups of at least g, secure-aggregate each group on its own (one
SecAgg+ instance per group), and run the robust rule over the group means. The service then learns each
group's sum, never one site's update; a poisoning site moves only its own group's mean.

Why the split is a hash of public values: no single site may choose its group (to sit next to a victim, or to
gather with its accomplices), and the service should not pick it freely either. The split is therefore fixed
by the round's public seed (`fedbroker.secagg.secure_round.round_seed`: job, round, global version) over the
sorted roster, each site's rank being SHA-256(seed, roster, site). Anyone holding the seed and the roster
computes the same groups (the service at the round's opening; any site that later learns the round's
participants, to audit). A site cannot move itself: its rank depends on the whole roster and on a seed it
does not choose. The trade: the seed is public, so whoever chose the job id and knows the roster before the
round (the coordinator, the service) can predict the split, and could bias it by retrying job ids; it never
picks a member directly. docs/privacy.md ("Secure and robust together: groups") states the trade.

Sizes: G = ⌊n/g⌋ groups; the first G−1 hold g sites, the last the rest (g to 2g−1), so every group has at
least g members. Pure: hashlib and numpy only.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable, Sequence

import numpy as np

from fedbroker.secagg.params import SecAggParams
from fedbroker.secagg.secure_round import round_params

MIN_GROUP_SIZE = 5   # below, a group's sum is close to its members' updates (4 colluders and the server see a 5th)
MIN_GROUPS = 3       # a robust rule over two group means is their mean: one bad group always moves it

_DOMAIN = b"fedbroker secure groups\x00"


def group_sizes(n: int, g: int) -> list[int]:
    """The sizes of the groups n sites make with groups of at least g (the last absorbs the remainder)."""
    if g < 1 or n < g:
        raise ValueError(f"{n} site(s) cannot make a group of at least {g}")
    count = n // g
    return [g] * (count - 1) + [n - g * (count - 1)]


def ranks(roster: Iterable[str], seed: bytes) -> dict[str, bytes]:
    """Each site's rank: SHA-256 of the seed, the whole sorted roster and the site (its place in the split)."""
    ids = sorted(set(roster))
    if not isinstance(seed, bytes) or len(seed) < 16:
        raise ValueError("the split's seed must be at least 16 bytes (the round's public seed)")
    base = hashlib.sha256(_DOMAIN + seed)
    for site in ids:
        base.update(len(site.encode()).to_bytes(4, "big") + site.encode())
    roster_key = base.digest()
    return {site: hashlib.sha256(roster_key + site.encode()).digest() for site in ids}


def split(roster: Iterable[str], g: int, seed: bytes) -> list[tuple[str, ...]]:
    """The round's groups: the roster in the order of its ranks, cut into `group_sizes`, each group sorted.
    Deterministic in (roster as a set, g, seed); a permutation of the roster."""
    ranked = ranks(roster, seed)
    order = sorted(ranked, key=lambda site: (ranked[site], site))
    cuts = np.cumsum([0, *group_sizes(len(order), g)])
    return [tuple(sorted(order[start:stop])) for start, stop in itertools.pairwise(cuts)]


def group_of(groups: Sequence[Sequence[str]], site: str) -> int:
    """The index of the group that holds `site` (a KeyError when none does)."""
    for index, members in enumerate(groups):
        if site in members:
            return index
    raise KeyError(site)


def group_params(n: int, g: int, n_max: int) -> SecAggParams | None:
    """The secure settings of a group of `n_max` in a round of n split by g, when the split makes a group of
    that size (a worker checks the service's settings against these); None when it makes none."""
    try:
        sizes = set(group_sizes(n, g))
    except ValueError:
        return None
    return round_params(n_max) if n_max in sizes else None


def fewest_uploads(n: int, g: int) -> int:
    """The fewest masked uploads a grouped round of n sites can close with: MIN_GROUPS groups, the smallest
    ones, each at its own threshold (the coordinator fails a round below this without asking the service)."""
    thresholds = sorted(round_params(size).threshold for size in group_sizes(n, g))
    return sum(thresholds[:MIN_GROUPS])
