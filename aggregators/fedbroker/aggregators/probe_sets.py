"""The probe sets the aggregation service holds for the GA's `fitness: probe` (docs/algorithms.md, `ga`).

A probe set stands for public or synthetic data on the aggregation side; it is never a worker's. The
service can load the data sets bundled with scikit-learn (`fedbroker.job.spec.EVALUATION_SETS`) and draws
the probe from the part a worker leaves out of training by default (its held-out split:
`test_fraction` 0.2, `split_seed` 0), so in the demo no probe sample is in any worker's training data.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

# The workers' default held-out split (fedbroker.config's worker test_fraction and split_seed).
HELD_OUT_FRACTION = 0.2
HELD_OUT_SEED = 0


@lru_cache(maxsize=8)
def probe_arrays(dataset: str, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of `size` samples (fewer if the held-out split is smaller) drawn with `seed`; read-only."""
    from fedbroker.datasets import load_dataset, train_test_split  # sklearn only when a probe is needed

    held_out = train_test_split(load_dataset(dataset), test_fraction=HELD_OUT_FRACTION, seed=HELD_OUT_SEED)[1]
    picked = np.sort(np.random.default_rng(seed).permutation(len(held_out))[:size])
    x, y = held_out.x[picked], held_out.y[picked]
    x.flags.writeable = False
    y.flags.writeable = False
    return x, y
