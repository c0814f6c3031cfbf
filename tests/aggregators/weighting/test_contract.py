"""Every registered weighting obeys the same contract; the registry turns bad configs into ConfigError."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.weighting import WEIGHTING, UpdateMeta
from fedbroker.errors import ConfigError
from tests.source_roots import PYTHONPATH, ROOT

NAMES = WEIGHTING.names()
METAS = [
    UpdateMeta(worker_id="a", num_samples=10, ish=0.9, loss=0.3),
    UpdateMeta(worker_id="b", num_samples=0, ish=1.0, loss=0.1),
    UpdateMeta(worker_id="c", num_samples=250, ish=0.4, loss=1.2),
]


def test_the_expected_algorithms_are_registered() -> None:
    assert {"fedavg", "uniform", "dwfed"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_raw_weights_are_finite_non_negative_and_depend_only_on_their_own_update(name: str) -> None:
    algo = WEIGHTING.create(name)
    for meta in METAS:
        alone = algo.raw_weight(meta)
        assert math.isfinite(alone) and alone >= 0
        # the same update weighs the same whatever else arrived this round, and in a fresh instance
        assert WEIGHTING.create(name).raw_weight(meta) == alone


@pytest.mark.parametrize("name", NAMES)
def test_normalised_weights_sum_to_one_and_keep_their_shape(name: str) -> None:
    algo = WEIGHTING.create(name)
    raw = np.array([algo.raw_weight(m) for m in METAS])
    weights, fell_back = algo.normalise(raw)
    assert weights.shape == raw.shape
    assert weights.sum() == pytest.approx(1.0)
    assert not fell_back


@pytest.mark.parametrize("name", NAMES)
def test_an_inconsistent_update_is_rejected_naming_the_worker(name: str) -> None:
    algo = WEIGHTING.create(name)
    with pytest.raises(ValueError, match="liar"):
        algo.raw_weight(UpdateMeta(worker_id="liar", num_samples=-1, ish=0.5))


def test_unknown_weighting_is_a_config_error_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="fedavg"):
        WEIGHTING.create("fedmedian")


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [("dwfed", {"ish_form": "square"}, "ish_form"), ("fedavg", {"mu": 1}, "mu"), ("uniform", {"x": 1}, "x")],
)
def test_bad_weighting_parameters_are_config_errors_naming_them(name: str, params: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        WEIGHTING.create(name, params)


def test_weighting_imports_no_transport_or_framework() -> None:
    banned = ("grpc", "pika", "torch", "prometheus_client")
    code = f"import sys, fedbroker.aggregators.weighting; print([m for m in {banned!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert out.stdout.strip() == "[]"
