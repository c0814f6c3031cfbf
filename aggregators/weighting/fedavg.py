"""FedAvg weights (sample counts) and plain uniform weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedbroker.aggregators.weighting.base import WEIGHTING, UpdateMeta, checked_num_samples, normalise_weights


@WEIGHTING.register("fedavg")
@dataclass(frozen=True, kw_only=True)
class FedAvgWeighting:
    """α_k = n_k / n (McMahan et al.)."""

    def raw_weight(self, meta: UpdateMeta) -> float:
        return float(checked_num_samples(meta))

    def normalise(self, raw: np.ndarray) -> tuple[np.ndarray, bool]:
        return normalise_weights(raw)


@WEIGHTING.register("uniform")
@dataclass(frozen=True, kw_only=True)
class UniformWeighting:
    """α_k = 1/K; the count is still checked so an inconsistent update is rejected the same way."""

    def raw_weight(self, meta: UpdateMeta) -> float:
        checked_num_samples(meta)
        return 1.0

    def normalise(self, raw: np.ndarray) -> tuple[np.ndarray, bool]:
        return normalise_weights(raw)
