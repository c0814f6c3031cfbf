"""FedDNA: dynamic node alignment by growing one tree per global node across the clients (Algorithm 1).

A node is one unit of the aligned layer, as the vector of its incoming weights (conv filters flattened
in (c_in, kh, kw) order), plus its bias when `include_bias_in_distance`. A tree starts at a random
unmatched node of a random client and grows, one client at a time, until it holds one node of every
client; its members become one global node. Growth picks, among all unmatched nodes of clients not yet
in the tree, the one nearest to the tree (`growth="prim"`, Algorithm 1 line 17) or the nearest node of
a random remaining client (`"random_client"`, the prose). Node→tree distance: `mst` = to the nearest
member (eq. 4), `fixed` = to the seed (eq. 6), `random` = to a member drawn at each step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.spatial.distance import cdist

from fedbroker.aggregators.alignment.base import (
    AlignInput,
    AlignmentResult,
    Layer,
    Network,
    check_deadline,
    identity_permutations,
    weighted_mean_layers,
    widths_of,
)
from fedbroker.aggregators.alignment.permute import permute_units
from fedbroker.algorithms.params import DISTANCES, GROWTHS, VARIANTS, FedDNAParams, check_choice, check_int

_METRICS = {"manhattan": "cityblock", "euclidean": "euclidean"}


@dataclass(frozen=True)
class TreeGrowth:
    """`members[t, k]` is the node (row of the distance matrix / flat node index) client k gives tree t."""

    members: np.ndarray  # (n_trees, n_clients) int
    edge_lengths: np.ndarray  # (n_trees,) sum of the edges added while growing each tree
    total_distance: float


def _measured(
    row: Callable[[int, np.ndarray], np.ndarray], rows: dict[int, np.ndarray], v: int, open_nodes: np.ndarray, n_nodes: int
) -> np.ndarray:
    """Node v's distances to the open nodes (inf elsewhere), measured once per tree."""
    if v not in rows:
        full = np.full(n_nodes, np.inf)
        full[open_nodes] = row(v, open_nodes)
        rows[v] = full
    return rows[v]


def _grow(
    row: Callable[[int, np.ndarray], np.ndarray],
    owner: np.ndarray,
    *,
    variant: str,
    growth: str,
    rng: np.random.Generator,
    seeds: Sequence[int] | None,
    deadline: float | None = None,
) -> TreeGrowth:
    """Algorithm 1. `row(v, nodes)` gives the distances from node v to `nodes`; only the nodes that can
    still join the current tree are ever measured. `deadline` is checked at every growth step."""
    n_nodes = owner.shape[0]
    n_clients = int(owner.max()) + 1
    sizes = np.bincount(owner, minlength=n_clients)
    if np.any(sizes != sizes[0]):
        raise ValueError(f"every client needs the same number of nodes; got {sizes.tolist()}")
    n_trees = int(sizes[0])
    remaining = np.ones(n_nodes, dtype=bool)
    members = np.empty((n_trees, n_clients), dtype=np.intp)
    edges = np.zeros(n_trees)
    seed_list = list(seeds or [])
    if len(seed_list) > n_trees:
        raise ValueError(f"{len(seed_list)} seeds for {n_trees} trees")
    for t in range(n_trees):
        if t < len(seed_list):
            seed = int(seed_list[t])
            if not 0 <= seed < n_nodes or not remaining[seed]:
                raise ValueError(f"seed node {seed} is not an unmatched node")
        else:
            client = int(rng.integers(n_clients))
            candidates = np.flatnonzero(remaining & (owner == client))
            seed = int(candidates[rng.integers(candidates.size)])
        tree = [seed]
        in_tree = np.zeros(n_clients, dtype=bool)
        in_tree[owner[seed]] = True
        remaining[seed] = False
        open_nodes = np.flatnonzero(remaining & ~in_tree[owner])  # nodes that may still join this tree
        rows: dict[int, np.ndarray] = {}  # member → distances to the nodes open when it was measured
        to_tree = _measured(row, rows, seed, open_nodes, n_nodes).copy()  # mst: min over members; fixed: seed
        for _ in range(n_clients - 1):
            check_deadline(deadline, "feddna tree growth")
            if variant == "random":
                dist = _measured(row, rows, tree[int(rng.integers(len(tree)))], open_nodes, n_nodes)
            else:
                dist = to_tree
            if growth == "prim":
                candidates = open_nodes
            else:
                client = int(rng.choice(np.flatnonzero(~in_tree)))
                candidates = open_nodes[owner[open_nodes] == client]
            node = int(candidates[np.argmin(dist[candidates])])
            edges[t] += dist[node]
            tree.append(node)
            remaining[node] = False
            in_tree[owner[node]] = True
            open_nodes = open_nodes[~in_tree[owner[open_nodes]]]
            if variant == "mst" and open_nodes.size:
                to_tree[open_nodes] = np.minimum(to_tree[open_nodes], row(node, open_nodes))
        members[t, owner[tree]] = tree
    return TreeGrowth(members=members, edge_lengths=edges, total_distance=float(edges.sum()))


