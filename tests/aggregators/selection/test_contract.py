"""Every registered selection obeys the same contract; the registry turns bad configs into ConfigError."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.selection import SELECTION, Candidate, Selection, SelectionInput
from fedbroker.errors import ConfigError
from tests.source_roots import PYTHONPATH, ROOT

# the parameters each algorithm needs; a new registration must add itself here
PARAMS: dict[str, dict[str, Any]] = {"all": {}, "random": {"m": 3}, "ga": {"m": 3, "population": 20, "generations": 5,
                                                                                 "fitness": "reported_loss"}}
EXPECTED_SIZE = {"all": 7, "random": 3, "ga": 3}


def candidates(n: int = 7, dim: int = 5) -> list[Candidate]:
    rng = np.random.default_rng(123)
    return [
        Candidate(worker_id=f"w{i}", vector=rng.normal(size=dim), num_samples=i + 1, reported_loss=float(i) / 3)
        for i in range(n)
    ]


def choose(name: str, cands: list[Candidate], round_index: int, seed: int = 0) -> Selection:
    algo = SELECTION.create(name, PARAMS[name])
    return algo.choose(SelectionInput(candidates=cands, round_index=round_index, global_vector=np.ones(5), rng=np.random.default_rng(seed)))


def test_every_registered_selection_has_contract_parameters() -> None:
    assert set(SELECTION.names()) == set(PARAMS)


@pytest.mark.parametrize("round_index", [1, 10])
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_selection_returns_distinct_known_ids_in_candidate_order(name: str, round_index: int) -> None:
    cands = candidates()
    selection = choose(name, cands, round_index)
    ids = [c.worker_id for c in cands]
    assert len(selection.chosen) == EXPECTED_SIZE[name]
    assert len(set(selection.chosen)) == len(selection.chosen)
    assert selection.chosen == [i for i in ids if i in selection.chosen]
    assert selection.stats["fallback"] == 0 and selection.reason == ""
    assert all(isinstance(v, float) for v in selection.stats.values())


@pytest.mark.parametrize("round_index", [1, 10])
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_selection_is_reproducible_for_a_seed(name: str, round_index: int) -> None:
    cands = candidates(n=12)
    assert choose(name, cands, round_index, seed=4).chosen == choose(name, cands, round_index, seed=4).chosen


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_fewer_candidates_than_m_chooses_them_all(name: str) -> None:
    cands = candidates(n=2)
    assert choose(name, cands, 10).chosen == ["w0", "w1"]


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_inconsistent_candidates_are_rejected(name: str) -> None:
    cands = candidates()
    with pytest.raises(ValueError, match="w1"):
        choose(name, [*cands, cands[1]], 10)
    with pytest.raises(ValueError, match="neg"):
        choose(name, [*cands, Candidate(worker_id="neg", vector=np.ones(5), num_samples=-2)], 10)
    with pytest.raises(ValueError, match="at least one"):
        choose(name, [], 10)
    with pytest.raises(ValueError, match="round_index"):
        choose(name, cands, 0)


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_needs_vectors_is_true_exactly_when_the_vectors_are_read(name: str) -> None:
    algo = SELECTION.create(name, PARAMS[name])
    cands = [Candidate(worker_id=c.worker_id, vector=np.empty(0), num_samples=c.num_samples) for c in candidates()]
    for round_index in (1, 10):
        if not algo.needs_vectors(round_index):  # placeholders must then be fine
            algo.choose(SelectionInput(candidates=cands, round_index=round_index, global_vector=np.ones(5), rng=np.random.default_rng(0)))


def test_unknown_selection_is_a_config_error_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="random"):
        SELECTION.create("greedy", {})


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("random", {}, "m"),
        ("random", {"m": 0}, "m"),
        ("random", {"m": 2.5}, "m"),
        ("ga", {"m": 3, "population": 1}, "population"),
        ("ga", {"m": 3, "survival": 1.0}, "survival"),
        ("ga", {"m": 3, "mutation_rate": 1.5}, "mutation_rate"),
        ("ga", {"m": 3, "generations": 0}, "generations"),
        ("ga", {"m": 3, "mu": -0.1}, "mu"),
        ("ga", {"m": 3, "ga_gap": 0}, "ga_gap"),
        ("ga", {"m": 3, "fitness": "test_set"}, "fitness"),
        ("ga", {"m": 3}, "probe_dataset"),  # the default fitness needs a probe set
        ("ga", {"m": 3, "probe_dataset": "cifar10"}, "probe_dataset"),
        ("ga", {"m": 3, "fitness": "reported_loss", "probe_dataset": "digits"}, "probe_dataset"),
        ("ga", {"m": 3, "probe_dataset": "digits", "probe_size": 0}, "probe_size"),
        ("ga", {"m": 3, "probe_dataset": "digits", "probe_seed": -1}, "probe_seed"),
        ("ga", {"m": True}, "m"),
        ("ga", {"m": 3, "crossover_rate": 1}, "crossover_rate"),
        ("all", {"m": 3}, "m"),
    ],
)
def test_bad_selection_parameters_are_config_errors_naming_them(name: str, params: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        SELECTION.create(name, params)


def test_selection_imports_no_transport_or_framework() -> None:
    banned = ("grpc", "pika", "torch", "prometheus_client")
    code = f"import sys, fedbroker.aggregators.selection; print([m for m in {banned!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": PYTHONPATH})
    assert out.stdout.strip() == "[]"
