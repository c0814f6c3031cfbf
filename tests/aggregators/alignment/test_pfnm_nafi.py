"""PFNM and NAFI over whole networks: recovery of permuted copies, λ = 0 ≡ PFNM, layer-wise driver."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.aggregators.alignment import ALIGNMENT, NAFI, PFNM, AlignInput, Layer, apply_permutations
from fedbroker.errors import ConfigError

SIGMA2, SIGMA0_2, MU_B = 0.5, 2.0, 0.1
TAU, TAU0 = 1 / SIGMA2, 1 / SIGMA0_2


def mlp(rng: np.random.Generator, sizes: list[int], scale: float = 2.0) -> list[Layer]:
    return [Layer(scale * rng.normal(size=(o, i)), rng.normal(size=o)) for i, o in itertools.pairwise(sizes)]


def permuted_copies(rng: np.random.Generator, net: list[Layer], n: int) -> tuple[list, list]:
    clients, perms = [], []
    for k in range(n):
        p = [np.arange(layer.weight.shape[0]) if k == 0 else rng.permutation(layer.weight.shape[0]) for layer in net[:-1]]
        clients.append(apply_permutations(net, p))
        perms.append(p)
    return clients, perms


def assert_shrunk_copy(result, net: list[Layer], perms: list, n: int) -> None:
    """Closed form G/S for n identical copies: hidden coordinates (μ0τ0 + nτw)/(τ0 + nτ); the outgoing
    weights into the output layer carry precision share·τ with shares summing to 1 over clients."""

    def hidden(v: np.ndarray, mu: float) -> np.ndarray:
        return (mu * TAU0 + n * TAU * v) / (TAU0 + n * TAU)

    def output(v: np.ndarray, mu: float) -> np.ndarray:
        return (mu * TAU0 + TAU * v) / (TAU0 + TAU)

    assert result.widths == [layer.weight.shape[0] for layer in net]
    for ell, (got, want) in enumerate(zip(result.layers, net)):
        last = ell == len(net) - 1
        np.testing.assert_allclose(got.weight, (output if last else hidden)(want.weight, 0.0), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got.bias, (output if last else hidden)(want.bias, MU_B), rtol=1e-10, atol=1e-12)
    for k in range(n):
        for got, moved in zip(result.permutations[k], perms[k]):
            np.testing.assert_array_equal(got, np.argsort(moved))  # the inverse of the shuffle


def test_pfnm_three_permuted_copies_give_the_original_neurons_shrunk_by_the_prior() -> None:
    rng = np.random.default_rng(0)
    net = mlp(rng, [6, 10, 8, 3])
    clients, perms = permuted_copies(rng, net, 3)
    alg = PFNM(sigma2=SIGMA2, sigma0_2=SIGMA0_2, bias_prior_mean=MU_B)
    result = alg.align(AlignInput(clients=clients, weights=np.array([0.2, 0.3, 0.5]), rng=np.random.default_rng(1)))
    assert_shrunk_copy(result, net, perms, 3)
    assert result.stats["global_neurons_layer_0"] == 10.0


@pytest.mark.parametrize("lam", [1e-3, 0.01, 0.5, 1.0])
@pytest.mark.parametrize("kl_mode", ["exact", "reference"])
def test_nafi_recovers_permuted_copies_for_lambda_up_to_one(lam: float, kl_mode: str) -> None:
    rng = np.random.default_rng(1)
    net = mlp(rng, [6, 10, 8, 3])
    clients, perms = permuted_copies(rng, net, 3)
    alg = NAFI(sigma2=SIGMA2, sigma0_2=SIGMA0_2, bias_prior_mean=MU_B, lam=lam, kl_mode=kl_mode)
    result = alg.align(AlignInput(clients=clients, weights=np.full(3, 1 / 3), rng=np.random.default_rng(2)))
    assert_shrunk_copy(result, net, perms, 3)


def test_pfnm_recovers_permuted_conv_copies_through_conv_and_flatten_blocks() -> None:
    rng = np.random.default_rng(2)
    net = [
        Layer(2 * rng.normal(size=(4, 2, 3, 3)), rng.normal(size=4)),
        Layer(2 * rng.normal(size=(5, 4, 3, 3)), rng.normal(size=5)),
        Layer(2 * rng.normal(size=(3, 5 * 9)), rng.normal(size=3)),
    ]
    clients, perms = permuted_copies(rng, net, 3)
    alg = PFNM(sigma2=SIGMA2, sigma0_2=SIGMA0_2, bias_prior_mean=MU_B)
    result = alg.align(AlignInput(clients=clients, weights=np.full(3, 1 / 3), rng=np.random.default_rng(3), spatial=[None, 9, None]))
    assert_shrunk_copy(result, net, perms, 3)


@settings(max_examples=15, deadline=None)
@given(
    hidden=st.lists(st.lists(st.integers(1, 7), min_size=2, max_size=2), min_size=2, max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_nafi_with_lambda_zero_is_pfnm_exactly(hidden: list[list[int]], seed: int) -> None:
    rng = np.random.default_rng(seed)
    clients = [mlp(rng, [4, h1, h2, 3]) for h1, h2 in hidden]  # unrelated nets of unequal widths
    weights = rng.dirichlet(np.ones(len(clients)))
    shares = rng.dirichlet(np.ones(len(clients)), size=3).T
    a = PFNM().align(AlignInput(clients=clients, weights=weights, rng=np.random.default_rng(seed), class_shares=shares))
    b = NAFI(lam=0.0).align(AlignInput(clients=clients, weights=weights, rng=np.random.default_rng(seed), class_shares=shares))
    assert a.widths == b.widths and a.stats == b.stats
    for x, y in zip(a.layers, b.layers):
        np.testing.assert_array_equal(x.weight, y.weight)
        np.testing.assert_array_equal(x.bias, y.bias)
    for pa, pb in zip(a.permutations, b.permutations):
        for u, v in zip(pa, pb):
            np.testing.assert_array_equal(u, v)
    for ell in range(2):  # posterior width never below the largest client's
        assert a.widths[ell] >= max(h[ell] for h in hidden)


def test_class_shares_decide_whose_output_weights_form_each_class() -> None:
    rng = np.random.default_rng(4)
    net = mlp(rng, [5, 6, 2])
    other = [net[0], Layer(net[1].weight + 1.0, net[1].bias - 1.0)]  # same hidden units, other output layer
    shares = np.array([[1.0, 0.0], [0.0, 1.0]])  # client 0 holds all of class 0, client 1 all of class 1
    result = PFNM().align(AlignInput(clients=[net, other], weights=np.full(2, 0.5), rng=np.random.default_rng(0), class_shares=shares))
    shrink = 1.0 / (1.0 + 1.0)  # τ/(τ0 + τ) with σ² = σ0² = 1: a single client's precision
    np.testing.assert_allclose(result.layers[1].weight[0], shrink * net[1].weight[0], rtol=1e-12)
    np.testing.assert_allclose(result.layers[1].weight[1], shrink * other[1].weight[1], rtol=1e-12)
    np.testing.assert_allclose(result.layers[1].bias, [(0.1 + net[1].bias[0]) / 2, (0.1 + other[1].bias[1]) / 2])


def test_plain_output_weighting_gives_every_clients_output_weights_the_full_precision_and_its_bias_its_class_share(
) -> None:
    """`plain` is the NAFI authors' use_freq=False: the outgoing weights into the output layer carry precision
    1/σ² for every client, while the output bias is still the class-share weighted posterior of their
    process_softmax_bias: b_c = (μ_b/σ0² + Σ_k s_kc·b_kc/σ²) / (1/σ0² + Σ_k s_kc/σ²)."""
    rng = np.random.default_rng(4)
    net = mlp(rng, [5, 6, 2])
    other = [net[0], Layer(net[1].weight + 1.0, net[1].bias - 1.0)]
    shares = np.array([[0.25, 0.6], [0.75, 0.4]])  # client k's share of class c (each class sums to 1)
    plain = PFNM(output_weighting="plain")
    result = plain.align(AlignInput(clients=[net, other], weights=np.full(2, 0.5), rng=np.random.default_rng(0), class_shares=shares))
    # both clients' output rows with precision τ = 1 each and the prior τ0 = 1: (0·1 + w + w')/(1 + 2)
    np.testing.assert_allclose(result.layers[1].weight, (net[1].weight + other[1].weight) / 3, rtol=1e-12)
    biases = np.stack([net[1].bias, other[1].bias])  # (clients, classes)
    np.testing.assert_allclose(result.layers[1].bias, (0.1 + (shares * biases).sum(axis=0)) / (1 + 1), rtol=1e-12)
    # the class shares move the bias, never the weights
    flipped = plain.align(AlignInput(clients=[net, other], weights=np.full(2, 0.5), rng=np.random.default_rng(0),
                          class_shares=shares[::-1]))
    np.testing.assert_array_equal(flipped.layers[1].weight, result.layers[1].weight)
    np.testing.assert_allclose(flipped.layers[1].bias, (0.1 + (shares[::-1] * biases).sum(axis=0)) / 2, rtol=1e-12)
    # with σ² = 0.5, σ0² = 2 the precisions differ, and the bias keeps the formula
    tuned = PFNM(output_weighting="plain", sigma2=SIGMA2, sigma0_2=SIGMA0_2, bias_prior_mean=MU_B)
    result = tuned.align(AlignInput(clients=[net, other], weights=np.full(2, 0.5), rng=np.random.default_rng(0), class_shares=shares))
    expected = (MU_B * TAU0 + TAU * (shares * biases).sum(axis=0)) / (TAU0 + TAU * shares.sum(axis=0))
    np.testing.assert_allclose(result.layers[1].bias, expected, rtol=1e-12)


def test_plain_output_weighting_averages_the_retrained_output_layers_in_the_layerwise_driver() -> None:
    rng = np.random.default_rng(6)
    clients = [mlp(rng, [4, 5, 3]) for _ in range(3)]
    shares = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])

    def keep(_: int, prefix: list, starts: list) -> list:
        return starts

    results = {mode: PFNM(output_weighting=mode).align_layerwise(AlignInput(clients=clients, weights=np.full(3, 1 / 3), rng=np.random.default_rng(0), class_shares=shares), keep)
        for mode in ("plain", "class_share")}
    for mode, result in results.items():
        # each client's output layer, its input columns moved into the matched global order
        moved = []
        for k in range(3):
            m = np.zeros((3, result.widths[0]))
            m[:, result.permutations[k][0]] = clients[k][1].weight
            moved.append(m)
        if mode == "plain":
            np.testing.assert_allclose(result.layers[1].weight, sum(moved) / 3, rtol=1e-12)
        else:  # client k alone holds class k: row k is client k's
            np.testing.assert_allclose(result.layers[1].weight, np.stack([moved[k][k] for k in range(3)]), rtol=1e-12)
        # the bias is class-share weighted either way (the authors' code has no plain bias)
        np.testing.assert_allclose(result.layers[1].bias, [clients[k][1].bias[k] for k in range(3)], rtol=1e-12)


def test_layerwise_driver_freezes_each_matched_layer_and_lets_clients_retrain_the_rest() -> None:
    rng = np.random.default_rng(5)
    net = mlp(rng, [6, 9, 7, 3])
    clients, perms = permuted_copies(rng, net, 3)
    calls = []

    def retrain(layer_index: int, prefix: list[Layer], starts: list[list[Layer]]) -> list[list[Layer]]:
        calls.append((layer_index, len(prefix)))
        for start in starts:  # every client resumes from the frozen prefix, its next layer re-indexed
            assert len(start) == 3
            for frozen, own in zip(prefix, start):
                assert own is frozen
        return starts  # "retraining" that changes nothing

    alg = NAFI(sigma2=SIGMA2, sigma0_2=SIGMA0_2, bias_prior_mean=MU_B)
    result = alg.align_layerwise(AlignInput(clients=clients, weights=np.full(3, 1 / 3), rng=np.random.default_rng(0)), retrain)
    assert calls == [(0, 1), (1, 2)]

    def hidden(v: np.ndarray, mu: float) -> np.ndarray:
        return (mu * TAU0 + 3 * TAU * v) / (TAU0 + 3 * TAU)

    np.testing.assert_allclose(result.layers[0].weight, hidden(net[0].weight, 0.0), rtol=1e-10)
    np.testing.assert_allclose(result.layers[0].bias, hidden(net[0].bias, MU_B), rtol=1e-10)
    # layer 1 was matched on incoming weights already in the global order of layer 0
    np.testing.assert_allclose(result.layers[1].weight, hidden(net[1].weight, 0.0), rtol=1e-10)
    np.testing.assert_allclose(result.layers[2].weight, net[2].weight, rtol=1e-12)  # class-share average
    for k in range(3):
        for got, moved in zip(result.permutations[k], perms[k]):
            np.testing.assert_array_equal(got, np.argsort(moved))


def test_layerwise_driver_rejects_clients_that_did_not_keep_the_frozen_prefix() -> None:
    rng = np.random.default_rng(6)
    clients, _ = permuted_copies(rng, mlp(rng, [4, 5, 2]), 2)

    def retrain(layer_index: int, prefix: list[Layer], starts: list[list[Layer]]) -> list[list[Layer]]:
        return [[Layer(np.zeros((4, 4)), np.zeros(4)), Layer(np.zeros((2, 4)), np.zeros(2))] for _ in starts]

    with pytest.raises(ValueError, match="client 0 layer 0.*frozen global layer"):
        PFNM().align_layerwise(AlignInput(clients=clients, weights=np.full(2, 0.5), rng=rng), retrain)


def test_single_layer_matching_is_exposed_on_the_algorithm() -> None:
    rng = np.random.default_rng(7)
    net = mlp(rng, [3, 4, 2])
    clients, perms = permuted_copies(rng, net, 2)
    layer, match = PFNM().match_layer([c[0] for c in clients], rng=rng)
    assert layer.weight.shape == (4, 3) and match.width == 4
    np.testing.assert_array_equal(match.assignments[1], np.argsort(perms[1][0]))


@pytest.mark.parametrize(
    ("name", "params", "field"),
    [
        ("pfnm", {"sigma2": 0}, "sigma2"),
        ("pfnm", {"iterations": -2}, "iterations"),
        ("pfnm", {"lam": 0.1}, "lam"),  # PFNM has no λ
        ("nafi", {"lam": -1.0}, "lam"),
        ("nafi", {"kl_mode": "approximate"}, "kl_mode"),
        ("nafi", {"kl_count_clip": 0}, "kl_count_clip"),
        ("pfnm", {"kl_count_clip": 10}, "kl_count_clip"),  # PFNM has no KL term
        ("pfnm", {"output_weighting": "weighted"}, "output_weighting"),
    ],
)
def test_invalid_bayesian_parameters_are_config_errors_naming_the_parameter(name: str, params: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ALIGNMENT.create(name, params)
