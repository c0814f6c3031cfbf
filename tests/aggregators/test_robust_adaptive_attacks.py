"""The attacks built to pass robust rules, against the new ones: ALIE (Baruch, Baruch, Goldberg, NeurIPS 2019)
and inner-product manipulation (Xie, Koyejo, Gupta, UAI 2019) move centered clipping at most the attackers'
share of τ and never turn it against the honest mean, with or without a pre-mix; attackers that send garbage
from the start cannot bend the history check into flagging honest sites."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.robust import ROBUST, RobustInput, RobustMemory

N, F, P = 16, 3, 60   # bucketing of 2 needs f < n/(2s): 3 of 8 buckets at most


def honest_round(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 1.0 + rng.normal(size=(N - F, P)) * 0.5 + rng.normal(size=(N - F, 1)) * 0.3   # heterogeneous sites


def alie(honest: np.ndarray, z: float = 1.0) -> np.ndarray:
    return np.tile(honest.mean(axis=0) - z * honest.std(axis=0), (F, 1))


def ipm(honest: np.ndarray, epsilon: float = 6.0) -> np.ndarray:
    return np.tile(-epsilon * honest.mean(axis=0), (F, 1))


def aggregate(name: str, params: dict[str, Any], deltas: np.ndarray, previous: np.ndarray | None) -> np.ndarray:
    memory = RobustMemory().advanced(previous, keep=1) if previous is not None else None
    return ROBUST.create(name, params).aggregate(RobustInput(
        deltas=deltas, weights=np.full(N, 1 / N), rng=np.random.default_rng(0), memory=memory)).delta


@pytest.mark.parametrize("attack", [alie, ipm])
def test_crafted_updates_move_centered_clipping_at_most_their_share_of_tau(attack: Any) -> None:
    honest = honest_round(1)
    mu = honest.mean(axis=0)
    centre = mu + np.random.default_rng(2).normal(size=P) * 0.05      # last round's aggregate, near the honest mean
    tau = float(np.linalg.norm(honest - centre, axis=1).max())
    deltas = np.vstack([honest, attack(honest)])
    result = aggregate("centered_clipping", {"tau": tau}, deltas, centre)
    assert np.linalg.norm(result - mu) <= F / N * (np.linalg.norm(centre - mu) + tau) * (1 + 1e-9)
    # ALIE sits inside τ, so it moves the result as it moves the mean (no more); IPM is clipped
    assert np.linalg.norm(result - mu) <= np.linalg.norm(deltas.mean(axis=0) - mu) * (1 + 1e-9)


@pytest.mark.parametrize("premix", [{}, {"premix": "nnm"}, {"premix": "bucketing", "bucket_size": 2}])
@pytest.mark.parametrize("attack", [alie, ipm])
@pytest.mark.parametrize("seed", range(3))
def test_behind_a_premix_crafted_updates_stay_within_a_fraction_of_the_honest_spread(
        attack: Any, premix: dict[str, Any], seed: int) -> None:
    honest = honest_round(seed)
    mu = honest.mean(axis=0)
    spread = float(np.sqrt(((honest - mu) ** 2).sum(axis=1).mean()))   # the honest updates' RMS distance to μ_H
    centre = mu + np.random.default_rng(seed + 10).normal(size=P) * 0.05
    result = aggregate("centered_clipping", premix, np.vstack([honest, attack(honest)]), centre)
    # the pre-mix guarantees are relative to the honest spread (ALIE, at the centre, is every honest update's
    # neighbour: nnm cannot remove it, only keep it within the spread)
    assert np.linalg.norm(result - mu) <= 0.5 * spread
    assert float(result @ mu) > 0.0


def test_inner_product_manipulation_turns_the_mean_but_not_centered_clipping_from_zero() -> None:
    honest = honest_round(3)
    mu = honest.mean(axis=0)
    deltas = np.vstack([honest, ipm(honest)])
    assert float(deltas.mean(axis=0) @ mu) < 0.0                       # the attack works on the mean
    for params in ({}, {"premix": "nnm"}):                             # a job's first round: no momentum yet
        assert float(aggregate("centered_clipping", params, deltas, None) @ mu) > 0.0


def test_garbage_from_the_start_cannot_get_honest_sites_flagged() -> None:
    rng = np.random.default_rng(4)
    centres = rng.normal(size=(N, P)) * 3.0
    sites = tuple(f"s{i}" for i in range(N))
    rule = ROBUST.create("history_check", {"inner": "median"})
    w, memory = np.zeros(P), None
    ever: set[str] = set()
    for t in range(10):
        deltas = -0.1 * (w - centres) + 0.02 * rng.normal(size=(N, P))
        deltas[-F:] = rng.normal(size=(F, P)) * 5.0                     # every round something new
        result = rule.aggregate(RobustInput(deltas=deltas, weights=np.full(N, 1 / N), rng=np.random.default_rng(t),
                                            sites=sites, memory=memory))
        assert result.flagged is not None
        ever |= {s for s, f in zip(sites, result.flagged) if f}
        memory, w = result.memory, w + result.delta
    assert ever == set(sites[-F:])
