"""Bayesian neuron matching shared by PFNM and NAFI (one layer at a time).

Global neurons θ_i ~ N(μ0, σ0²), local neurons are noisy copies N(θ_i, σ²) (per-coordinate precisions
allowed, so output weights can carry each client's class share). State per global neuron, in natural
parameters: G_i = m0 + Σ x (x = w·τ, m0 = μ0·τ0), S_i = τ0 + Σ τ, count c_i; the MAP neuron is G_i/S_i,
a precision-weighted mean shrunk toward μ0. Clients are matched one at a time (largest first, then
`iterations` sweeps in a seeded random order, each client removed before it is matched again) by a
linear sum assignment over the existing global neurons and "new neuron" slots:

    score(j, i)    = Σ_d (G_i + x_j)²/(S_i + τ) − Σ_d G_i²/S_i + a·log(c̃_i / (J − c̃_i))
    score(j, new k) = Σ_d (m0 + x_j)²/(τ0 + τ) − Σ_d m0²/τ0 − 2·log k + 2·log(γ0 / J)

(a = popularity_coef, c̃ = min(c, count_clip), J = number of clients). PFNM minimises −score; NAFI adds
λ·KL(p(θ_i | others) ‖ p(θ_i | others, w_j)) (the prior in place of "others" for a new slot), exact by
Lemma 5.1 or as the public NAFI code computes it (`kl_mode="reference"`, whose count-weighted term clips
counts at its own `kl_count_clip`: the authors' code clips there and not in the base cost).
Every matrix is built with matrix products over all (j, i) pairs at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import linear_sum_assignment

from fedbroker.aggregators.alignment.base import Layer, check_deadline
from fedbroker.algorithms.params import MatchingParams


@dataclass(frozen=True)
class LayerMatch:
    """Result of matching one layer: `assignments[s][j]` is the global index of client s's neuron j."""

    assignments: list[np.ndarray]
    natural_mean: np.ndarray  # G, (L, D)
    precision: np.ndarray  # S, (L, D)
    counts: np.ndarray  # (L,)

    @property
    def global_neurons(self) -> np.ndarray:
        """MAP estimate G/S of every global neuron."""
        means: np.ndarray = self.natural_mean / self.precision
        return means

    @property
    def width(self) -> int:
        """The number of global neurons."""
        return int(self.natural_mean.shape[0])


def new_slot_count(n_local: int, n_global: int, max_global_width: int) -> int:
    """New-neuron slots offered: up to the width cap, and like the public PFNM code at least one past it
    (`max(cap − L, 1)`), so a neuron unlike every global one can still start its own; never fewer than
    needed to place every local neuron (the reference code would drop the rest)."""
    return min(n_local, max(max_global_width - n_global, n_local - n_global, 1))


def _quadratic(x: np.ndarray, sq: np.ndarray, lin: np.ndarray, const: np.ndarray) -> np.ndarray:
    """Σ_d (x_jd²·sq_id + x_jd·lin_id) + const_i for every (j, i), as two matrix products."""
    values: np.ndarray = (x * x) @ sq.T + x @ lin.T + const[None, :]
    return values


