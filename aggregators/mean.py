"""Weighted means of model updates: the incremental one keeps one float64 accumulator per tensor."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np


class RunningWeightedMean:
    """Σ w_k·x_k and Σ w_k, one update at a time: memory O(model), independent of the number of workers."""

    def __init__(self) -> None:
        self._sums: dict[str, np.ndarray] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, tensors: Mapping[str, np.ndarray], weight: float) -> None:
        if not self._sums:
            self._sums = {name: np.zeros(arr.shape, dtype=np.float64) for name, arr in tensors.items()}
        for name, arr in tensors.items():
            acc = self._sums[name]
            if weight == 1.0:
                np.add(acc, arr, out=acc)
            else:
                acc += np.multiply(arr, weight, dtype=np.float64)
        self.total_weight += weight
        self.count += 1

    def result(self, dtype: np.dtype = np.dtype(np.float32)) -> dict[str, np.ndarray]:
        if self.count == 0 or self.total_weight <= 0:
            raise ValueError("no positively weighted update to average")
        return {name: (acc / self.total_weight).astype(dtype) for name, acc in self._sums.items()}


def weighted_mean(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> dict[str, np.ndarray]:
    """The same mean over updates held in memory (selection and alignment need them all)."""
    mean = RunningWeightedMean()
    for update, weight in zip(updates, weights):
        mean.add(update, float(weight))
    return mean.result()
