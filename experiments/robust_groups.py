"""Secure + robust groups, simulated for the poisoning experiment: each round the sites are split at random into
groups of g, each group's secure aggregation yields only its members' weighted mean, and a robust rule runs
over the G group means instead of over the sites' updates.

This SIMULATES the service's protocol rather than running it: no keys, no shares, no masks. The masks of a
secure sum cancel exactly mod the ring, so the group sum the server unmasks is the ring sum of the members'
quantised weighted updates; that is what is computed here, with the secure path's own settings, quantiser and
dequantiser (`fedbroker.secagg`: ring, clip ±B and stochastic rounding of each scale_i·Δ_i). The robust rule is
the service's own, built from the registry once per federation (as the service builds a job's rule once) and
called with the group means as its updates and the groups' sample counts as its weights.

The round's result reaches the service as every site uploading the same model, so the job's FedAvg returns it
unchanged: the harness, the training and the evaluation stay the service's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from fedbroker.aggregators.robust import ROBUST, RobustInput, RobustResult, RobustRule
from fedbroker.aggregators.robust.memory import RobustMemory
from fedbroker.secagg.params import dequantise_sum, mask_ring, quantise
from fedbroker.secagg.secure_round import round_params

Tamper = Callable[[int, dict[str, np.ndarray], dict[str, Any]], dict[str, Any]]


def split_groups(ids: Sequence[str], size: int, rng: np.random.Generator) -> list[list[str]]:
    """A random split of `ids` into groups of `size` (the last one larger when `size` does not divide them,
    so no group is smaller than `size`: a secure group of one would reveal its site's update)."""
    if size < 2 or len(ids) < size:
        raise ValueError(f"cannot split {len(ids)} site(s) into groups of {size}")
    order = [ids[i] for i in rng.permutation(len(ids))]
    count = len(order) // size
    groups = [order[i * size:(i + 1) * size] for i in range(count)]
    groups[-1].extend(order[count * size:])
    return groups


def secure_mean(deltas: np.ndarray, weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """What one group's secure aggregation gives the server: Σ scale_i·Δ_i / Σ scale_i with scale_i = w_i / Σ w,
    each weighted update quantised as a site's secure task does, summed in the ring (where the masks cancel) and
    dequantised as the service does."""
    params = round_params(len(deltas))
    scale = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
    total = np.zeros(deltas.shape[1], dtype=params.dtype)
    for row, s in zip(deltas, scale):
        total += quantise(np.asarray(row, dtype=np.float64) * s, params, rng)  # uint arithmetic wraps mod 2^bits
    mask_ring(total, params.bits)
    return dequantise_sum(total, len(deltas), params) / float(scale.sum())


def grouped_update(deltas: np.ndarray, weights: np.ndarray, groups: Sequence[Sequence[int]], rule: RobustRule, *,
                   rng: np.random.Generator, memory: RobustMemory | None = None,
                   quantised: bool = True) -> tuple[RobustResult, np.ndarray]:
    """(the rule's result over the group means, the group means): `groups` are row indices of `deltas`. The rows
    the rule sees are anonymous (a group is new every round, so a per-site history has nothing to follow);
    `memory` is what the rule kept from the last round (centered clipping's momentum)."""
    means, sizes = [], []
    for members in groups:
        idx = np.asarray(members)
        w = np.asarray(weights, dtype=np.float64)[idx]
        means.append(secure_mean(deltas[idx], w, rng) if quantised else (w / w.sum()) @ deltas[idx])
        sizes.append(float(w.sum()))
    stacked = np.stack(means)
    result = rule.aggregate(RobustInput(deltas=stacked, weights=np.asarray(sizes), rng=rng, memory=memory))
    return result, stacked


def build_rule(section: Mapping[str, Any]) -> RobustRule:
    """The service's rule for a job's aggregation section (`robust`, `robust_params`); `none` for no rule."""
    return ROBUST.create(str(section.get("robust", "none")), dict(section.get("robust_params", {})))


class Grouped:
    """A tamper hook that runs the attack, then the grouped round: every site uploads the grouped result."""

    def __init__(self, attack: Tamper, rule: RobustRule, *, group_size: int, seed: int) -> None:
        self.attack, self.rule, self.group_size, self.seed = attack, rule, group_size, seed
        self.memory: RobustMemory | None = None  # kept from round to round, as the service keeps a job's

    def __call__(self, round_number: int, global_state: dict[str, np.ndarray],
                 trained: dict[str, Any]) -> dict[str, Any]:
        sent = self.attack(round_number, global_state, trained)
        if not sent:
            return sent
        ids = sorted(sent)
        names = [n for n, t in global_state.items() if np.issubdtype(t.dtype, np.floating)]
        base = np.concatenate([np.asarray(global_state[n], dtype=np.float64).ravel() for n in names])
        deltas = np.stack([np.concatenate([np.asarray(sent[w].state[n], dtype=np.float64).ravel() for n in names])
                           - base for w in ids])
        weights = np.array([float(sent[w].num_samples) for w in ids])
        rng = np.random.default_rng([self.seed, round_number, 5150])
        groups = split_groups(list(range(len(ids))), self.group_size, rng)
        result, _ = grouped_update(deltas, weights, groups, self.rule, rng=rng, memory=self.memory)
        self.memory = result.memory
        flat = base + np.asarray(result.delta, dtype=np.float64)
        state = dict(sent[ids[0]].state)
        start = 0
        for n in names:
            size = global_state[n].size
            state[n] = flat[start:start + size].reshape(global_state[n].shape).astype(global_state[n].dtype)
            start += size
        return {w: replace(sent[w], state=state) for w in ids}
