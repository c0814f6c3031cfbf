"""The simulated secure + robust groups of the poisoning experiment: the split, the secure group mean, the rule
over group means, and the tamper hook that hands the grouped result to the service's FedAvg."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from experiments import robust_groups as rg
from experiments import robust_poisoning as rp
from fedbroker.secagg.params import sum_error_bound
from fedbroker.secagg.secure_round import round_params
from fedbroker.worker.training import TrainResult


def _honest(n: int = 20, p: int = 300, seed: int = 0, spread: float = 0.02) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    deltas = 0.05 + spread * rng.normal(size=(n, p))
    weights = rng.integers(20, 120, size=n).astype(np.float64)
    return deltas, weights


def test_split_covers_every_site_once_in_groups_of_g_and_changes_with_the_seed():
    ids = [f"w{i:02d}" for i in range(20)]
    groups = rg.split_groups(ids, 5, np.random.default_rng([0, 1, 5150]))
    assert [len(g) for g in groups] == [5, 5, 5, 5]
    assert sorted(w for g in groups for w in g) == ids
    assert groups == rg.split_groups(ids, 5, np.random.default_rng([0, 1, 5150]))
    assert groups != rg.split_groups(ids, 5, np.random.default_rng([0, 2, 5150]))
    uneven = rg.split_groups(ids[:7], 3, np.random.default_rng(0))
    assert sorted(len(g) for g in uneven) == [3, 4]  # never a group under g: one site alone would be revealed


def test_secure_group_mean_is_the_weighted_mean_within_the_quantiser_bound():
    deltas, weights = _honest(n=5)
    got = rg.secure_mean(deltas, weights, np.random.default_rng(3))
    exact = (weights / weights.sum()) @ deltas
    worst, _ = sum_error_bound(round_params(5), 5)
    assert np.max(np.abs(got - exact)) <= worst
    unweighted = deltas.mean(axis=0)
    assert np.max(np.abs(unweighted - exact)) > 100 * worst  # the check tells a weighted mean from a plain one


def test_grouped_plain_mean_is_fedavg():
    """With no rule, the mean of the group means weighted by the groups' samples is the overall weighted mean:
    grouping alone changes nothing, so any difference in the table comes from the rule."""
    deltas, weights = _honest()
    groups = rg.split_groups(list(range(20)), 5, np.random.default_rng(1))
    got, means = rg.grouped_update(deltas, weights, groups, rg.build_rule({}), rng=np.random.default_rng(2))
    assert means.shape == (4, deltas.shape[1])
    np.testing.assert_allclose(got.delta, (weights / weights.sum()) @ deltas, atol=1e-6)


def test_a_sign_flip_in_one_group_moves_the_grouped_median_less_than_fedavg():
    deltas, weights = _honest(spread=0.005)
    honest_mean = (weights[1:] / weights[1:].sum()) @ deltas[1:]
    deltas[0] = -10.0 * deltas[0]                                # site 0 flips and scales its own update
    groups = rg.split_groups(list(range(20)), 5, np.random.default_rng(4))
    median = rg.build_rule(rp.adaptive_protocol().group_rule("groups_median"))
    got = rg.grouped_update(deltas, weights, groups, median, rng=np.random.default_rng(5))[0].delta
    fedavg = (weights / weights.sum()) @ deltas
    near, far = np.linalg.norm(got - honest_mean), np.linalg.norm(fedavg - honest_mean)
    assert near < far / 3


def _result(state: dict[str, np.ndarray], n: int) -> TrainResult:
    return TrainResult(state=state, num_samples=n, train_loss=1.0, steps=1, seconds=0.0, samples_per_second=0.0,
                       epsilon=None, history=())


def test_the_hook_sends_every_site_the_grouped_model_after_the_attack():
    rng = np.random.default_rng(0)
    base = {"w": rng.normal(size=(6, 5)).astype(np.float32), "b": rng.normal(size=5).astype(np.float32)}
    trained = {f"w{i:02d}": _result({k: v + rng.normal(scale=0.1, size=v.shape).astype(np.float32)
                                     for k, v in base.items()}, 10 + i) for i in range(8)}
    attack = rp.Attack(rp.Protocol(), "sign_flip", ["w03"], 8, seed=0)
    hook = rg.Grouped(attack, rg.build_rule({"robust": "median"}), group_size=4, seed=0)
    sent = hook(1, base, trained)
    assert sorted(sent) == sorted(trained)
    first = sent["w00"].state
    assert all(np.array_equal(s.state[k], first[k]) for s in sent.values() for k in base)
    assert all(sent[w].num_samples == trained[w].num_samples for w in trained)
    # what it sends is global + the grouped median of what the attack sent, over the same seeded groups
    attacked = attack(1, base, trained)
    ids = sorted(attacked)
    flat = np.concatenate([base[k].ravel() for k in base]).astype(np.float64)
    deltas = np.stack([np.concatenate([attacked[w].state[k].ravel() for k in base]) - flat for w in ids])
    split = np.random.default_rng([0, 1, 5150])
    groups = rg.split_groups(list(range(8)), 4, split)
    expected, _ = rg.grouped_update(deltas, np.array([attacked[w].num_samples for w in ids], dtype=float), groups,
                                    rg.build_rule({"robust": "median"}), rng=split)
    np.testing.assert_allclose(np.concatenate([first[k].ravel() for k in base]), flat + expected.delta, atol=1e-6)


def test_grouped_fedavg_through_the_harness_matches_the_services_fedavg():
    """End to end: the hook's model goes through the service's FedAvg unchanged (identical uploads), so a grouped
    plain mean ends one round where the service's own FedAvg ends it, up to the quantiser."""
    from experiments.harness import VirtualWorker, simulate
    from fedbroker.datasets import load_dataset, train_test_split

    p = replace(rp.quick_protocol(), workers=4, rounds=1, epochs=1)
    train, test = train_test_split(load_dataset("digits"), test_fraction=0.2, seed=0)
    sizes = (20, 28, 36, 44)  # unequal: the grouped mean must weigh sites as FedAvg does
    workers = [VirtualWorker(f"w{i}", train.x[i::4][:n], train.y[i::4][:n], 10) for i, n in enumerate(sizes)]
    job = p.job("fedavg", 0)
    plain = simulate(job, workers, test, progress=False, metrics=lambda m, d: {})
    hook = rg.Grouped(rp.Attack(p, rp.CLEAN, [], 4, seed=0), rg.build_rule({}), group_size=2, seed=0)
    grouped = simulate(job, workers, test, progress=False, metrics=lambda m, d: {}, tamper=hook)
    for name, value in plain.final_state.items():
        np.testing.assert_allclose(grouped.final_state[name], value, atol=1e-5)


def test_the_default_configuration_holds_a_sign_flip_that_breaks_fedavg():
    """nnm_cc as the experiment configures it (the service's rule, NNM with f = 4, then centered clipping):
    4 of 20 sites sending 10× their reversed update move it far less than they move FedAvg."""
    p = rp.adaptive_protocol()
    deltas, weights = _honest(spread=0.005)
    honest_mean = (weights[4:] / weights[4:].sum()) @ deltas[4:]
    deltas[:4] = -10.0 * deltas[:4]
    rule = rg.build_rule(p.aggregation(p.default_rule))
    got = rule.aggregate(rg.RobustInput(deltas=deltas, weights=weights, rng=np.random.default_rng(0))).delta
    fedavg = (weights / weights.sum()) @ deltas
    near, far = np.linalg.norm(got - honest_mean), np.linalg.norm(fedavg - honest_mean)
    assert far > np.linalg.norm(honest_mean)   # FedAvg is pulled past the origin: its step goes the wrong way
    assert near < far / 3
