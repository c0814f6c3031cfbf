"""FedAvg weights (sample counts) and plain uniform weights."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fedbroker.aggregators.weighting.base import (
    WEIGHTING,
    UpdateMeta,
    check_max_share,
    checked_num_samples,
    normalise_weights,
)


@WEIGHTING.register("fedavg")
@dataclass(frozen=True, kw_only=True)
class FedAvgWeighting:
    """α_k = n_k / n (McMahan et al.); with `max_share` < 1 no α_k exceeds it (robust to a worker that
    inflates its sample count up to what it registered)."""

    max_share: float = 1.0

    def __post_init__(self) -> None:
        check_max_share(self.max_share)

    @property
    def proportional(self) -> bool:
        return self.max_share >= 1.0

    def raw_weight(self, meta: UpdateMeta) -> float:
        return float(checked_num_samples(meta))

    def normalise(self, raw: np.ndarray) -> tuple[np.ndarray, bool]:
        return normalise_weights(raw, max_share=float(self.max_share))


@WEIGHTING.register("uniform")
@dataclass(frozen=True, kw_only=True)
class UniformWeighting:
    """α_k = 1/K; the count is still checked so an inconsistent update is rejected the same way."""

    @property
    def proportional(self) -> bool:
        return True

    def raw_weight(self, meta: UpdateMeta) -> float:
        checked_num_samples(meta)
        return 1.0

    def normalise(self, raw: np.ndarray) -> tuple[np.ndarray, bool]:
        return normalise_weights(raw)