def _kl_exact(x: np.ndarray, tau: np.ndarray, g: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Lemma 5.1 between N(G/S, 1/S) and N((G+x)/(S+τ), 1/(S+τ)) for every (j, i):
    ½ Σ_d [τ/S − ln(1 + τ/S) + (S+τ)(μ_y − μ_x)²], with (S+τ)(μ_y − μ_x)² = (S·x − τ·G)² / (S²(S+τ))."""
    sp = s + tau
    mean_shift = _quadratic(x, 1.0 / sp, -2.0 * tau * g / (s * sp), np.sum(tau**2 * g**2 / (s**2 * sp), axis=1))
    spread = np.sum(tau / s - np.log1p(tau / s), axis=1)
    kl: np.ndarray = 0.5 * (mean_shift + spread[None, :])
    return kl


def _kl_reference_mean_shift(x: np.ndarray, tau: np.ndarray, g: np.ndarray, s: np.ndarray) -> np.ndarray:
    """The public NAFI code's first term: Σ_d ((G+x)/(S+τ) − G/S)² / (S+τ) (it divides by the precision)."""
    sp3 = (s + tau) ** 3
    return _quadratic(x, 1.0 / sp3, -2.0 * tau * g / (s * sp3), np.sum(tau**2 * g**2 / (s**2 * sp3), axis=1))


def _log_ratio_constant(tau: np.ndarray, tau0: np.ndarray) -> float:
    """Σ_d (τ/τ0 − 1 − ln(τ/τ0)) over coordinates with τ > 0; the same for every entry of the matrix."""
    r = tau[tau > 0] / np.broadcast_to(tau0, tau.shape)[tau > 0]
    return float(np.sum(r - 1.0 - np.log(r)))


def _kl_reference(
    x: np.ndarray,
    tau: np.ndarray,
    g: np.ndarray,
    s: np.ndarray,
    counts: np.ndarray,
    m0: np.ndarray,
    tau0: np.ndarray,
    count_clip: int,
) -> tuple[np.ndarray, np.ndarray]:
    """(existing, new-slot) penalties as the public NAFI code computes them: its mean-shift term plus its
    count-weighted term (c̃+1)·Σ τ(x − m0 + H)²/(S+τ)² − c̃·Σ τH²/S² with H = G − c·m0."""
    clipped = np.minimum(counts, count_clip).astype(np.float64)
    h = g - counts[:, None] * m0[None, :]
    a = tau / (s + tau) ** 2
    xc = x - m0[None, :]
    first = _quadratic(xc, a, 2.0 * a * h, np.sum(a * h * h, axis=1))
    second = np.sum(tau * h * h / s**2, axis=1)
    const = _log_ratio_constant(tau, tau0)
    existing = first * (clipped + 1.0)[None, :] - (clipped * second)[None, :] + const
    existing = existing + _kl_reference_mean_shift(x, tau, g, s)
    new = np.sum(tau * xc * xc / (tau0 + tau) ** 2, axis=1) + const
    new = new + _kl_reference_mean_shift(x, tau, m0[None, :], tau0[None, :])[:, 0]
    return existing, new


def assignment_cost(
    local: np.ndarray,
    local_precision: np.ndarray,
    *,
    natural_mean: np.ndarray,
    precision: np.ndarray,
    counts: np.ndarray,
    prior_mean: np.ndarray,
    prior_precision: np.ndarray,
    n_clients: int,
    params: MatchingParams,
) -> np.ndarray:
    """Cost (to minimise) of giving local neuron j (rows) global neuron i or a new slot (columns).

    `local` holds raw neuron vectors w (J_s, D); the state (G, S, counts) excludes this client. Columns:
    the L existing neurons, then `new_slot_count(...)` new slots.
    """
    w = np.asarray(local, dtype=np.float64)
    tau = np.asarray(local_precision, dtype=np.float64)
    tau0 = np.asarray(prior_precision, dtype=np.float64)
    m0 = np.asarray(prior_mean, dtype=np.float64) * tau0
    g, s = natural_mean, precision
    x = w * tau
    n_global, n_local = g.shape[0], w.shape[0]
    sp = s + tau
    clipped = np.minimum(counts, params.count_clip).astype(np.float64)
    popularity = params.popularity_coef * np.log(clipped / (n_clients - clipped)) if n_global else np.zeros(0)
    existing = _quadratic(x, 1.0 / sp, 2.0 * g / sp, np.sum(g * g / sp, axis=1) - np.sum(g * g / s, axis=1) + popularity)
    n_new = new_slot_count(n_local, n_global, params.max_global_width)
    fresh = np.sum((m0 + x) ** 2 / (tau0 + tau), axis=1) - np.sum(m0 * m0 / tau0)
    slots = -2.0 * np.log(np.arange(1, n_new + 1)) + 2.0 * np.log(params.gamma0 / n_clients)
    cost = -np.hstack([existing, fresh[:, None] + slots[None, :]])
    if params.lam > 0:
        if params.kl_mode == "exact":
            kl_existing = _kl_exact(x, tau, g, s)
            kl_new = _kl_exact(x, tau, m0[None, :], tau0[None, :])[:, 0]
        else:
            kl_existing, kl_new = _kl_reference(x, tau, g, s, counts, m0, tau0, params.kl_count_clip)
        cost += params.lam * np.hstack([kl_existing, np.repeat(kl_new[:, None], n_new, axis=1)])
    return cost


class _State:
    """G, S and counts of the global neurons, with every client's current assignment."""

    def __init__(self, n_clients: int, prior_natural: np.ndarray, prior_precision: np.ndarray) -> None:
        self.m0, self.tau0 = prior_natural, prior_precision
        self.g = np.zeros((0, prior_natural.shape[0]))
        self.s = np.zeros((0, prior_natural.shape[0]))
        self.counts = np.zeros(0, dtype=np.int64)
        self.assignments: list[np.ndarray | None] = [None] * n_clients

    def remove(self, client: int, x: np.ndarray, tau: np.ndarray) -> None:
        a = self.assignments[client]
        assert a is not None
        self.assignments[client] = None
        self.counts[a] -= 1
        self.g[a] -= x
        self.s[a] -= tau
        keep = self.counts > 0
        if keep.all():
            return
        new_index = np.cumsum(keep) - 1
        self.g, self.s, self.counts = self.g[keep], self.s[keep], self.counts[keep]
        for k, other in enumerate(self.assignments):
            if other is not None:
                self.assignments[k] = new_index[other]

    def add(self, client: int, x: np.ndarray, tau: np.ndarray, columns: np.ndarray) -> None:
        """Place client's neurons on `columns` (≥ L means a new neuron, appended in local order)."""
        n_global = self.g.shape[0]
        old = columns < n_global
        a = np.empty(columns.shape[0], dtype=np.intp)
        a[old] = columns[old]
        self.g[a[old]] += x[old]
        self.s[a[old]] += tau
        self.counts[a[old]] += 1
        n_new = int((~old).sum())
        a[~old] = n_global + np.arange(n_new)
        self.g = np.vstack([self.g, self.m0 + x[~old]])
        self.s = np.vstack([self.s, np.tile(self.tau0 + tau, (n_new, 1))])
        self.counts = np.concatenate([self.counts, np.ones(n_new, dtype=np.int64)])
        self.assignments[client] = a


def match_neurons(
    vectors: Sequence[np.ndarray],
    *,
    precisions: Sequence[np.ndarray],
    prior_mean: np.ndarray,
    prior_precision: np.ndarray,
    params: MatchingParams,
    rng: np.random.Generator,
    deadline: float | None = None,
) -> LayerMatch:
    """Match every client's neurons (`vectors[s]` is (J_s, D)) to a common, inferred set of global neurons.

    `deadline` (time.monotonic()) is checked before every client's assignment: DeadlinePassed past it."""
    n_clients = len(vectors)
    ws = [np.asarray(v, dtype=np.float64) for v in vectors]
    taus = [np.broadcast_to(np.asarray(t, dtype=np.float64), (w.shape[1],)) for t, w in zip(precisions, ws)]
    tau0 = np.broadcast_to(np.asarray(prior_precision, dtype=np.float64), (ws[0].shape[1],))
    mu0 = np.broadcast_to(np.asarray(prior_mean, dtype=np.float64), (ws[0].shape[1],))
    xs = [w * t for w, t in zip(ws, taus)]
    state = _State(n_clients, mu0 * tau0, tau0)

    def place(client: int) -> None:
        check_deadline(deadline, "neuron matching")
        cost = assignment_cost(
            ws[client],
            taus[client],
            natural_mean=state.g,
            precision=state.s,
            counts=state.counts,
            prior_mean=mu0,
            prior_precision=tau0,
            n_clients=n_clients,
            params=params,
        )
        rows, cols = linear_sum_assignment(cost)
        columns = np.empty(ws[client].shape[0], dtype=np.intp)
        columns[rows] = cols
        state.add(client, xs[client], taus[client], columns)

    order = sorted(range(n_clients), key=lambda k: -ws[k].shape[0])
    first = order[0]
    state.add(first, xs[first], taus[first], np.arange(ws[first].shape[0]))
    for client in order[1:]:
        place(client)
    for _ in range(params.iterations):
        for client in rng.permutation(n_clients):
            state.remove(int(client), xs[client], taus[client])
            place(int(client))

    # recompute the sums from the final assignments, free of the add/remove round-off
    assignments = [a for a in state.assignments if a is not None]
    width = state.g.shape[0]
    g = np.tile(state.m0, (width, 1))
    s = np.tile(tau0, (width, 1))
    counts = np.zeros(width, dtype=np.int64)
    for a, x, t in zip(assignments, xs, taus):
        g[a] += x
        s[a] += t
        counts[a] += 1
    return LayerMatch(assignments=assignments, natural_mean=g, precision=s, counts=counts)


def channel_prior(name: str) -> float:
    """The prior mean of an attached norm's per-unit tensor: 1 for its scale (torch names an affine norm's
    scale `weight`), 0 for its shift, so a norm no client has trained is the identity."""
    return 1.0 if name.endswith(".weight") else 0.0


def neuron_vectors(layer: Layer) -> np.ndarray:
    """Incoming weights (conv filters flattened in (c_in, kh, kw) order), the bias, then the attached per-unit
    tensors (a norm's scale and shift, in name order)."""
    v = layer.weight.reshape(layer.weight.shape[0], -1)
    extra = ([] if layer.bias is None else [layer.bias[:, None]]) + [layer.channels[k][:, None]
                                                                      for k in sorted(layer.channels)]
    return np.hstack([v, *extra]) if extra else v


def match_layer(layers: Sequence[Layer], *, params: MatchingParams, rng: np.random.Generator) -> tuple[Layer, LayerMatch]:
    """Single-layer matching on incoming weights + bias (+ attached per-unit tensors); returns the global
    layer (MAP) and the match.

    Every client's layer must read the same inputs (same input width and order).
    """
    first = layers[0]
    for k, layer in enumerate(layers):
        if layer.weight.shape[1:] != first.weight.shape[1:] or (layer.bias is None) != (first.bias is None):
            raise ValueError(f"client {k}: layer reads inputs {layer.weight.shape[1:]}, client 0 reads {first.weight.shape[1:]}")
    vectors = [neuron_vectors(layer) for layer in layers]
    dim = vectors[0].shape[1]
    n_in = int(np.prod(first.weight.shape[1:]))
    names = sorted(first.channels)
    prior_mean = np.zeros(dim)
    if first.bias is not None:
        prior_mean[n_in] = params.bias_prior_mean
    lead = n_in + int(first.bias is not None)
    prior_mean[lead:] = [channel_prior(name) for name in names]
    match = match_neurons(
        vectors,
        precisions=[np.full(dim, 1.0 / params.sigma2)] * len(vectors),
        prior_mean=prior_mean,
        prior_precision=np.full(dim, 1.0 / params.sigma0_2),
        params=params,
        rng=rng,
    )
    theta = match.global_neurons
    weight = theta[:, :n_in].reshape((match.width,) + first.weight.shape[1:])
    bias = None if first.bias is None else theta[:, n_in].copy()
    channels = {name: theta[:, lead + i].copy() for i, name in enumerate(names)}
    return Layer(weight, bias, channels), match