def grow_trees_from_distances(
    distance: np.ndarray,
    owner: np.ndarray,
    *,
    rng: np.random.Generator,
    variant: str = "mst",
    growth: str = "prim",
    seeds: Sequence[int] | None = None,
) -> TreeGrowth:
    """Trees over a precomputed (nodes × nodes) distance matrix; `owner[v]` is node v's client.

    `seeds` fixes the seed node of the first trees (the rest are drawn from `rng`), as in the paper's
    Table 2 walk-through. Distances between nodes of one client are never read.
    """
    check_choice("variant", variant, VARIANTS)
    check_choice("growth", growth, GROWTHS)
    d = np.asarray(distance, dtype=np.float64)
    own = np.asarray(owner, dtype=np.intp)
    if d.ndim != 2 or d.shape[0] != d.shape[1] or own.shape != (d.shape[0],):
        raise ValueError(f"distance must be square with one owner per node; got {d.shape} and {own.shape}")
    return _grow(lambda v, nodes: d[v, nodes], own, variant=variant, growth=growth, rng=rng, seeds=seeds)


def grow_trees(
    vectors: Sequence[np.ndarray],
    *,
    rng: np.random.Generator,
    variant: str = "mst",
    growth: str = "prim",
    distance: str = "manhattan",
    seeds: Sequence[int] | None = None,
    deadline: float | None = None,
) -> TreeGrowth:
    """Trees over the clients' node vectors (`vectors[k]` is (n, m)); nodes are numbered client-major."""
    check_choice("distance", distance, DISTANCES)
    points = np.concatenate([np.asarray(v, dtype=np.float64) for v in vectors])
    owner = np.repeat(np.arange(len(vectors)), [len(v) for v in vectors])
    metric = _METRICS[distance]

    def row(v: int, nodes: np.ndarray) -> np.ndarray:
        distances: np.ndarray = cdist(points[nodes], points[v : v + 1], metric)[:, 0]
        return distances

    return _grow(row, owner, variant=variant, growth=growth, rng=rng, seeds=seeds, deadline=deadline)


def spanning_costs(vectors: Sequence[np.ndarray], local_members: np.ndarray, distance: str) -> np.ndarray:
    """Minimum spanning tree weight of every tree (`local_members[t, k]` = client k's node index).

    Prim over the k members, vectorised across trees; the yardstick for comparing an alignment with the
    static (identity) one on equal terms.
    """
    n_trees, n_clients = local_members.shape
    pts = [np.asarray(v, dtype=np.float64)[local_members[:, k]] for k, v in enumerate(vectors)]
    d = np.zeros((n_trees, n_clients, n_clients))
    for a in range(n_clients):
        for b in range(a + 1, n_clients):
            diff = pts[a] - pts[b]
            dab = np.abs(diff).sum(axis=1) if distance == "manhattan" else np.sqrt(np.einsum("ij,ij->i", diff, diff))
            d[:, a, b] = d[:, b, a] = dab
    rows = np.arange(n_trees)
    in_tree = np.zeros((n_trees, n_clients), dtype=bool)
    in_tree[:, 0] = True
    best = d[:, 0, :].copy()
    cost = np.zeros(n_trees)
    for _ in range(n_clients - 1):
        pick = np.argmin(np.where(in_tree, np.inf, best), axis=1)
        cost += best[rows, pick]
        in_tree[rows, pick] = True
        np.minimum(best, d[rows, pick, :], out=best)
    return cost


