"""DWFed (Chen et al. 2022): weight each update by its index of statistical heterogeneity (ISH).

Workers compute the ISH from the population distribution sent with the round task and report it with the
update (`fedbroker.label_stats.reported_ish`); the service only normalises (eq. 13) and range-checks what
it cannot recompute.
"""

from __future__ import annotations

import math

import numpy as np

from fedbroker.aggregators.weighting.base import WEIGHTING, UpdateMeta, checked_num_samples, normalise_weights
from fedbroker.algorithms.params import DWFedParams
from fedbroker.label_stats import ish

_TOL = 1e-9
# The smallest ISH each form can produce (D = 2, K = 1); anything below it, or above 1 (D = 0), was not
# computed by eq. 12 and is rejected.
_ISH_FLOOR = {"ratio": (1.0 - 2.0) / 3.0, "one_minus": 1.0 - 2.0 / 3.0}


@WEIGHTING.register("dwfed")
class DWFedWeighting(DWFedParams):
    """α_k = ISH_k / Σ ISH (eq. 13); no data-size factor, so IID workers weigh the same. With `max_share`
    < 1 no α_k exceeds it."""

    def ish_for(self, distance: float, num_aggregated: int) -> float:
        """The ISH a worker should report under this job's form."""
        return ish(distance, num_aggregated, self.ish_form)

    def raw_weight(self, meta: UpdateMeta) -> float:
        """The reported ISH, range-checked; a negative one (only possible for K = 1) weighs 0."""
        checked_num_samples(meta)
        if meta.ish is None:
            raise ValueError(f"worker {meta.worker_id!r}: dwfed needs the ISH the worker reports, got none")
        value = float(meta.ish)
        floor = _ISH_FLOOR[self.ish_form]
        if not math.isfinite(value) or value > 1.0 + _TOL or value < floor - _TOL:
            raise ValueError(
                f"worker {meta.worker_id!r}: ISH {meta.ish!r} is outside [{floor:.6g}, 1], "
                f"the range of the {self.ish_form!r} form"
            )
        return min(max(value, 0.0), 1.0)

    def normalise(self, raw: np.ndarray) -> tuple[np.ndarray, bool]:
        """ISH_k / Σ ISH, capped at `max_share`."""
        return normalise_weights(raw, max_share=float(self.max_share))
