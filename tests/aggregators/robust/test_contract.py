"""Every registered robust rule obeys one contract: the same input gives the same output, shapes are kept, a
unanimous round returns its common update, and an update holding NaN is refused by row, never averaged."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.robust import ROBUST, RobustInput, RobustResult
from fedbroker.algorithms.catalogue import ROBUST_RULES
from fedbroker.algorithms.robust_params import INNER_RULES, HistoryCheckParams
from fedbroker.errors import ConfigError
from tests.source_roots import PYTHONPATH, ROOT

# the parameters each rule needs; a new registration must add itself here
PARAMS: dict[str, dict[str, Any]] = {
    "none": {}, "median": {}, "trimmed_mean": {"beta": 0.2}, "multi_krum": {"f": 1},
    "geometric_median": {}, "norm_bound": {"max_norm": 1e6}, "fltrust": {"probe_dataset": "digits"},
    "centered_clipping": {}, "history_check": {"inner": "median"},
}


def updates(n: int = 7, p: int = 50, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    weights = rng.uniform(1, 5, size=n)
    return rng.normal(size=(n, p)).astype(np.float32), weights / weights.sum()


def run(name: str, deltas: np.ndarray, weights: np.ndarray, seed: int = 0,
        root: np.ndarray | None = None) -> RobustResult:
    rule = ROBUST.create(name, PARAMS[name])
    g0 = root if root is not None else np.asarray(deltas, dtype=np.float64).mean(axis=0)
    sites = tuple(f"site-{i}" for i in range(np.shape(deltas)[0])) if np.shape(weights) == np.shape(deltas)[:1] else ()
    return rule.aggregate(RobustInput(deltas=deltas, weights=weights, rng=np.random.default_rng(seed), root_update=g0,
                                      sites=sites))


def test_every_registered_rule_has_contract_parameters() -> None:
    assert ROBUST.names() == sorted(PARAMS) == ROBUST_RULES.names()
    # a history check runs every other rule on the sites it did not flag, with the catalogue's parameters
    assert {**INNER_RULES, "history_check": HistoryCheckParams} == {
        name: ROBUST_RULES.entry(name).params for name in ROBUST_RULES.names()}


@pytest.mark.parametrize("premix", ["bucketing", "nnm"])
@pytest.mark.parametrize("name", sorted(set(PARAMS) - {"history_check"}))
def test_every_rule_behind_a_premix_keeps_the_contract(name: str, premix: str) -> None:
    params = {**PARAMS[name], "premix": premix, "bucket_size": 2}
    rule = ROBUST.create(name, params)
    for n in (1, 2, 7):
        d, w = updates(n=n, p=21)
        result = rule.aggregate(RobustInput(deltas=d, weights=w, rng=np.random.default_rng(4),
                                            root_update=d.mean(axis=0, dtype=np.float64)))
        again = rule.aggregate(RobustInput(deltas=d, weights=w, rng=np.random.default_rng(4),
                                           root_update=d.mean(axis=0, dtype=np.float64)))
        np.testing.assert_array_equal(result.delta, again.delta)
        assert result.delta.shape == (21,) and result.kept_weight.shape == result.expected.shape == (n,)
        assert np.all(result.kept_weight >= 0) and result.kept_weight.sum() <= 1 + 1e-9
        np.testing.assert_allclose(result.expected.sum(), 1.0)
    point = np.random.default_rng(0).normal(size=40)
    unanimous = rule.aggregate(RobustInput(deltas=np.tile(point, (6, 1)), weights=np.full(6, 1 / 6),
                                           rng=np.random.default_rng(0), root_update=point))
    np.testing.assert_allclose(unanimous.delta, point, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_the_same_seed_gives_the_same_result(name: str) -> None:
    d, w = updates()
    a, b = run(name, d, w, seed=5), run(name, d.copy(), w.copy(), seed=5)
    np.testing.assert_array_equal(a.delta, b.delta)
    np.testing.assert_array_equal(a.kept_weight, b.kept_weight)
    assert a.notes == b.notes


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("n", [1, 2, 5, 12])
def test_shapes_are_kept_and_weights_are_shares(name: str, n: int) -> None:
    d, w = updates(n=n, p=33)
    result = run(name, d, w)
    assert result.delta.shape == (33,) and np.all(np.isfinite(result.delta))
    assert result.kept_weight.shape == result.expected.shape == (n,)
    assert np.all(result.kept_weight >= 0) and result.kept_weight.sum() <= 1 + 1e-9
    np.testing.assert_allclose(result.expected.sum(), 1.0)
    assert all(isinstance(v, float) for v in result.notes.values())


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_a_unanimous_round_returns_its_common_update(name: str) -> None:
    point = np.random.default_rng(0).normal(size=40)
    d = np.tile(point, (6, 1))
    result = run(name, d, np.full(6, 1 / 6), root=point)
    np.testing.assert_allclose(result.delta, point, rtol=1e-6, atol=1e-9)
    # Multi-Krum averages exactly m = n − f of them whatever they are; the others keep every update
    assert result.discarded().sum() == (1 if name == "multi_krum" else 0)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_an_update_holding_nan_is_refused_by_row(name: str) -> None:
    d, w = updates()
    d[4, 7] = np.nan
    with pytest.raises(ValueError, match=r"row\(s\) \[4\].*NaN"):
        run(name, d, w, root=np.ones(d.shape[1]))
    d[4, 7] = np.inf
    with pytest.raises(ValueError, match=r"\[4\]"):
        run(name, d, w, root=np.ones(d.shape[1]))


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_inconsistent_inputs_are_refused_naming_what_is_wrong(name: str) -> None:
    d, w = updates()
    with pytest.raises(ValueError, match="one weight per update"):
        run(name, d, w[:-1])
    with pytest.raises(ValueError, match="at least one update"):
        run(name, d[:0], w[:0], root=np.ones(d.shape[1]))
    with pytest.raises(ValueError, match="weights"):
        run(name, d, -w)


def test_fltrust_refuses_to_run_without_a_root_update_of_the_model_s_size() -> None:
    d, w = updates()
    rule = ROBUST.create("fltrust", PARAMS["fltrust"])
    with pytest.raises(ValueError, match="root update"):
        rule.aggregate(RobustInput(deltas=d, weights=w, rng=np.random.default_rng(0)))
    with pytest.raises(ValueError, match="root update"):
        rule.aggregate(RobustInput(deltas=d, weights=w, rng=np.random.default_rng(0), root_update=np.ones(3)))


@pytest.mark.parametrize(("name", "params", "match"), [
    ("trimmed_mean", {"beta": 0.5}, "beta"), ("trimmed_mean", {"beta": -0.1}, "beta"),
    ("trimmed_mean", {"beta": True}, "beta"), ("multi_krum", {"f": -1}, "f"), ("multi_krum", {"m": 0}, "m"),
    ("multi_krum", {"f": 1.5}, "f"), ("geometric_median", {"nu": 0}, "nu"),
    ("geometric_median", {"iterations": 0}, "iterations"), ("geometric_median", {"tolerance": -1}, "tolerance"),
    ("norm_bound", {}, "max_norm"), ("norm_bound", {"max_norm": 0}, "max_norm"),
    ("norm_bound", {"max_norm": float("inf")}, "max_norm"), ("fltrust", {}, "probe_dataset"),
    ("fltrust", {"probe_dataset": "imagenet"}, "probe_dataset"),
    ("fltrust", {"probe_dataset": "digits", "lr": 0}, "lr"),
    ("fltrust", {"probe_dataset": "digits", "epochs": 0}, "epochs"), ("median", {"beta": 0.1}, "beta"),
    ("median", {"premix": "shuffle"}, "premix"), ("median", {"premix": "bucketing", "bucket_size": 0}, "bucket_size"),
    ("multi_krum", {"premix": "nnm", "nnm_f": -1}, "nnm_f"), ("centered_clipping", {"tau": 0}, "tau"),
    ("centered_clipping", {"iterations": 0}, "iterations"), ("centered_clipping", {"tau_scale": -1}, "tau_scale"),
    ("history_check", {"window": 0}, "window"), ("history_check", {"ratio": 1.0}, "ratio"),
    ("history_check", {"inner": "history_check"}, "inner"), ("history_check", {"inner": "krum"}, "inner"),
    ("history_check", {"inner": "trimmed_mean", "inner_params": {"beta": 0.7}}, "inner"),
    ("history_check", {"premix": "nnm"}, "premix"),
])
def test_bad_rule_parameters_are_config_errors_naming_the_field(name: str, params: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        ROBUST.create(name, params)
    assert "aggregation.robust_params" in str(caught.value)


def test_the_rules_import_no_transport_or_framework() -> None:
    banned = ("grpc", "pika", "torch", "prometheus_client")
    code = f"import sys, fedbroker.aggregators.robust; print([m for m in {banned!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert out.stdout.strip() == "[]"
