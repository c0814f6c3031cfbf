"""The Bayesian matching engine: score and KL matrices by hand and by a literal loop, width properties."""

from __future__ import annotations

from dataclasses import replace
from math import log

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

from fedbroker.aggregators.alignment import (
    Layer,
    MatchingParams,
    apply_permutations,
    assignment_cost,
    match_layer,
    match_neurons,
)
from fedbroker.aggregators.alignment.matching import new_slot_count

UNIT = MatchingParams(sigma2=1.0, sigma0_2=1.0, gamma0=1.0, popularity_coef=1.0, count_clip=10)

# Two global neurons in R²: neuron 1 holds one local neuron (1, 0); neuron 2 holds two copies of (0, 1).
# With σ² = σ0² = 1 and μ0 = 0: G1 = (1, 0), S1 = (2, 2), c1 = 1; G2 = (0, 2), S2 = (3, 3), c2 = 2; J = 3.
STATE = dict(
    natural_mean=np.array([[1.0, 0.0], [0.0, 2.0]]),
    precision=np.array([[2.0, 2.0], [3.0, 3.0]]),
    counts=np.array([1, 2]),
    prior_mean=np.zeros(2),
    prior_precision=np.ones(2),
    n_clients=3,
)
LOCAL = np.array([[1.0, 0.0], [0.0, 1.0]])


