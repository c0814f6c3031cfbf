"""Federated evaluation's rules and settings: which rounds are scored, the count-weighted combination, the best
round, early stopping, the submission warning, the job's and the worker's settings (every problem, full paths),
and each simulated site's own slice of the held-out split."""

from __future__ import annotations

import numpy as np
import pytest

from fedbroker.config import PartitionSection, load_config
from fedbroker.datasets import load_dataset, train_test_split
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.federated_evaluation import (
    Scored,
    SiteScore,
    best_round,
    check_policy,
    combine,
    due,
    early_stop,
    submission_warnings,
)
from fedbroker.job.spec import EvaluationConfig, parse_job
from fedbroker.worker.evaluation import held_out_slice
from tests.evaluation.harness import job


def test_every_kth_round_and_the_last_are_scored_and_every_0_scores_none() -> None:
    assert [n for n in range(1, 8) if due(EvaluationConfig(every=3), n, 7)] == [3, 6, 7]
    assert [n for n in range(1, 4) if due(EvaluationConfig(every=1), n, 3)] == [1, 2, 3]
    assert not any(due(EvaluationConfig(every=0), n, 5) for n in range(1, 6))


def test_the_federated_score_weighs_each_site_by_its_count() -> None:
    combined = combine([SiteScore(0.5, 1.0, 10), SiteScore(1.0, 0.2, 30), SiteScore(0.0, 9.0, 0)])
    assert combined is not None
    assert combined.accuracy == pytest.approx((0.5 * 10 + 1.0 * 30) / 40)
    assert combined.loss == pytest.approx((1.0 * 10 + 0.2 * 30) / 40)
    assert (combined.num_samples, combined.sites) == (40, 2)  # a site with no samples has no weight
    assert combine([]) is None


def test_the_best_round_is_by_federated_accuracy_when_any_else_central_earliest_of_equals() -> None:
    rounds = [Scored(1, None, 0.9), Scored(2, 0.6, 0.7), Scored(3, 0.8, 0.6), Scored(4, 0.8, 0.95)]
    assert best_round(rounds) == (3, 0.8, "federated")
    assert best_round([Scored(1, None, 0.4), Scored(2, None, 0.7)]) == (2, 0.7, "central")
    assert best_round([Scored(1, None, None)]) is None


def test_patience_counts_scored_rounds_after_the_best_that_did_no_better() -> None:
    rounds = [Scored(1, 0.5, None), Scored(2, 0.7, None), Scored(3, 0.7, None), Scored(4, None, None)]
    assert early_stop(rounds, 2) is None  # one scored round after the best (4 has no score)
    stop = early_stop([*rounds, Scored(5, 0.69, None)], 2)
    assert stop is not None and (stop.best_round, stop.since, stop.basis) == (2, 2, "federated")
    assert "after round 2 (0.7000" in stop.reason()
    assert early_stop([*rounds, Scored(5, 0.71, None)], 2) is None  # a better one restarts the count
    assert early_stop([Scored(1, None, 0.3), Scored(2, None, 0.2)], 1) is not None  # central without sites' scores
    assert early_stop([*rounds, Scored(5, 0.1, None)], 0) is None  # patience 0: never


def test_a_job_on_own_data_with_no_evaluation_at_all_is_warned() -> None:
    assert submission_warnings(parse_job(job(evaluation={"every": 0})))
    assert not submission_warnings(parse_job(job(evaluation={"every": 0, "dataset": "digits"})))
    assert not submission_warnings(parse_job(job(evaluation={"every": 2})))


def test_the_jobs_evaluation_settings_are_checked_all_at_once_with_full_paths() -> None:
    with pytest.raises(ConfigErrors) as info:
        parse_job(job(evaluation={"every": -1, "sites": "everyone", "patience": 1.5}))
    fields = {e.field for e in info.value.errors}
    assert fields == {"evaluation.every", "evaluation.sites", "evaluation.patience"}
    assert "'participants' or 'category'" in str(info.value)
    with pytest.raises(ConfigError, match="evaluation.every"):
        parse_job(job(evaluation={"every": True}))
    spec = parse_job(job(evaluation={"every": 3, "sites": "category", "patience": 4}))
    assert (spec.evaluation.every, spec.evaluation.sites, spec.evaluation.patience) == (3, "category", 4)
    assert EvaluationConfig() == EvaluationConfig(every=1, sites="participants", patience=0)


def test_the_worker_policy_is_allow_or_deny() -> None:
    assert load_config(environ={"FEDBROKER__WORKER__EVALUATION": "deny"}).worker.evaluation == "deny"
    assert check_policy("allow") == "allow"
    with pytest.raises(ConfigError, match=r"worker\.evaluation.*'allow' or 'deny'.*'maybe'"):
        check_policy("maybe")


def test_simulated_sites_score_disjoint_slices_of_the_held_out_split_that_cover_it() -> None:
    test = train_test_split(load_dataset("digits"), test_fraction=0.2, seed=0)[1]
    for scheme in ("iid", "dirichlet", "classes"):
        slices = [held_out_slice(test, PartitionSection(scheme=scheme, num_clients=4, client_index=i, seed=3))
                  for i in range(4)]
        assert all(not why for _, _, why in slices)
        assert sum(len(y) for _, y, _ in slices) == len(test.y)
        seen = np.concatenate([x.reshape(len(x), -1) for x, _, _ in slices])
        assert len(np.unique(seen, axis=0)) == len(np.unique(test.x.reshape(len(test.x), -1), axis=0))
    whole = held_out_slice(test, PartitionSection())
    assert whole[0] is test.x and not whole[2]
    empty = held_out_slice(test, PartitionSection(scheme="classes", num_clients=200, classes_per_client=2))
    assert len(empty[1]) == 0 and "cannot be shared out" in empty[2]


def test_the_jobs_evaluation_score_is_the_headline_and_its_direction_decides_best_and_patience() -> None:
    from fedbroker.job.task import TaskConfig
    from fedbroker.tasks.scores import batch_sums

    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 80)
    probs = np.stack([1 - rng.random(80) * 0.5 - 0.3 * y, np.zeros(80)], axis=1)
    probs[:, 1] = 1 - probs[:, 0]
    sites = [SiteScore(0.0, 0.0, 40, batch_sums(TaskConfig(), probs[i], y[i], 4.0)) for i in (slice(0, 40),
                                                                                            slice(40, 80))]
    made = combine(sites, score="ap")
    assert made is not None and made.metric == "ap" and made.accuracy == made.scores["ap/1"]
    plain = combine(sites)
    assert plain is not None and plain.metric == "accuracy"
    losses = [Scored(1, 0.4, None), Scored(2, 0.3, None), Scored(3, 0.35, None), Scored(4, 0.32, None)]
    stop = early_stop(losses, 2, score="loss")                                      # lower is better
    assert stop is not None and (stop.best_round, stop.metric) == (2, "loss") and "no better federated loss" in \
        stop.reason()
    higher = early_stop(losses, 2, score="auroc")                                  # higher is better
    assert higher is not None and higher.best_round == 1
