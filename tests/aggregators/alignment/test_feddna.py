"""FedDNA: tree growing (Algorithm 1), exact realignment of permuted copies, distance bound, freezing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.aggregators.alignment import (
    ALIGNMENT,
    AlignInput,
    FedDNA,
    Layer,
    apply_permutations,
    grow_trees,
    grow_trees_from_distances,
    spanning_costs,
)
from fedbroker.errors import ConfigError

NAMES = ["A", "B", "C", "a", "b", "c", "α", "β", "γ"]  # Site1, Site2, Site3 of the paper's Table 2


def table2() -> tuple[np.ndarray, np.ndarray]:
    site12 = np.array([[0.12, 0.15, 0.16], [0.11, 0.13, 0.17], [0.16, 0.14, 0.18]])  # rows A B C, cols a b c
    site31 = np.array([[0.27, 0.13, 0.19], [0.23, 0.14, 0.18], [0.21, 0.16, 0.21]])  # rows α β γ, cols A B C
    site32 = np.array([[0.13, 0.24, 0.18], [0.14, 0.19, 0.21], [0.21, 0.21, 0.25]])  # rows α β γ, cols a b c
    d = np.full((9, 9), np.inf)
    d[0:3, 3:6], d[3:6, 0:3] = site12, site12.T
    d[6:9, 0:3], d[0:3, 6:9] = site31, site31.T
    d[6:9, 3:6], d[3:6, 6:9] = site32, site32.T
    return d, np.repeat(np.arange(3), 3)


def forward(net: list[Layer], x: np.ndarray) -> np.ndarray:
    h = torch.from_numpy(x)
    for ell, layer in enumerate(net):
        w, b = torch.from_numpy(layer.weight), torch.from_numpy(layer.bias)
        h = F.conv2d(h, w, b, padding="same") if layer.weight.ndim == 4 else F.linear(h.flatten(1), w, b)
        if ell < len(net) - 1:
            h = torch.relu(h)
    return h.numpy()


def mlp(rng: np.random.Generator, sizes: list[int]) -> list[Layer]:
    return [Layer(rng.normal(size=(o, i)), rng.normal(size=o)) for i, o in itertools.pairwise(sizes)]


def permuted_copies(rng: np.random.Generator, net: list[Layer], n_copies: int, n_permuted: int) -> tuple[list, list]:
    """Copies of `net` whose first `n_permuted` hidden layers are shuffled; returns (clients, perms)."""
    clients, perms = [net], [[np.arange(net[ell].weight.shape[0]) for ell in range(n_permuted)]]
    for _ in range(n_copies - 1):
        p = [rng.permutation(net[ell].weight.shape[0]) for ell in range(n_permuted)]
        clients.append(apply_permutations(net, p))
        perms.append(p)
    return clients, perms


def test_table2_three_site_example_gives_the_papers_trees() -> None:
    d, owner = table2()
    grown = grow_trees_from_distances(d, owner, rng=np.random.default_rng(0), seeds=[3, 4, 5])  # a, b, c
    trees = [{NAMES[v] for v in row} for row in grown.members]
    assert trees == [{"a", "B", "α"}, {"b", "C", "β"}, {"c", "A", "γ"}]
    # a–B 0.11 then α at 0.13; b–C 0.14 then β at min(0.19, 0.18); c–A 0.16 then γ at min(0.25, 0.21)
    np.testing.assert_allclose(grown.edge_lengths, [0.24, 0.32, 0.37])
    assert grown.total_distance == pytest.approx(0.93)


def test_mst_fixed_and_random_client_growth_differ_as_the_paper_describes() -> None:
    # 1-D nodes; client 0 = {0, 50}, client 1 = {6, -3.9}, client 2 = {3.5, 60}; seeded at 0
    vectors = [np.array([[0.0], [50.0]]), np.array([[6.0], [-3.9]]), np.array([[3.5], [60.0]])]
    rng = np.random.default_rng(0)
    mst = grow_trees(vectors, rng=rng, seeds=[0])
    fixed = grow_trees(vectors, rng=rng, variant="fixed", seeds=[0])
    assert mst.members[0].tolist() == [0, 2, 4]  # 3.5 joins first, then 6 is 2.5 from the tree
    assert fixed.members[0].tolist() == [0, 3, 4]  # −3.9 is nearer the seed than 6
    assert mst.edge_lengths[0] == pytest.approx(3.5 + 2.5)
    assert fixed.edge_lengths[0] == pytest.approx(3.5 + 3.9)


@settings(max_examples=25, deadline=None)
@given(
    n_clients=st.integers(1, 5),
    n_nodes=st.integers(1, 7),
    dim=st.integers(1, 4),
    variant=st.sampled_from(["mst", "fixed", "random"]),
    growth=st.sampled_from(["prim", "random_client"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_tree_holds_one_node_of_every_client_and_every_node_is_used_once(
    n_clients: int, n_nodes: int, dim: int, variant: str, growth: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    vectors = [rng.normal(size=(n_nodes, dim)) for _ in range(n_clients)]
    grown = grow_trees(vectors, rng=np.random.default_rng(seed), variant=variant, growth=growth)
    assert grown.members.shape == (n_nodes, n_clients)
    np.testing.assert_array_equal(grown.members // n_nodes, np.tile(np.arange(n_clients), (n_nodes, 1)))
    np.testing.assert_array_equal(np.sort(grown.members.ravel()), np.arange(n_nodes * n_clients))
    again = grow_trees(vectors, rng=np.random.default_rng(seed), variant=variant, growth=growth)
    np.testing.assert_array_equal(again.members, grown.members)


@pytest.mark.parametrize("layers", ["first", "all"])
@pytest.mark.parametrize("distance", ["manhattan", "euclidean"])
def test_permuted_copies_are_realigned_exactly_and_compute_the_same_function(layers: str, distance: str) -> None:
    rng = np.random.default_rng(7)
    net = mlp(rng, [5, 9, 8, 7, 3])
    n_permuted = 1 if layers == "first" else 3
    clients, perms = permuted_copies(rng, net, 4, n_permuted)
    result = FedDNA(layers=layers, distance=distance).align(AlignInput(clients=clients, weights=np.array([0.1, 0.2, 0.3, 0.4]), rng=np.random.default_rng(1)
    ))
    for k in range(4):
        assert len(result.permutations[k]) == n_permuted
        for got, moved in zip(result.permutations[k], perms[k]):
            np.testing.assert_array_equal(got, np.argsort(moved))  # client unit j → original unit
    assert result.stats["total_matched_distance"] == 0.0
    x = rng.normal(size=(32, 5))
    np.testing.assert_allclose(forward(result.layers, x), forward(net, x), rtol=0, atol=1e-10)
    for layer, original in zip(result.layers, net):
        np.testing.assert_allclose(layer.weight, original.weight, rtol=0, atol=1e-12)


def test_permuted_conv_copies_are_realigned_through_conv_and_flatten_blocks() -> None:
    rng = np.random.default_rng(8)
    net = [
        Layer(rng.normal(size=(4, 2, 3, 3)), rng.normal(size=4)),
        Layer(rng.normal(size=(5, 4, 3, 3)), rng.normal(size=5)),
        Layer(rng.normal(size=(6, 5 * 16)), rng.normal(size=6)),
        Layer(rng.normal(size=(2, 6)), rng.normal(size=2)),
    ]
    clients, _ = permuted_copies(rng, net, 3, 3)
    result = FedDNA(layers="all").align(AlignInput(clients=clients, weights=np.full(3, 1 / 3), rng=np.random.default_rng(2), spatial=[None, 16, None, None]
    ))
    x = rng.normal(size=(3, 2, 4, 4))
    np.testing.assert_allclose(forward(result.layers, x), forward(net, x), rtol=0, atol=1e-10)


def test_bias_in_distance_separates_units_with_equal_incoming_weights() -> None:
    rng = np.random.default_rng(9)
    w = rng.normal(size=(1, 4))
    net = [Layer(np.vstack([w, w, rng.normal(size=(2, 4))]), np.array([0.0, 5.0, 1.0, 2.0])), Layer(rng.normal(size=(2, 4)), np.zeros(2))]
    clients, perms = permuted_copies(rng, net, 3, 1)
    result = FedDNA(include_bias_in_distance=True).align(AlignInput(clients=clients, weights=np.full(3, 1 / 3), rng=np.random.default_rng(0)))
    for k in range(3):
        np.testing.assert_array_equal(result.permutations[k][0], np.argsort(perms[k][0]))


def test_matched_distance_beats_static_alignment_on_noisy_permuted_copies() -> None:
    rng = np.random.default_rng(10)
    net = mlp(rng, [12, 20, 3])
    clients, _ = permuted_copies(rng, net, 5, 1)
    noisy = [[Layer(layer.weight + 0.05 * rng.normal(size=layer.weight.shape), layer.bias) for layer in c] for c in clients]
    result = FedDNA(static_fallback=False).align(AlignInput(clients=noisy, weights=np.full(5, 0.2), rng=np.random.default_rng(3)))
    assert result.stats["total_matched_distance"] < 0.1 * result.stats["identity_distance"]


@settings(max_examples=25, deadline=None)
@given(
    n_clients=st.integers(2, 5),
    width=st.integers(1, 6),
    n_in=st.integers(1, 4),
    variant=st.sampled_from(["mst", "fixed", "random"]),
    growth=st.sampled_from(["prim", "random_client"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_matched_distance_is_never_larger_than_the_identity_alignments(
    n_clients: int, width: int, n_in: int, variant: str, growth: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    clients = [mlp(rng, [n_in, width, 2]) for _ in range(n_clients)]
    alg = FedDNA(variant=variant, growth=growth)
    result = alg.align(AlignInput(clients=clients, weights=np.full(n_clients, 1 / n_clients), rng=np.random.default_rng(seed)))
    identity = result.stats["identity_distance"]
    # the trees actually used, measured on equal terms with the identity trees
    vectors = [alg.node_vectors(c[0]) for c in clients]
    local = np.stack([np.argsort(p[0]) for p in result.permutations], axis=1)  # tree t = global node t
    assert spanning_costs(vectors, local, "manhattan").sum() <= identity * (1 + 1e-12) + 1e-12
    if (variant, growth) == ("mst", "prim"):  # Prim's edges are exactly the spanning distance
        assert result.stats["total_matched_distance"] <= identity * (1 + 1e-12) + 1e-12


def test_alignment_freezes_into_fedavg_after_freeze_after_rounds() -> None:
    rng = np.random.default_rng(11)
    clients, _ = permuted_copies(rng, mlp(rng, [4, 6, 2]), 3, 1)
    weights = np.array([0.5, 0.3, 0.2])
    fedavg = ALIGNMENT.create("none").align(AlignInput(clients=clients, weights=weights, rng=np.random.default_rng(0)))
    frozen = FedDNA(freeze_after=2).align(AlignInput(clients=clients, weights=weights, rng=np.random.default_rng(0), round_index=3))
    assert frozen.stats["frozen"] == 1.0
    for a, b in zip(frozen.layers, fedavg.layers):
        np.testing.assert_array_equal(a.weight, b.weight)
    for perms in frozen.permutations:
        np.testing.assert_array_equal(perms[0], np.arange(6))
    assert FedDNA(freeze_after=2).align(AlignInput(clients=clients, weights=weights, rng=np.random.default_rng(0), round_index=2)).stats["frozen"] == 0.0
    assert FedDNA(freeze_after=None).align(AlignInput(clients=clients, weights=weights, rng=np.random.default_rng(0), round_index=99)).stats["frozen"] == 0.0


def test_tree_means_are_plain_by_default_and_weighted_on_request() -> None:
    rng = np.random.default_rng(12)
    base = mlp(rng, [3, 4, 2])
    other = [Layer(layer.weight + 1e-3 * rng.normal(size=layer.weight.shape), layer.bias + 0.01) for layer in base]
    weights = np.array([0.75, 0.25])
    plain = FedDNA().align(AlignInput(clients=[base, other], weights=weights, rng=np.random.default_rng(0)))
    weighted = FedDNA(weighted_means=True).align(AlignInput(clients=[base, other], weights=weights, rng=np.random.default_rng(0)))
    np.testing.assert_allclose(plain.layers[0].weight, (base[0].weight + other[0].weight) / 2)
    np.testing.assert_allclose(weighted.layers[0].weight, 0.75 * base[0].weight + 0.25 * other[0].weight)
    for result in (plain, weighted):  # the layers that are not aligned are always FedAvg
        np.testing.assert_allclose(result.layers[1].weight, 0.75 * base[1].weight + 0.25 * other[1].weight)


def test_unequal_widths_are_rejected_naming_the_client_and_layer() -> None:
    rng = np.random.default_rng(13)
    with pytest.raises(ValueError, match="client 1 layer 0.*equal widths"):
        FedDNA().align(AlignInput(clients=[mlp(rng, [3, 4, 2]), mlp(rng, [3, 5, 2])], weights=np.full(2, 0.5), rng=rng))


@pytest.mark.parametrize(
    ("params", "name"),
    [
        ({"variant": "kruskal"}, "variant"),
        ({"growth": "greedy"}, "growth"),
        ({"distance": "cosine"}, "distance"),
        ({"layers": "last"}, "layers"),
        ({"freeze_after": -1}, "freeze_after"),
        ({"include_bias_in_distance": "yes"}, "include_bias_in_distance"),
    ],
)
def test_invalid_parameters_are_rejected_naming_the_parameter(params: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        FedDNA(**params)
    with pytest.raises(ConfigError, match=name):
        ALIGNMENT.create("feddna", params)
