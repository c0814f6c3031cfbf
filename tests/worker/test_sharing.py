"""A site's releases before round 1 (worker/sharing.py, worker/feature_statistics.py): the Gaussian noise is
calibrated to the exact (ε, δ) condition, the statistics are clipped and rescaled as documented, unbiased,
exact at ε 0, drawn once per (range, data, ε, δ) and kept across restarts, and a request is answered in full
or refused, naming the setting, without spending ε."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import integrate
from scipy.stats import norm

from fedbroker.config import DPPolicy
from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.spec import parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.statistics_release import gaussian_delta, gaussian_sigma
from fedbroker.worker.feature_statistics import BadBounds, clipped_sums, feature_bounds, release_statistics
from fedbroker.worker.ledger import PrivacyLedger, source_digest
from fedbroker.worker.sharing import STATISTICS_DELTA_WITHOUT_DP, ShareRefused, Sharing

X = np.array([[-1.0, 0.5, 10.0], [0.0, 1.5, 2.0], [3.0, 1.0, 4.0], [1.0, 0.0, 6.0]], dtype=np.float32)
Y = np.array([0, 1, 1, 2])


def sharing(tmp_path: Path, *, x: np.ndarray = X, standardize: str = "federated", statistics_epsilon: float = 1.0,
            histogram_epsilon: float = 1.0, dp: DPPolicy | None = None, budget: float = 10.0,
            rng: np.random.Generator | None = None) -> Sharing:
    policy = dp if dp is not None else DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-6,
                                                epsilon_budget=budget)
    return Sharing(worker_id="site-a", categories=("clinic",), ledger=PrivacyLedger(str(tmp_path / "ledger.json")),
                   dp=policy if policy.enabled else None, histogram_epsilon=histogram_epsilon,
                   statistics_epsilon=statistics_epsilon, standardize=standardize, x=x, y=Y[: len(x)],
                   num_classes=3, rng=rng)


def ask(*, histogram: bool = False, statistics: bool = False, lower: tuple[float, ...] = (0.0,),
        upper: tuple[float, ...] = (4.0,), category: str = "clinic", job: str = "job-1") -> pb.ShareRequest:
    return pb.ShareRequest(job_id=job, category=category, histogram=histogram, feature_statistics=statistics,
                           lower=lower if statistics else (), upper=upper if statistics else ())


# ----- the Gaussian mechanism's calibration -----

@pytest.mark.parametrize("epsilon", [0.1, 0.5, 1.0, 3.0, 10.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-8])
def test_the_calibrated_sigma_meets_the_exact_condition_and_no_smaller_sigma_does(epsilon: float, delta: float) -> None:
    sensitivity = math.sqrt(2 * 64)
    sigma = gaussian_sigma(epsilon=epsilon, delta=delta, sensitivity=sensitivity)
    assert gaussian_delta(sigma, epsilon=epsilon, sensitivity=sensitivity) <= delta
    assert gaussian_delta(sigma * (1 - 1e-6), epsilon=epsilon, sensitivity=sensitivity) > delta
    classic = sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / epsilon
    if epsilon < 1:  # the textbook bound is valid there, and looser
        assert sigma < classic


def test_the_textbook_sigma_fails_the_exact_condition_above_epsilon_one() -> None:
    """Why the analytic mechanism: at ε 10 the classic σ gives a δ twice the one it claims."""
    classic = math.sqrt(2 * math.log(1.25 / 1e-5)) / 10.0
    assert gaussian_delta(classic, epsilon=10.0, sensitivity=1.0) > 2e-5
    assert gaussian_sigma(epsilon=10.0, delta=1e-5, sensitivity=1.0) > classic


@pytest.mark.parametrize("epsilon,sigma", [(0.5, 3.0), (1.0, 3.7), (4.0, 1.1)])
def test_the_exact_condition_is_the_hockey_stick_divergence_of_the_two_gaussians(epsilon: float, sigma: float) -> None:
    """δ(ε) = ∫ max(0, p(y) - e^ε q(y)) dy for p = N(0, σ²), q = N(Δ, σ²): computed by quadrature, independently
    of the closed form the calibration uses."""
    shift = 1.0
    def excess(y: float) -> float:
        return max(0.0, norm.pdf(y, 0.0, sigma) - math.exp(epsilon) * norm.pdf(y, shift, sigma))
    crossing = shift / 2 - epsilon * sigma**2 / shift  # p > e^ε q exactly below it
    numeric, _ = integrate.quad(excess, -60 * sigma, crossing, epsabs=1e-14, epsrel=1e-10, limit=400)
    assert gaussian_delta(sigma, epsilon=epsilon, sensitivity=shift) == pytest.approx(numeric, rel=1e-6, abs=1e-13)


def test_impossible_calibrations_are_refused() -> None:
    for bad in ({"epsilon": 0.0, "delta": 1e-5}, {"epsilon": 1.0, "delta": 0.0}, {"epsilon": math.inf, "delta": 1e-5}):
        with pytest.raises(ValueError, match="need ε > 0"):
            gaussian_sigma(sensitivity=1.0, **bad)


# ----- clipping, rescaling, bounds -----

def test_sums_are_of_the_clipped_values_rescaled_to_the_unit_interval() -> None:
    lower, upper = np.array([0.0, 0.0, 2.0]), np.array([2.0, 1.0, 6.0])
    u = np.array([[0.0, 0.5, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.5], [0.5, 0.0, 1.0]])  # by hand
    np.testing.assert_allclose(clipped_sums(X, lower, upper), np.concatenate([u.sum(0), (u * u).sum(0)]))


def test_one_bound_stands_for_every_feature_and_a_mismatch_is_named() -> None:
    low, high = feature_bounds([0.0], [1.0, 2.0, 3.0], 3)
    np.testing.assert_array_equal(low, [0, 0, 0])
    np.testing.assert_array_equal(high, [1, 2, 3])
    with pytest.raises(BadBounds, match="lower bounds hold 2 values; this site's samples have 3 features"):
        feature_bounds([0.0, 1.0], [5.0], 3)
    with pytest.raises(BadBounds, match=r"range for feature 1 is \[2, 1\]: upper must exceed lower"):
        feature_bounds([0.0, 2.0, 0.0], [1.0], 3)
    with pytest.raises(BadBounds, match="upper bounds must be finite"):
        feature_bounds([0.0], [math.nan], 3)
    with pytest.raises(BadBounds, match="lower bounds hold 0 values"):
        feature_bounds([], [1.0], 3)


# ----- the statistics release -----

def test_the_noised_sums_are_unbiased_with_the_calibrated_spread() -> None:
    rng = np.random.default_rng(7)
    exact = clipped_sums(X, np.zeros(3), np.full(3, 4.0))
    releases = [release_statistics(exact, epsilon=1.0, delta=1e-5, rng=rng) for _ in range(4000)]
    draws = np.stack([np.concatenate([r.sums, r.sq_sums]) for r in releases])
    sigma = gaussian_sigma(epsilon=1.0, delta=1e-5, sensitivity=math.sqrt(6))
    np.testing.assert_allclose(draws.mean(axis=0), exact, atol=5 * sigma / math.sqrt(len(draws)))
    np.testing.assert_allclose(draws.std(axis=0), sigma, rtol=0.05)
    mean_of_means = draws[:, :3].mean(axis=0) / len(X)  # the noised mean, in rescaled units
    np.testing.assert_allclose(mean_of_means, exact[:3] / len(X), atol=5 * sigma / len(X) / math.sqrt(len(draws)))


def test_exact_statistics_at_epsilon_zero_cost_nothing(tmp_path: Path) -> None:
    site = sharing(tmp_path, statistics_epsilon=0.0)
    reply = site.reply(ask(statistics=True))
    exact = clipped_sums(X, np.zeros(3), np.full(3, 4.0))
    assert not reply.refused and not reply.statistics_noised
    assert (reply.statistics_epsilon, reply.statistics_delta, reply.count) == (0.0, 0.0, 4)
    np.testing.assert_allclose(list(reply.feature_sum) + list(reply.feature_sq_sum), exact)
    assert site.ledger.total_epsilon() == 0.0 and not reply.label_histogram


def test_statistics_are_drawn_once_per_range_and_data_and_kept_across_restarts(tmp_path: Path) -> None:
    site = sharing(tmp_path)
    first = site.reply(ask(statistics=True))
    assert first.statistics_noised and first.statistics_epsilon == 1.0 and first.statistics_delta == 1e-6
    assert site.ledger.total_epsilon() == pytest.approx(1.0)
    again = site.reply(ask(statistics=True, lower=(0.0, 0.0, 0.0), upper=(4.0, 4.0, 4.0), job="job-2"))
    assert list(again.feature_sum) == list(first.feature_sum)  # the same range spelt out: the kept draw
    assert site.ledger.total_epsilon() == pytest.approx(1.0)
    restarted = sharing(tmp_path)
    kept = restarted.reply(ask(statistics=True))
    assert list(kept.feature_sq_sum) == list(first.feature_sq_sum) and restarted.ledger.total_epsilon() == 1.0
    other_range = restarted.reply(ask(statistics=True, upper=(8.0,)))
    assert list(other_range.feature_sum) != list(first.feature_sum)
    assert restarted.ledger.total_epsilon() == pytest.approx(2.0)
    changed = sharing(tmp_path, x=X[:3])  # the data changed: a new draw, charged again
    assert changed.reply(ask(statistics=True)).count == 3 and changed.ledger.total_epsilon() == pytest.approx(3.0)
    doc = json.loads((tmp_path / "ledger.json").read_text(encoding="utf-8"))
    stats = [r for name, r in doc["releases"].items() if name.startswith("feature_statistics:")]
    assert len(stats) == 2 and all(r["delta"] == 1e-6 and len(r["value"]) == 6 for r in stats)


def test_without_dp_the_statistics_use_a_fixed_delta_and_say_so(tmp_path: Path) -> None:
    site = sharing(tmp_path, dp=DPPolicy(enabled=False))
    assert site.reply(ask(statistics=True)).statistics_delta == STATISTICS_DELTA_WITHOUT_DP
    assert "DP is off here, so δ is fixed" in site.summary() and "DP off" in site.summary()


# ----- refusals -----

def test_a_request_the_budget_cannot_pay_in_full_is_refused_and_draws_nothing(tmp_path: Path) -> None:
    site = sharing(tmp_path, budget=1.5)  # either release alone fits, both do not
    reply = site.reply(ask(histogram=True, statistics=True))
    assert reply.refused and not reply.label_histogram and not reply.feature_sum
    assert "above the owner's budget worker.dp.epsilon_budget 1.5" in reply.reason
    assert site.ledger.total_epsilon() == 0.0 and site.ledger.release("label_histogram") is None
    assert not site.reply(ask(histogram=True)).refused and site.ledger.total_epsilon() == pytest.approx(1.0)


@pytest.mark.parametrize("request_, reason", [
    (ask(statistics=True, lower=(0.0, 1.0)), "lower bounds hold 2 values; this site's samples have 3 features"),
    (ask(statistics=True, lower=(5.0,)), "upper must exceed lower"),
    (ask(histogram=True, category="radiology"), "category 'radiology' is not one this worker serves"),
])
def test_a_request_that_does_not_fit_is_refused_with_its_reason(tmp_path: Path, request_: pb.ShareRequest,
                                                                reason: str) -> None:
    site = sharing(tmp_path)
    reply = site.reply(request_)
    assert reply.refused and reason in reply.reason and reply.job_id == "job-1" and reply.worker_id == "site-a"
    assert site.ledger.total_epsilon() == 0.0


def test_a_site_that_standardises_its_own_data_refuses_statistics_but_shares_its_histogram(tmp_path: Path) -> None:
    site = sharing(tmp_path, standardize="site")
    refused = site.reply(ask(histogram=True, statistics=True))
    assert refused.refused and "worker.data.standardize is 'site'" in refused.reason
    assert not refused.label_histogram and site.ledger.total_epsilon() == 0.0
    assert not site.reply(ask(histogram=True)).refused
    assert "feature statistics never (data.standardize: site)" in site.summary()


def test_nothing_asked_nothing_shared(tmp_path: Path) -> None:
    site = sharing(tmp_path)
    reply = site.reply(ask())
    assert not reply.refused and not reply.label_histogram and not reply.feature_sum and reply.count == 0
    assert site.ledger.total_epsilon() == 0.0
    site.note_sent(reply)
    assert site.ledger.shared() == []


def test_bad_epsilons_are_refused_together_naming_each_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigErrors) as info:
        sharing(tmp_path, histogram_epsilon=-1.0, statistics_epsilon=math.inf)
    assert [e.field for e in info.value.errors] == ["worker.histogram_epsilon", "worker.statistics_epsilon"]


def test_noise_wider_than_any_coordinator_takes_is_refused_at_start_not_spent(tmp_path: Path) -> None:
    """A coordinator excludes statistics noised below ε 0.1 or δ 1e-10 (fedbroker.statistics_release): the site is
    told at start, before any ε is spent on a release nobody would use."""
    with pytest.raises(ConfigError, match=r"must be 0 \(exact\) or at least 0.1, got 0.05"):
        sharing(tmp_path, statistics_epsilon=0.05)
    tiny = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-12, epsilon_budget=10.0)
    with pytest.raises(ConfigError, match=r"is 1e-12, below 1e-10") as info:
        sharing(tmp_path, dp=tiny)
    assert info.value.field == "worker.dp.delta"
    assert sharing(tmp_path, dp=tiny, standardize="site").statistics_delta == 1e-12   # it never shares statistics
    assert sharing(tmp_path, dp=tiny, statistics_epsilon=0.0).statistics_epsilon == 0.0  # exact ones: no δ
    assert not PrivacyLedger(str(tmp_path / "ledger.json")).total_epsilon()


# ----- the model's preprocessing against data.standardize -----

PLAIN = parse_model({"input_shape": [3], "layers": [{"type": "Linear", "in_features": 3, "out_features": 3}]})
STANDARDISED = parse_model({"input_shape": [3], "layers": [{"type": "standardize", "mean": [1, 2, 3], "std": 2},
                                                            {"type": "Linear", "in_features": 3, "out_features": 3}]})


def test_each_policy_takes_only_the_models_its_data_fits(tmp_path: Path) -> None:
    sharing(tmp_path / "none", standardize="none").check_model(PLAIN)
    sharing(tmp_path / "none", standardize="none").check_model(STANDARDISED)
    sharing(tmp_path / "site", standardize="site").check_model(PLAIN)
    with pytest.raises(ShareRefused, match="'site': .* standardises its input again"):
        sharing(tmp_path / "site", standardize="site").check_model(STANDARDISED)
    sharing(tmp_path / "fed", standardize="federated").check_model(STANDARDISED)
    with pytest.raises(ShareRefused, match="'federated': .* this job's model starts with Linear"):
        sharing(tmp_path / "fed", standardize="federated").check_model(PLAIN)


# ----- the ledger's releases -----

def test_float_releases_and_their_delta_round_trip_and_older_ledgers_still_load(tmp_path: Path) -> None:
    path = tmp_path / "ledger.json"
    old = {"version": 1, "jobs": {}, "releases": {"label_histogram": {  # as ledgers were written before floats
        "epsilon": 0.5, "draw_epsilon": 0.5, "value": [3, 0, 5], "source_sha256": source_digest([2, 1, 5])}}}
    path.write_text(json.dumps(old), encoding="utf-8")
    ledger = PrivacyLedger(str(path))
    kept = ledger.release("label_histogram")
    assert kept is not None and kept.value == [3, 0, 5] and kept.delta == 0.0
    assert kept.source_sha256 == hashlib.sha256(b"[2, 1, 5]").hexdigest()  # the digest kept its form
    ledger.record_release("feature_statistics:x", value=[0.25, -1.5], epsilon=1.0, delta=1e-6, source=[1.0, 2.0])
    again = PrivacyLedger(str(path)).release("feature_statistics:x")
    assert again is not None and again.value == [0.25, -1.5] and again.delta == 1e-6
    assert PrivacyLedger(str(path)).total_epsilon() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="must be a finite number"):
        ledger.record_release("bad", value=[math.nan], epsilon=1.0, source=[1])
