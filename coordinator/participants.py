"""Which registered workers take part in a round: a pure, seeded choice shared by the scheduler and the simulator.

The same (ids, k, seed, round) gives the same participants on every machine, so a research simulation
and the running service sample identical rounds from one job seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def sample_participants(worker_ids: Sequence[str], k: int, *, seed: int, round_number: int) -> list[str]:
    """k distinct ids, sorted; every id (sorted) when k is 0 or at least the number of workers.

    The ids are sorted before drawing so the choice does not depend on the order a registry lists them in.
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
        raise ValueError(f"k must be an integer >= 0, got {k!r}")
    ids = sorted(worker_ids)
    if len(set(ids)) != len(ids):
        raise ValueError("worker_ids must be distinct")
    if k == 0 or k >= len(ids):
        return ids
    rng = np.random.default_rng([seed, round_number, 1])
    return sorted(str(w) for w in rng.choice(ids, size=int(k), replace=False).tolist())
