"""FedAvg weights (sample counts) and plain uniform weights."""

from __future__ import annotations

import numpy as np

from fedbroker.aggregators.weighting.base import WEIGHTING, UpdateMeta, checked_num_samples, normalise_weights
from fedbroker.algorithms.params import FedAvgParams, UniformParams


@WEIGHTING.register("fedavg")
class FedAvgWeighting(FedAvgParams):
    """α_k = n_k / n (McMahan et al.); with `max_share` < 1 no α_k exceeds it (robust to a worker that
    inflates its sample count up to what it registered)."""

    def raw_weight(self, meta: UpdateMeta) -> float:
        """n_k, checked."""
        return float(checked_num_samples(meta))

    def normalise(self, raw: np.ndarray) -> tuple[np.ndarray, bool]:
        """n_k / n, capped at `max_share`."""
        return normalise_weights(raw, max_share=float(self.max_share))


@WEIGHTING.register("uniform")
class UniformWeighting(UniformParams):
    """α_k = 1/K; the count is still checked so an inconsistent update is rejected the same way."""

    def raw_weight(self, meta: UpdateMeta) -> float:
        """1, once n_k is checked."""
        checked_num_samples(meta)
        return 1.0

    def normalise(self, raw: np.ndarray) -> tuple[np.ndarray, bool]:
        """1/K."""
        return normalise_weights(raw)
