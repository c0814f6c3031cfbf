"""The poisoning experiment's attacks do what their papers say, on the uploads the service really receives."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from experiments import robust_poisoning as rp
from experiments.harness import simulate
from fedbroker.close_report import Verdict
from fedbroker.worker.training import TrainResult


def _result(state: dict[str, np.ndarray]) -> TrainResult:
    return TrainResult(state=state, num_samples=10, train_loss=1.0, steps=1, seconds=0.0, samples_per_second=0.0,
                       epsilon=None, history=())


def test_alie_z_follows_baruch_et_al():
    # s = floor(n/2 + 1) - f supporters needed; z = Φ⁻¹((n - s) / n)
    assert math.isclose(rp.alie_z(20, 4), 0.38532, abs_tol=1e-4)  # s = 7, Φ⁻¹(0.65)
    assert math.isclose(rp.alie_z(20, 6), 0.67449, abs_tol=1e-4)  # s = 5, Φ⁻¹(0.75)
    assert rp.alie_z(20, 2) < rp.alie_z(20, 4) < rp.alie_z(20, 6)  # more attackers, a bolder shift


def test_attackers_are_nested_across_counts_and_fixed_per_seed():
    ids = [f"w{i:02d}" for i in range(20)]
    two, four, six = (rp.attackers_of(rp.Protocol(), 1, f, ids) for f in (2, 4, 6))
    assert set(two) < set(four) < set(six)
    assert rp.attackers_of(rp.Protocol(), 1, 4, ids) == four
    assert rp.attackers_of(rp.Protocol(), 2, 4, ids) != four


def test_label_flip_maps_every_class_to_its_mirror():
    y = np.arange(10)
    assert rp.flip_labels(y, 10).tolist() == [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]


def _round(n: int = 5) -> tuple[dict[str, np.ndarray], dict[str, TrainResult]]:
    rng = np.random.default_rng(0)
    base = {"w": rng.normal(size=(3, 4)).astype(np.float32), "steps": np.array(7, dtype=np.int64)}
    trained = {f"w{i}": _result({"w": base["w"] + rng.normal(size=(3, 4)).astype(np.float32),
                                 "steps": np.array(7, dtype=np.int64)}) for i in range(n)}
    return base, trained


def test_sign_flip_sends_its_own_update_reversed_and_scaled():
    base, trained = _round()
    sent = rp.Attack(rp.Protocol(), "sign_flip", ["w1"], 5, seed=0)(1, base, trained)
    own = trained["w1"].state["w"] - base["w"]
    np.testing.assert_allclose(sent["w1"].state["w"] - base["w"], -10.0 * own, rtol=1e-4, atol=1e-4)
    assert sent["w0"] is trained["w0"]                           # honest workers untouched
    assert sent["w1"].state["steps"] == trained["w1"].state["steps"]  # integer buffers are not shifted


def test_alie_sits_z_standard_deviations_above_the_honest_mean():
    base, trained = _round()
    attackers = ["w0", "w3"]
    sent = rp.Attack(rp.Protocol(), "alie", attackers, 5, seed=0)(1, base, trained)
    honest = np.stack([trained[w].state["w"] - base["w"] for w in ("w1", "w2", "w4")])
    expected = honest.mean(axis=0) + rp.alie_z(5, 2) * honest.std(axis=0)
    for w in attackers:
        np.testing.assert_allclose(sent[w].state["w"] - base["w"], expected, rtol=1e-4, atol=1e-5)


def test_noise_attack_is_an_update_of_the_stated_spread():
    base = {"w": np.zeros((200, 200), dtype=np.float32)}
    trained = {"w0": _result({"w": np.ones((200, 200), dtype=np.float32)})}
    sent = rp.Attack(rp.Protocol(), "noise", ["w0"], 1, seed=0)(1, base, trained)
    delta = sent["w0"].state["w"]
    assert abs(float(delta.std()) - rp.Protocol().noise_std) < 0.02
    assert abs(float(delta.mean())) < 0.02


def test_clean_and_label_flip_rounds_upload_what_was_trained():
    base, trained = _round()
    for kind in (rp.CLEAN, "label_flip"):
        assert rp.Attack(rp.Protocol(), kind, ["w1"], 5, seed=0)(1, base, trained) is trained


def test_the_harness_uploads_what_the_attack_sends():
    """A sign-flip of every worker drives the service's FedAvg to the reverse of the honest step."""
    p = replace(rp.quick_protocol(), workers=3, rounds=1)
    from experiments.harness import VirtualWorker
    from fedbroker.datasets import load_dataset, train_test_split

    train, test = train_test_split(load_dataset("digits"), test_fraction=0.2, seed=0)
    workers = [VirtualWorker(f"w{i}", train.x[i::3][:60], train.y[i::3][:60], 10) for i in range(3)]
    job = p.job("fedavg", 0)
    honest = simulate(job, workers, test, progress=False, metrics=lambda m, d: {})
    flipped = simulate(job, workers, test, progress=False, metrics=lambda m, d: {},
                       tamper=rp.Attack(p, "sign_flip", ["w0", "w1", "w2"], 3, seed=0))
    from fedbroker.job.spec import parse_job
    from fedbroker.model import initial_weights

    start = initial_weights(parse_job(job).model, seed=0)
    for name, w0 in start.items():
        np.testing.assert_allclose(flipped.final_state[name] - w0, -10.0 * (honest.final_state[name] - w0),
                                   rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("rule", sorted(set(rp.Protocol().rules) | set(rp.adaptive_protocol().rules)))
def test_every_rule_of_the_protocol_is_a_job_the_service_accepts(rule):
    from fedbroker.algorithms.catalogue import aggregation_settings
    from fedbroker.job.spec import parse_job

    p = rp.adaptive_protocol()
    aggregation_settings(parse_job(p.job(rule, 0)).aggregation)
    if rule.startswith(rp.GROUPS):  # the job is FedAvg; the rule over the group means must be the service's too
        assert p.aggregation(rule) == {"weighting": "fedavg"}
        section = {"weighting": "fedavg", **p.group_rule(rule)}
        aggregation_settings(parse_job({**p.job(rule, 0), "aggregation": section}).aggregation)


def test_a_discarded_update_is_one_the_rule_kept_under_a_tenth_of_its_share():
    verdicts = [Verdict(w, "median", kept, 1.0) for w, kept in (("w0", 0.0), ("w1", 0.09), ("w2", 0.5), ("w3", 1.2))]
    assert rp.discarded(verdicts, ["w0", "w2"]) == {"attackers": 1, "honest": 1, "flagged": 0}
    assert rp.discarded([], ["w0"]) == {"attackers": 0, "honest": 0, "flagged": 0}  # FedAvg judges nobody
    flagged = [Verdict("w2", "history_check", 1.0, 1.0, flagged=True), Verdict("w3", "history_check", 1.0, 1.0)]
    assert rp.discarded(flagged, ["w2"]) == {"attackers": 1, "honest": 0, "flagged": 1}  # excluded, whatever its share
