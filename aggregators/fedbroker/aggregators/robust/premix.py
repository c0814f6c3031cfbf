"""Mixing the updates before a robust rule, so that a rule built for identically distributed updates holds
when honest sites differ (docs/algorithms.md, "Mixing before a rule").

Bucketing (Karimireddy, He, Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via Bucketing", ICLR
2022): the updates are permuted at random (the round's seeded rng) and averaged in buckets of s; the rule runs
on the ⌈n/s⌉ bucket means. Averaging s honest updates divides their spread by about s, and f attackers spoil
at most f buckets. Nearest-neighbour mixing (Allouah, Farhadkhani, Guerraoui, Gupta, Pinot, Stephan, "Fixing by
Mixing: A Recipe for Optimal Byzantine ML under Heterogeneity", AISTATS 2023): each update is replaced by the
mean of its n − f nearest updates, itself included; the rule runs on the n mixed updates.

Both are one (m, n) mixing matrix M (each row sums to 1): the rule sees M·D, and an original update's kept
weight is what the rule kept of every mixed row, times its share in that row (Mᵀ·kept), so the close reports
on the sites that sent the updates, and the kept weights still sum to what the rule kept.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fedbroker.aggregators.robust.base import RobustInput, RobustResult, gram, squared_distances

Combine = Callable[[RobustInput], RobustResult]


def premixed(combine: Combine, problem: RobustInput, *, premix: str, bucket_size: int,
             nnm_f: int | None) -> RobustResult:
    """`combine` over the pre-mixed rows, its kept weights spread back over the original updates."""
    n = problem.deltas.shape[0]
    if premix == "none" or n == 1:
        return combine(problem)
    if premix == "bucketing":
        mix = bucket_matrix(problem.weights, bucket_size, problem.rng)
        weights = mix_weights(mix, problem.weights)
    elif premix == "nnm":
        mix = nnm_matrix(problem.deltas, (n - 1) // 2 if nnm_f is None else nnm_f)
        weights = problem.weights
    else:
        raise ValueError(f"unknown premix {premix!r}")
    mixed = RobustInput(deltas=mixed_rows(problem.deltas, mix), weights=weights, rng=problem.rng,
                        root_update=problem.root_update, memory=problem.memory)
    inner = combine(mixed)
    # what the plain mean the rule replaces would give each original update: its weight, or 1/n for a rule
    # that counts every (mixed) row once
    weighted = np.allclose(inner.expected, weights / weights.sum())
    expected = problem.weights if weighted else np.full(n, 1.0 / n)
    notes = {**inner.notes, "premix_rows": float(mix.shape[0])}
    return RobustResult(inner.delta, np.asarray(mix.T @ inner.kept_weight), expected, notes,
                        memory=inner.memory)


def bucket_matrix(weights: np.ndarray, size: int, rng: np.random.Generator) -> np.ndarray:
    """A random partition into ⌈n/s⌉ buckets of s consecutive updates of a permutation (the last may hold
    fewer); each row the weighted mean of its bucket (the job's weights inside it)."""
    n = weights.shape[0]
    order = rng.permutation(n)
    rows = -(-n // size)
    mix = np.zeros((rows, n))
    for b in range(rows):
        members = order[b * size:(b + 1) * size]
        w = weights[members]
        mix[b, members] = w / w.sum() if w.sum() > 0 else 1.0 / len(members)
    return mix


def mix_weights(mix: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """A bucket's weight: the sum of its members' (every bucket weighs at least a little, so none is empty)."""
    total = (mix > 0).astype(np.float64) @ weights
    return np.asarray(np.where(total > 0, total, 1e-12))


def nnm_matrix(deltas: np.ndarray, f: int) -> np.ndarray:
    """Row j: 1/(n − f) on the n − f updates nearest to update j (itself first, whatever the ties)."""
    n = deltas.shape[0]
    k = max(1, n - min(f, n - 1))
    distances = squared_distances(gram(deltas))
    np.fill_diagonal(distances, -1.0)
    nearest = np.argsort(distances, axis=1, kind="stable")[:, :k]
    mix = np.zeros((n, n))
    np.put_along_axis(mix, nearest, 1.0 / k, axis=1)
    return mix


def mixed_rows(deltas: np.ndarray, mix: np.ndarray, *, chunk: int = 1 << 16) -> np.ndarray:
    """M·D in the updates' precision, accumulated in float64 a column block at a time."""
    out = np.empty((mix.shape[0], deltas.shape[1]), dtype=deltas.dtype)
    for start in range(0, deltas.shape[1], chunk):
        out[:, start:start + chunk] = mix @ deltas[:, start:start + chunk].astype(np.float64)
    return out