def test_hand_computed_pfnm_score_matrix_on_a_two_neuron_state() -> None:
    cost = assignment_cost(LOCAL, np.ones(2), params=UNIT, **STATE)
    # score(j, i) = Σ (G_i + x_j)²/(S_i + 1) − Σ G_i²/S_i + log(c_i / (3 − c_i))
    s11 = 2**2 / 3 - 1 / 2 + log(1 / 2)
    s12 = (1 / 4 + 2**2 / 4) - 2**2 / 3 + log(2 / 1)
    s21 = (1 / 3 + 1 / 3) - 1 / 2 + log(1 / 2)
    s22 = 3**2 / 4 - 2**2 / 3 + log(2 / 1)
    # new slot k: Σ x²/(1 + 1) − 2 log k + 2 log(1/3); two slots (each local neuron may start one)
    new = [1 / 2 - 2 * log(k) + 2 * log(1 / 3) for k in (1, 2)]
    expected = -np.array([[s11, s12, *new], [s21, s22, *new]])
    np.testing.assert_allclose(cost, expected, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(cost[0, :2], [-0.14018615277338, -0.60981384722662], atol=1e-12)


def test_hand_computed_exact_kl_cost_on_a_two_neuron_state() -> None:
    lam = 0.5
    pfnm = assignment_cost(LOCAL, np.ones(2), params=UNIT, **STATE)
    nafi = assignment_cost(LOCAL, np.ones(2), params=MatchingParams(lam=lam, kl_mode="exact"), **STATE)

    def kl(g: tuple[float, ...], s: tuple[float, ...], x: tuple[float, ...]) -> float:
        # Lemma 5.1, diagonal: ½ Σ_d [S_y/S_x − 1 + (μ_y − μ_x)² S_y + ln(S_x/S_y)] with S_y = S_x + 1
        return 0.5 * sum((sd + 1) / sd - 1 + ((gd + xd) / (sd + 1) - gd / sd) ** 2 * (sd + 1) + log(sd / (sd + 1)) for gd, sd, xd in zip(g, s, x))

    g1, s1, g2, s2 = (1.0, 0.0), (2.0, 2.0), (0.0, 2.0), (3.0, 3.0)
    new = [kl((0.0, 0.0), (1.0, 1.0), tuple(x)) for x in LOCAL]
    expected = np.array(
        [
            [kl(g1, s1, (1, 0)), kl(g2, s2, (1, 0)), new[0], new[0]],
            [kl(g1, s1, (0, 1)), kl(g2, s2, (0, 1)), new[1], new[1]],
        ]
    )
    np.testing.assert_allclose(nafi - pfnm, lam * expected, rtol=1e-12, atol=1e-13)
    # first entry by hand: ½[(½ − ln 1.5 + 3·(2/3 − 1/2)²) + (½ − ln 1.5)]
    assert expected[0, 0] == pytest.approx(0.5 * (1 - 2 * log(1.5) + 3 / 36), abs=1e-14)


def _literal_cost(w, tau, g, s, c, mu0, tau0, n_clients, p: MatchingParams) -> np.ndarray:
    """docs/algorithms.md (`pfnm`, `nafi`) and Lemma 5.1 / the NAFI code, written entry by entry."""
    m0 = mu0 * tau0
    n_local, n_global = w.shape[0], g.shape[0]
    n_new = new_slot_count(n_local, n_global, p.max_global_width)
    out = np.zeros((n_local, n_global + n_new))
    for j in range(n_local):
        x = w[j] * tau
        for i in range(n_global):
            ct = min(c[i], p.count_clip)
            score = np.sum((g[i] + x) ** 2 / (s[i] + tau)) - np.sum(g[i] ** 2 / s[i]) + p.popularity_coef * log(ct / (n_clients - ct))
            out[j, i] = -score + p.lam * _literal_kl(x, tau, g[i], s[i], c[i], m0, tau0, p, new=False)
        for k in range(1, n_new + 1):
            score = np.sum((m0 + x) ** 2 / (tau0 + tau)) - np.sum(m0**2 / tau0) - 2 * log(k) + 2 * log(p.gamma0 / n_clients)
            out[j, n_global + k - 1] = -score + p.lam * _literal_kl(x, tau, m0, tau0, 0, m0, tau0, p, new=True)
    return out


def _literal_kl(x, tau, g, s, count, m0, tau0, p: MatchingParams, *, new: bool) -> float:
    if p.lam == 0:
        return 0.0
    total = 0.0
    if p.kl_mode == "exact":
        for xd, td, gd, sd in zip(x, tau, g, s):
            mu_x, mu_y, s_y = gd / sd, (gd + xd) / (sd + td), sd + td
            total += 0.5 * (s_y / sd - 1 + (mu_y - mu_x) ** 2 * s_y + log(sd / s_y))
        return total
    const = sum(td / t0 - 1 - log(td / t0) for td, t0 in zip(tau, tau0) if td > 0)
    shift = sum(((gd + xd) / (sd + td) - gd / sd) ** 2 / (sd + td) for xd, td, gd, sd in zip(x, tau, g, s))
    if new:
        return shift + sum(td * (xd - md) ** 2 / (t0 + td) ** 2 for xd, td, md, t0 in zip(x, tau, m0, tau0)) + const
    ct = min(count, p.kl_count_clip)  # the KL term's own clip (the base cost uses count_clip)
    h = g - count * m0
    first = sum(td * (xd - md + hd) ** 2 / (td + sd) ** 2 for xd, td, md, hd, sd in zip(x, tau, m0, h, s))
    second = sum(td * hd**2 / sd**2 for td, hd, sd in zip(tau, h, s))
    return shift + (ct + 1) * first - ct * second + const


@settings(max_examples=40, deadline=None)
@given(
    n_local=st.integers(1, 5),
    n_global=st.integers(0, 5),
    dim=st.integers(1, 4),
    n_clients=st.integers(2, 14),
    lam=st.sampled_from([0.0, 0.3]),
    kl_mode=st.sampled_from(["exact", "reference"]),
    popularity_coef=st.sampled_from([1.0, 2.0]),
    cap=st.integers(1, 9),
    kl_count_clip=st.sampled_from([2, 5, 100]),
    seed=st.integers(0, 2**32 - 1),
)
def test_vectorised_cost_equals_the_formulas_written_entry_by_entry(
    n_local, n_global, dim, n_clients, lam, kl_mode, popularity_coef, cap, kl_count_clip, seed
) -> None:
    rng = np.random.default_rng(seed)
    p = MatchingParams(
        sigma2=0.7, sigma0_2=1.3, gamma0=0.8, popularity_coef=popularity_coef, count_clip=3,
        max_global_width=cap, lam=lam, kl_mode=kl_mode, kl_count_clip=kl_count_clip,
    )
    tau = rng.uniform(0.2, 2.0, size=dim)
    tau[rng.random(dim) < 0.25] = 0.0  # a class the client never saw carries no precision
    tau0 = np.full(dim, 1 / 1.3)
    mu0 = rng.normal(size=dim) * 0.1
    counts = rng.integers(1, n_clients, size=n_global)
    s = tau0 + counts[:, None] * rng.uniform(0.2, 2.0, size=(n_global, dim))
    g = mu0 * tau0 + rng.normal(size=(n_global, dim)) * s
    w = rng.normal(size=(n_local, dim))
    got = assignment_cost(
        w, tau, natural_mean=g, precision=s, counts=counts, prior_mean=mu0, prior_precision=tau0, n_clients=n_clients, params=p
    )
    np.testing.assert_allclose(got, _literal_cost(w, tau, g, s, counts, mu0, tau0, n_clients, p), rtol=1e-9, atol=1e-9)


def test_new_slots_stop_at_the_width_cap_but_always_fit_every_local_neuron() -> None:
    assert new_slot_count(4, 3, 700) == 4
    assert new_slot_count(4, 3, 5) == 2
    assert new_slot_count(4, 3, 3) == 1  # one neuron must start a global neuron: only 3 exist
    assert new_slot_count(5, 3, 3) == 2  # every local neuron must find a place


def test_past_the_width_cap_one_new_slot_is_still_offered_as_in_the_reference_code() -> None:
    """The public PFNM code offers max(cap − L, 1) new slots: at or past the cap, one."""
    assert new_slot_count(2, 3, 3) == 1
    assert new_slot_count(2, 9, 3) == 1
    # a state already at the cap: a local neuron far from both global neurons still starts its own
    far = np.array([[40.0, -40.0], [1.0, 0.0]])
    cost = assignment_cost(far, np.ones(2), params=MatchingParams(max_global_width=2), **STATE)
    assert cost.shape == (2, 3)
    rows, cols = linear_sum_assignment(cost)
    assert cols[list(rows).index(0)] == 2  # the new slot


def test_nafi_reference_kl_term_clips_counts_on_its_own_not_with_the_base_cost() -> None:
    """With 15 clients on a neuron, count_clip (base cost) and kl_count_clip (KL term) act separately:
    the authors' code leaves the base cost unclipped and clips the KL term's counts at 10."""
    state = dict(STATE, counts=np.array([15, 14]), n_clients=17)
    authors = MatchingParams(lam=0.5, kl_mode="reference", count_clip=100_000, kl_count_clip=10)
    base = MatchingParams(count_clip=100_000)
    kl = (assignment_cost(LOCAL, np.ones(2), params=authors, **state)
          - assignment_cost(LOCAL, np.ones(2), params=base, **state)) / 0.5
    clipped_kl = (assignment_cost(LOCAL, np.ones(2), params=replace(authors, kl_count_clip=100_000), **state)
                  - assignment_cost(LOCAL, np.ones(2), params=base, **state)) / 0.5
    assert not np.allclose(kl[:, :2], clipped_kl[:, :2])  # the KL term sees counts 10, not 15 and 14
    np.testing.assert_allclose(kl[:, 2:], clipped_kl[:, 2:])  # a new slot has no count to clip
    # the base cost is untouched by kl_count_clip: λ = 0 gives the same matrix whatever it is
    np.testing.assert_array_equal(
        assignment_cost(LOCAL, np.ones(2), params=replace(base, kl_count_clip=3), **state),
        assignment_cost(LOCAL, np.ones(2), params=base, **state),
    )
    g, s = state["natural_mean"], state["precision"]
    for j, x in enumerate(LOCAL):
        for i in range(2):
            want = _literal_kl(x, np.ones(2), g[i], s[i], state["counts"][i], np.zeros(2), np.ones(2), authors, new=False)
            assert kl[j, i] == pytest.approx(want, rel=1e-12)


@settings(max_examples=30, deadline=None)
@given(
    widths=st.lists(st.integers(1, 8), min_size=1, max_size=5),
    dim=st.integers(1, 5),
    sigma2=st.sampled_from([0.1, 1.0, 5.0]),
    lam=st.sampled_from([0.0, 0.01, 1.0]),
    cap=st.sampled_from([1, 6, 700]),
    seed=st.integers(0, 2**32 - 1),
)
def test_posterior_width_is_never_below_the_largest_clients_width(widths, dim, sigma2, lam, cap, seed) -> None:
    rng = np.random.default_rng(seed)
    vectors = [rng.normal(size=(n, dim)) * 2 for n in widths]
    p = MatchingParams(sigma2=sigma2, lam=lam, max_global_width=cap, iterations=2)
    match = match_neurons(
        vectors, precisions=[np.full(dim, 1 / sigma2)] * len(widths), prior_mean=np.zeros(dim),
        prior_precision=np.ones(dim), params=p, rng=rng,
    )
    assert match.width >= max(widths)
    # past the cap each placement may still open one neuron (the reference code's max(cap − L, 1))
    assert match.width <= max(cap, max(widths)) + len(widths) * (p.iterations + 1)
    for a, n in zip(match.assignments, widths):
        assert a.shape == (n,) and np.unique(a).size == n and a.max() < match.width
    np.testing.assert_array_equal(match.counts, np.bincount(np.concatenate(match.assignments), minlength=match.width))
    assert match.counts.min() >= 1


def test_width_cap_bounds_the_global_layer_to_one_new_neuron_per_placement_past_it() -> None:
    rng = np.random.default_rng(0)
    vectors = [rng.normal(size=(5, 3)) * 100 for _ in range(8)]  # unrelated neurons: PFNM wants many globals
    kwargs = dict(precisions=[np.ones(3)] * 8, prior_mean=np.zeros(3), prior_precision=np.ones(3))
    free = match_neurons(vectors, params=MatchingParams(iterations=0), rng=np.random.default_rng(1), **kwargs)
    capped = match_neurons(vectors, params=MatchingParams(max_global_width=5, iterations=0),
                           rng=np.random.default_rng(1), **kwargs)
    assert free.width > 5 + 1
    # the first client fills the cap; each of the 7 others may open one neuron past it, no more
    assert 5 < capped.width <= 5 + 7
    assert capped.width < free.width


def test_single_layer_matching_recovers_permuted_copies_shrunk_by_the_prior() -> None:
    rng = np.random.default_rng(3)
    w, b = rng.normal(size=(6, 4)) * 3, rng.normal(size=6)
    base = [Layer(w, b), Layer(rng.normal(size=(2, 6)), None)]
    perms = [np.arange(6), rng.permutation(6), rng.permutation(6)]
    layers = [apply_permutations(base, [p])[0] for p in perms]
    p = MatchingParams(sigma2=0.5, sigma0_2=2.0, bias_prior_mean=0.1)
    glob, match = match_layer(layers, params=p, rng=np.random.default_rng(0))
    tau, tau0 = 1 / 0.5, 1 / 2.0
    np.testing.assert_allclose(glob.weight, 3 * tau * w / (tau0 + 3 * tau), rtol=1e-12)
    np.testing.assert_allclose(glob.bias, (0.1 * tau0 + 3 * tau * b) / (tau0 + 3 * tau), rtol=1e-12)
    for a, perm in zip(match.assignments, perms):
        np.testing.assert_array_equal(a, np.argsort(perm))


@pytest.mark.parametrize(
    ("params", "name"),
    [
        ({"sigma2": 0.0}, "sigma2"),
        ({"sigma0_2": -1.0}, "sigma0_2"),
        ({"gamma0": 0}, "gamma0"),
        ({"iterations": -1}, "iterations"),
        ({"iterations": 1.5}, "iterations"),
        ({"count_clip": 0}, "count_clip"),
        ({"max_global_width": 0}, "max_global_width"),
        ({"lam": -0.1}, "lam"),
        ({"kl_mode": "approx"}, "kl_mode"),
        ({"bias_prior_mean": float("nan")}, "bias_prior_mean"),
    ],
)
def test_invalid_matching_parameters_are_rejected_naming_the_parameter(params: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        MatchingParams(**params)
