"""The history check on a seeded quadratic problem where the L-BFGS approximation is exact (every site's loss
½h‖w − c_i‖², one local step of size lr: Δ_i(w) = −lr·h·(w − c_i) + noise): a site that switches from honest
to ALIE-like updates is flagged within a few rounds and excluded, heterogeneous honest sites are not, and sites
that join late or skip rounds are predicted from the steps they missed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.robust import ROBUST, RobustInput, RobustMemory, RobustResult
from fedbroker.aggregators.robust.history import LBFGS, two_cluster_upper

N, P, LR, SWITCH = 10, 30, 0.1, 6
Present = Callable[[int, str], bool]


def federation(*, seed: int, rounds: int, attacker: str | None = "s0", present: Present | None = None,
               curvature: np.ndarray | None = None, params: dict[str, Any] | None = None,
               ) -> tuple[dict[str, int], RobustResult]:
    """Rounds of the history check (before the weighted mean); {site: the round it was first flagged}."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(N, P)) * 3.0          # heterogeneous honest sites
    h = np.ones(P) if curvature is None else curvature
    sites = [f"s{i}" for i in range(N)]
    w, memory = np.zeros(P), None
    rule = ROBUST.create("history_check", params or {})
    flagged: dict[str, int] = {}
    result = None
    for t in range(rounds):
        here = [i for i in range(N) if present is None or present(t, sites[i])]
        deltas = np.array([-LR * h * (w - centres[i]) + 0.02 * rng.normal(size=P) for i in here])
        lying = np.array([sites[i] == attacker and t >= SWITCH for i in here])
        if lying.any():  # ALIE (Baruch et al., NeurIPS 2019): the honest mean, one standard deviation off
            honest = deltas[~lying]
            deltas[lying] = honest.mean(axis=0) - honest.std(axis=0)
        result = rule.aggregate(RobustInput(deltas=deltas, weights=np.full(len(here), 1 / len(here)),
                                            rng=np.random.default_rng(t), sites=tuple(sites[i] for i in here),
                                            memory=memory))
        assert result.flagged is not None
        for k, i in enumerate(here):
            if result.flagged[k]:
                flagged.setdefault(sites[i], t)
                assert result.kept_weight[k] == 0.0
        memory, w = result.memory, w + result.delta
    assert result is not None
    return flagged, result


@pytest.mark.parametrize("seed", range(3))
def test_a_site_that_turns_to_alie_is_flagged_within_a_few_rounds_and_honest_ones_are_not(seed: int) -> None:
    flagged, last = federation(seed=seed, rounds=SWITCH + 4)
    assert set(flagged) == {"s0"} and SWITCH <= flagged["s0"] <= SWITCH + 2
    assert last.notes["history_flagged"] == 1.0 and last.memory is not None and last.memory.flagged == {"s0"}
    # it stays excluded: its update has no part in the aggregate
    assert last.kept_weight[0] == 0.0 and last.was_flagged(0)


@pytest.mark.parametrize("seed", range(3))
def test_heterogeneous_honest_sites_with_uneven_curvature_and_partial_rounds_are_not_flagged(seed: int) -> None:
    curvature = np.random.default_rng(seed).uniform(0.2, 3.0, size=P)   # L-BFGS only approximates this one

    def sampled(t: int, site: str) -> bool:
        return bool(np.random.default_rng([seed, t, int(site[1:])]).random() < 0.6)

    assert federation(seed=seed, rounds=25, attacker=None, curvature=curvature, present=sampled)[0] == {}
    assert federation(seed=seed, rounds=25, attacker=None, curvature=curvature)[0] == {}


def test_a_site_that_skips_rounds_while_it_attacks_is_flagged_when_it_comes_back() -> None:
    def every_third_for_s0(t: int, site: str) -> bool:
        return site != "s0" or t % 3 == 0

    # away in rounds 4 and 5, it attacks from round 6 on: its prediction spans the three steps since round 3
    flagged, last = federation(seed=4, rounds=SWITCH + 6, present=every_third_for_s0)
    assert set(flagged) == {"s0"} and flagged["s0"] == SWITCH
    assert last.memory is not None and last.memory.sites["s0"].close == 9 and last.memory.flagged == {"s0"}


