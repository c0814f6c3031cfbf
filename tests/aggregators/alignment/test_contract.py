"""One contract for every registered alignment: deterministic for a seed, consistent shapes, bad input rejected."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fedbroker.aggregators.alignment as alignment
from fedbroker.aggregators.alignment import ALIGNMENT, AlignInput, AlignmentResult, Layer
from fedbroker.errors import ConfigError

NAMES = ["feddna", "nafi", "none", "pfnm"]
SEEDS = {"feddna": {"layers": "all", "freeze_after": None}}  # exercise the most of each algorithm


def mlp(rng: np.random.Generator, sizes: list[int]) -> list[Layer]:
    return [Layer(rng.normal(size=(o, i)), rng.normal(size=o)) for i, o in itertools.pairwise(sizes)]


def convnet(rng: np.random.Generator, c1: int, c2: int, hw: int = 4) -> list[Layer]:
    return [
        Layer(rng.normal(size=(c1, 2, 3, 3)), rng.normal(size=c1)),
        Layer(rng.normal(size=(c2, c1, 3, 3)), rng.normal(size=c2)),
        Layer(rng.normal(size=(5, c2 * hw)), rng.normal(size=5)),
        Layer(rng.normal(size=(3, 5)), rng.normal(size=3)),
    ]


def run(name: str, clients: list, seed: int = 0, **kwargs) -> AlignmentResult:
    alg = ALIGNMENT.create(name, SEEDS.get(name, {}))
    weights = np.linspace(1.0, 2.0, len(clients))
    return alg.align(AlignInput(clients=clients, weights=weights / weights.sum(), rng=np.random.default_rng(seed), **kwargs))


def assert_consistent(result: AlignmentResult, clients: list) -> None:
    layers, widths = result.layers, result.widths
    assert len(layers) == len(widths) == len(clients[0])
    assert [layer.weight.shape[0] for layer in layers] == widths
    assert layers[0].weight.shape[1:] == clients[0][0].weight.shape[1:]
    assert widths[-1] == clients[0][-1].weight.shape[0]
    for ell in range(1, len(layers)):
        w, prev = layers[ell].weight, clients[0][ell - 1].weight.shape[0]
        block = clients[0][ell].weight.reshape(clients[0][ell].weight.shape[0], prev, -1).shape[2]
        assert w.reshape(w.shape[0], widths[ell - 1], -1).shape[2] == block
        assert w.shape[2:] == clients[0][ell].weight.shape[2:]
    for ell, layer in enumerate(layers):
        assert layer.bias is not None and layer.bias.shape == (widths[ell],)
        assert np.all(np.isfinite(layer.weight)) and np.all(np.isfinite(layer.bias))
    assert len(result.permutations) == len(clients)
    for client, perms in zip(clients, result.permutations):
        assert len(perms) <= len(clients[0]) - 1
        for ell, perm in enumerate(perms):  # the first hidden layers, in order
            assert perm.shape == (client[ell].weight.shape[0],)
            assert np.unique(perm).size == perm.size and perm.min() >= 0 and perm.max() < widths[ell]
    assert all(isinstance(v, float) for v in result.stats.values())


def assert_same(a: AlignmentResult, b: AlignmentResult) -> None:
    assert a.widths == b.widths and a.stats == b.stats
    for x, y in zip(a.layers, b.layers):
        np.testing.assert_array_equal(x.weight, y.weight)
        np.testing.assert_array_equal(x.bias, y.bias)
    for pa, pb in zip(a.permutations, b.permutations):
        assert len(pa) == len(pb)
        for u, v in zip(pa, pb):
            np.testing.assert_array_equal(u, v)


def test_the_four_alignments_are_registered() -> None:
    assert ALIGNMENT.names() == NAMES


def test_an_unknown_alignment_is_a_config_error_listing_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="known: feddna, nafi, none, pfnm"):
        ALIGNMENT.create("fedma")


@pytest.mark.parametrize("name", NAMES)
def test_an_unknown_parameter_is_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError, match="bogus"):
        ALIGNMENT.create(name, {"bogus": 1})


@pytest.mark.parametrize("name", NAMES)
def test_same_input_and_seed_give_the_same_output(name: str) -> None:
    rng = np.random.default_rng(0)
    clients = [mlp(rng, [5, 6, 4, 3]) for _ in range(4)]
    assert_same(run(name, clients, seed=3), run(name, clients, seed=3))


@pytest.mark.parametrize("name", NAMES)
def test_shapes_of_an_mlp_result_are_consistent_with_its_widths(name: str) -> None:
    rng = np.random.default_rng(1)
    clients = [mlp(rng, [5, 6, 4, 3]) for _ in range(3)]
    assert_consistent(run(name, clients), clients)


@pytest.mark.parametrize("name", NAMES)
def test_shapes_of_a_conv_result_are_consistent_with_its_widths(name: str) -> None:
    rng = np.random.default_rng(2)
    clients = [convnet(rng, 3, 4) for _ in range(3)]
    assert_consistent(run(name, clients, spatial=[None, 4, None, None]), clients)


@pytest.mark.parametrize("name", ["pfnm", "nafi"])
def test_bayesian_matching_accepts_clients_of_unequal_widths(name: str) -> None:
    rng = np.random.default_rng(3)
    clients = [mlp(rng, [5, 6, 4, 3]), mlp(rng, [5, 8, 2, 3]), mlp(rng, [5, 3, 5, 3])]
    result = run(name, clients)
    assert_consistent(result, clients)
    assert result.widths[0] >= 8 and result.widths[1] >= 5


def _inconsistent_cases() -> list[tuple[str, object, str]]:
    rng = np.random.default_rng(4)

    def good() -> list[Layer]:
        return mlp(rng, [5, 6, 4, 3])

    nan = good()
    nan[1] = Layer(np.full((4, 6), np.nan), nan[1].bias)
    short = good()[:2]
    other_input = mlp(rng, [7, 6, 4, 3])
    other_output = mlp(rng, [5, 6, 4, 2])
    broken_chain = good()
    broken_chain[1] = Layer(rng.normal(size=(4, 5)), rng.normal(size=4))
    bad_bias = good()
    bad_bias[0] = Layer(bad_bias[0].weight, np.zeros(2))
    return [
        ("nan", [good(), good(), nan], r"client 2 layer 1: weight contains NaN"),
        ("layer count", [good(), short], r"client 1: has 2 layers, client 0 has 3"),
        ("input", [good(), other_input], r"client 1 layer 0"),
        ("output", [good(), other_output], r"client 1 layer 2"),
        ("chain", [broken_chain, good()], r"client 0 layer 1: 5 inputs do not match layer 0's 6 outputs"),
        ("bias", [good(), bad_bias], r"client 1 layer 0: bias shape"),
        ("no clients", [], r"no clients"),
    ]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("case", "clients", "message"), _inconsistent_cases(), ids=[c[0] for c in _inconsistent_cases()])
def test_inconsistent_clients_are_rejected_naming_client_and_layer(name: str, case: str, clients: list, message: str) -> None:
    alg = ALIGNMENT.create(name)
    weights = np.full(max(len(clients), 1), 1 / max(len(clients), 1))[: len(clients)]
    with pytest.raises(ValueError, match=message):
        alg.align(AlignInput(clients=clients, weights=weights, rng=np.random.default_rng(0)))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("weights", [np.array([0.5, 0.5, 0.0, 0.0]), np.array([1.0, -0.5]), np.array([np.nan, 1.0])])
def test_weights_must_be_one_finite_non_negative_coefficient_per_client(name: str, weights: np.ndarray) -> None:
    rng = np.random.default_rng(5)
    clients = [mlp(rng, [3, 4, 2]) for _ in range(2)]
    with pytest.raises(ValueError, match="weights"):
        ALIGNMENT.create(name).align(AlignInput(clients=clients, weights=weights, rng=rng))


def test_none_is_the_weighted_mean_of_every_layer() -> None:
    rng = np.random.default_rng(6)
    clients = [mlp(rng, [3, 4, 2]) for _ in range(3)]
    weights = np.array([0.2, 0.3, 0.5])
    result = ALIGNMENT.create("none").align(AlignInput(clients=clients, weights=weights, rng=rng))
    for ell in range(2):
        np.testing.assert_allclose(result.layers[ell].weight, sum(w * c[ell].weight for w, c in zip(weights, clients)))
        np.testing.assert_allclose(result.layers[ell].bias, sum(w * c[ell].bias for w, c in zip(weights, clients)))
    for perms in result.permutations:
        np.testing.assert_array_equal(perms[0], np.arange(4))


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(NAMES),
    sizes=st.lists(st.integers(1, 6), min_size=2, max_size=5),
    n_clients=st.integers(1, 4),
    seed=st.integers(0, 2**32 - 1),
)
def test_random_shapes_give_deterministic_consistent_results(name: str, sizes: list[int], n_clients: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    clients = [mlp(rng, sizes) for _ in range(n_clients)]
    a, b = run(name, clients, seed=seed), run(name, clients, seed=seed)
    assert_consistent(a, clients)
    assert_same(a, b)


def test_alignment_modules_never_import_transport_metrics_or_torch() -> None:
    forbidden = re.compile(r"^\s*(import|from)\s+(grpc|pika|torch|prometheus_client)\b", re.MULTILINE)
    package = Path(alignment.__file__).parent
    offenders = [p.name for p in sorted(package.glob("*.py")) if forbidden.search(p.read_text())]
    assert offenders == []