class FedDNA(FedDNAParams):
    """Dynamic node alignment for rounds 1..freeze_after, plain FedAvg afterwards (None: never freeze).

    `weighted_means` weights the tree means by the aggregation weights (default: the paper's plain mean).
    `static_fallback` keeps the identity alignment of a layer when its trees' total spanning distance
    would exceed the identity trees' (greedy growth is not optimal; this bounds it by static alignment).
    """

    def node_vectors(self, layer: Layer) -> np.ndarray:
        """Each unit as the vector the tree distances compare: its incoming weights (and bias, if asked)."""
        v = layer.weight.reshape(layer.weight.shape[0], -1)
        if self.include_bias_in_distance and layer.bias is not None:
            v = np.hstack([v, layer.bias[:, None]])
        return v

    def align(self, problem: AlignInput) -> AlignmentResult:
        """Align the chosen layers by growing trees (rounds up to `freeze_after`), then take the mean."""
        given = problem.checked(same_widths=True)
        nets, w, rng, deadline = given.nets, given.weights, problem.rng, problem.deadline
        round_index = problem.round_index
        check_int("round_index", round_index, minimum=1)
        n_hidden = len(nets[0]) - 1
        aligned = list(range(min(1, n_hidden))) if self.layers == "first" else list(range(n_hidden))
        if self.freeze_after is not None and round_index > self.freeze_after:
            layers = weighted_mean_layers(nets, w)
            return AlignmentResult(
                layers=layers,
                permutations=identity_permutations(nets, len(aligned)),
                widths=widths_of(layers),
                stats={"frozen": 1.0, "total_matched_distance": 0.0, "aligned_layers": 0.0},
            )
        stats: dict[str, float] = {"frozen": 0.0, "aligned_layers": float(len(aligned))}
        perms: list[list[np.ndarray]] = [[] for _ in nets]
        total = identity_total = 0.0
        for ell in aligned:
            perm_per_client, matched, identity, fell_back = self._align_layer(nets, ell, rng, deadline)
            for k, perm in enumerate(perm_per_client):
                nets[k] = permute_units(nets[k], ell, perm)
                perms[k].append(perm)
            stats[f"matched_distance_layer_{ell}"] = matched
            stats[f"identity_distance_layer_{ell}"] = identity
            stats[f"static_fallback_layer_{ell}"] = float(fell_back)
            total += matched
            identity_total += identity
        stats["total_matched_distance"] = total
        stats["identity_distance"] = identity_total
        layers = weighted_mean_layers(nets, w)
        if not self.weighted_means:
            uniform = weighted_mean_layers([[net[ell] for ell in aligned] for net in nets], np.full(len(nets), 1 / len(nets)))
            for ell, layer in zip(aligned, uniform):
                layers[ell] = layer
        return AlignmentResult(layers=layers, permutations=perms, widths=widths_of(layers), stats=stats)

    def _align_layer(
        self, nets: list[Network], ell: int, rng: np.random.Generator, deadline: float | None = None
    ) -> tuple[list[np.ndarray], float, float, bool]:
        """Per-client maps node j → global node, the matched and identity distances, whether it fell back."""
        vectors = [self.node_vectors(net[ell]) for net in nets]
        n = vectors[0].shape[0]
        grown = grow_trees(vectors, rng=rng, variant=self.variant, growth=self.growth, distance=self.distance,
                           deadline=deadline)
        local = grown.members - n * np.arange(len(nets))[None, :]
        identity = np.repeat(np.arange(n)[:, None], len(nets), axis=1)
        identity_cost = float(spanning_costs(vectors, identity, self.distance).sum())
        matched = grown.total_distance
        fell_back = self.static_fallback and float(spanning_costs(vectors, local, self.distance).sum()) > identity_cost
        if fell_back:
            local, matched = identity, identity_cost
        # global node of a tree = the index of client 0's member, so client 0 keeps its order
        perms = []
        for k in range(len(nets)):
            perm = np.empty(n, dtype=np.intp)
            perm[local[:, k]] = local[:, 0]
            perms.append(perm)
        return perms, matched, identity_cost, fell_back