def test_a_late_site_is_recorded_first_and_scored_from_its_second_round() -> None:
    def late(t: int, site: str) -> bool:
        return site != "s9" or t >= 4

    _, last = federation(seed=5, rounds=5, attacker=None, present=late)
    assert last.memory is not None
    assert last.memory.sites["s9"].scores == () and last.memory.sites["s9"].close == 4
    _, last = federation(seed=5, rounds=6, attacker=None, present=late)
    assert last.memory is not None and len(last.memory.sites["s9"].scores) == 1


def test_the_l_bfgs_approximation_is_exact_on_an_isotropic_quadratic() -> None:
    rng = np.random.default_rng(6)
    steps = [rng.normal(size=P) for _ in range(4)]
    hessian = LBFGS(tuple((s.astype(np.float32), (2.5 * s).astype(np.float32)) for s in steps))
    v = rng.normal(size=P)
    np.testing.assert_allclose(hessian.times(v), 2.5 * v, rtol=1e-5)
    assert hessian.used == 4
    # a pair against the curvature (noise) is left out; with none left B = 0
    assert LBFGS(((steps[0].astype(np.float32), (-steps[0]).astype(np.float32)),)).used == 0
    np.testing.assert_array_equal(LBFGS(()).times(v), np.zeros(P))


def test_the_two_cluster_split_flags_a_minority_far_above_and_nothing_else() -> None:
    scores = np.array([1.0, 0.9, 1.1, 1.05, 0.95, 4.0, 3.5])
    assert two_cluster_upper(scores, 2.0).tolist() == [False] * 5 + [True, True]
    assert not two_cluster_upper(np.array([1.0, 1.2, 0.9, 1.3, 1.1]), 2.0).any()     # one honest spread
    assert not two_cluster_upper(np.array([1.0, 1.0, 5.0, 5.0]), 2.0).any()          # not a minority
    assert not two_cluster_upper(np.array([1.0, 9.0]), 2.0).any()                    # too few to judge


def test_anonymous_rows_are_not_checked_and_a_memory_of_another_model_size_starts_over() -> None:
    rng = np.random.default_rng(7)
    rule = ROBUST.create("history_check", {"inner": "median"})
    deltas = rng.normal(size=(5, 8))
    plain = ROBUST.create("median", {}).aggregate(RobustInput(deltas=deltas, weights=np.full(5, 0.2), rng=rng))
    result = rule.aggregate(RobustInput(deltas=deltas, weights=np.full(5, 0.2), rng=rng))
    np.testing.assert_allclose(result.delta, plain.delta)
    assert result.notes["history_flagged"] == 0.0
    old = RobustMemory().advanced(np.ones(3), keep=10)
    sites = tuple(f"s{i}" for i in range(5))
    result = rule.aggregate(RobustInput(deltas=deltas, weights=np.full(5, 0.2), rng=rng, sites=sites, memory=old))
    assert result.memory is not None and all(s.shape == (8,) for s in result.memory.steps)
    assert result.notes["history_scored"] == 0.0


def test_an_inner_fltrust_gets_its_root_set_trained_and_its_g0_passed_through() -> None:
    rule = ROBUST.create("history_check", {"inner": "fltrust", "inner_params": {"probe_dataset": "digits"}})
    request = rule.root_request()
    assert request is not None and request.probe.dataset == "digits"
    assert ROBUST.create("history_check", {}).root_request() is None
    deltas = np.random.default_rng(8).normal(size=(4, 6))
    g0 = -deltas[0]                                               # only update 0 points away from g_0
    result = rule.aggregate(RobustInput(deltas=deltas, weights=np.full(4, 0.25), rng=np.random.default_rng(0),
                                        root_update=g0, sites=("a", "b", "c", "d")))
    assert result.kept_weight[0] == 0.0
