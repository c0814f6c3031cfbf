"""Distributed DP's arithmetic: Skellam shares add up to one dose, the accounting matches its bounds and an
independent accountant where it should, the ring carries signed sums, and the choices keep their promises."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from scipy import stats

from fedbroker import privacy
from fedbroker.errors import ConfigError
from fedbroker.secagg import skellam as sk

DELTA = 1e-5


def _round(**kw: object) -> sk.DDPRound:
    args: dict[str, object] = {"clip": 1.0, "noise_multiplier": 1.0, "quorum": 4, "n_max": 8, "dim": 1000,
                               "sample_rate": 0.01, "max_records": 10_000}
    args.update(kw)
    return sk.choose(**args)  # type: ignore[arg-type]


# --- noise ---------------------------------------------------------------------------------------------------


def test_shares_of_a_quorum_sum_to_one_dose_of_skellam_noise() -> None:
    """n shares of variance μ/n sum to Skellam of variance μ: moments and the whole distribution (DKW)."""
    rng = np.random.default_rng(20261128)
    mu, n, m = 40.0, 5, 200_000
    total = np.sum([sk.noise_share(rng, size=m, variance=mu / n) for _ in range(n)], axis=0)
    assert total.dtype == np.int64
    # the sample variance of 200k draws has relative std ≈ √(2/m) ≈ 0.3%: 5% is over 15 standard deviations
    assert abs(float(total.var()) / mu - 1.0) < 0.05
    assert abs(float(total.mean())) < 6 * math.sqrt(mu / m)
    # DKW: P(sup |F_m − F| > 0.01) ≤ 2·exp(−2·m·0.01²) = 8e-18; the law is exactly Sk(μ/2, μ/2)
    ks = np.arange(-60, 61)
    empirical = np.searchsorted(np.sort(total), ks, side="right") / m
    assert float(np.abs(empirical - stats.skellam.cdf(ks, mu / 2, mu / 2)).max()) < 0.01


def test_a_zero_variance_share_is_zero_and_a_negative_one_is_refused() -> None:
    assert not sk.noise_share(np.random.default_rng(0), size=7, variance=0.0).any()
    with pytest.raises(ConfigError) as err:
        sk.noise_share(np.random.default_rng(0), size=7, variance=-1.0)
    assert err.value.field == "variance"


def test_quantise_is_unbiased_and_dequantise_inverts_the_scale() -> None:
    rng = np.random.default_rng(7)
    values = np.array([0.123, -0.456, 2.0, -3.75])
    draws = np.stack([sk.quantise(values, scale=10.0, rng=rng) for _ in range(20_000)])
    assert draws.dtype == np.int64
    assert np.all((draws == np.floor(values * 10)) | (draws == np.ceil(values * 10)))  # one of the two neighbours
    # each draw's rounding error lies in (−1, 1): the mean of 20k has std < 1/(2·√20000) = 0.0035 levels
    np.testing.assert_allclose(draws.mean(axis=0) / 10.0, values, atol=0.03 / 10)
    np.testing.assert_array_equal(sk.dequantise(np.array([-37, 5]), scale=10.0), [-3.7, 0.5])
    with pytest.raises(ConfigError) as err:
        sk.quantise(np.array([np.nan]), scale=1.0, rng=rng)
    assert err.value.field == "values"


def test_sensitivities_bound_every_rounding_of_a_clipped_record() -> None:
    assert sk.sensitivities(clip=2.0, scale=3.0, dim=16) == (40.0, 10.0)  # l2 = 6 + √16; l1 = min(4·10, 10²)
    rng = np.random.default_rng(11)
    l1, l2 = sk.sensitivities(clip=1.0, scale=3.0, dim=9)
    records = rng.normal(size=(5000, 9))
    records /= np.linalg.norm(records, axis=1, keepdims=True)  # on the clip sphere, the worst case
    rounded = sk.quantise(records, scale=3.0, rng=rng)
    assert float(np.linalg.norm(rounded, axis=1).max()) < l2
    assert float(np.abs(rounded).sum(axis=1).max()) <= l1


# --- the RDP of the Skellam mechanism and of its subsampling ----------------------------------------------------


def test_skellam_rdp_is_above_the_gaussians_and_approaches_it_as_mu_grows() -> None:
    orders = np.arange(2, 65)
    l1, l2 = sk.sensitivities(clip=1.0, scale=50.0, dim=100)
    gaps = []
    for mu in (1e2, 1e3, 1e4, 1e5, 1e6):
        gauss = orders * l2**2 / (2 * mu)
        rdp = sk.skellam_rdp(orders, mu=mu, l1=l1, l2=l2)
        assert np.all(rdp >= gauss)
        gaps.append(float(np.max(rdp / gauss - 1.0)))
    assert gaps[0] > 1e-3                                    # discreteness costs something at small μ ...
    assert all(a > b for a, b in itertools.pairwise(gaps))  # ... less as μ grows (about 1/μ) ...
    assert gaps[-1] < 2e-6                                   # ... and nothing in the limit
    assert np.all(np.isinf(sk.skellam_rdp(orders, mu=0.0, l1=l1, l2=l2)))


def test_subsampling_is_the_identity_at_q_1_and_grows_with_q() -> None:
    l1, l2 = sk.sensitivities(clip=1.0, scale=100.0, dim=100)
    plain = sk.skellam_rdp(sk.ORDERS, mu=2e4, l1=l1, l2=l2)

    def curve(a: int) -> float:
        return float(sk.skellam_rdp(np.array([a]), mu=2e4, l1=l1, l2=l2)[0])

    np.testing.assert_array_equal(sk.poisson_subsampled_rdp(curve, q=1.0, orders=sk.ORDERS), plain)
    previous = np.zeros(len(sk.ORDERS))
    for q in (1e-4, 1e-3, 0.01, 0.1, 0.5, 0.9):
        rdp = sk.poisson_subsampled_rdp(curve, q=q, orders=sk.ORDERS)
        assert np.all(np.isfinite(rdp)) and np.all(rdp >= previous) and np.all(rdp <= plain)
        previous = rdp
    assert previous[0] < plain[0]  # q = 0.9 still amplifies at α = 2


def test_large_mu_epsilon_agrees_with_the_sampled_gaussian_accountant() -> None:
    """At large μ the Skellam sum is a Gaussian one; its ε is within 5% above fedbroker.privacy's (Opacus's)."""
    z, q, steps = 1.0, 0.001, 2000
    round_ = _round(noise_multiplier=z, sample_rate=q, dim=10_000, rounding_share=0.001)
    ours = sk.distributed_epsilon(round=round_, total_variance=round_.full_variance, rounds=steps, delta=DELTA)
    theirs = privacy.epsilon_of([(z, q, steps)], delta=DELTA)
    assert theirs <= ours <= 1.05 * theirs


def test_rdp_to_epsilon_is_opacuss_conversion() -> None:
    orders = np.array([2.0, 8.0, 32.0])
    rdp = np.array([0.5, 1.0, 3.0])
    expected = [r - (math.log(DELTA) + math.log(a)) / (a - 1) + math.log((a - 1) / a) for a, r in zip(orders, rdp)]
    eps, order = sk.rdp_to_epsilon(orders, rdp, delta=DELTA)
    assert eps == pytest.approx(min(expected)) and order == orders[int(np.argmin(expected))]


# --- the ring ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 16, 31, 32, 33, 48, 64])
def test_signed_sums_round_trip_through_the_ring_and_wrap_only_past_its_half_range(bits: int) -> None:
    half = 1 << (bits - 1)
    parts = [np.array([-3, 5, half - 10, -half + 4, 0]), np.array([-4, -9, 9, -4, -1]), np.array([2, 1, 0, 0, 0])]
    ring = [sk.to_ring(p, bits=bits) for p in parts]
    assert ring[0].dtype == (np.uint32 if bits <= 32 else np.uint64)
    total = ring[0] + ring[1] + ring[2]  # the dtype's own arithmetic, mod 2^32 or 2^64
    np.testing.assert_array_equal(sk.from_ring(total, bits=bits), [-5, -3, half - 1, -half, -1])
    over = sk.to_ring(np.array([half - 1]), bits=bits) + sk.to_ring(np.array([1]), bits=bits)
    assert int(sk.from_ring(over, bits=bits)[0]) == -half  # one past the top wraps to the bottom


# --- choosing a round --------------------------------------------------------------------------------------------


def test_choose_keeps_the_rounding_share_and_grows_bits_with_sites_and_records() -> None:
    base = _round()
    assert base.rounding_share == pytest.approx(0.01)
    assert base.full_variance == pytest.approx((base.scale * base.noise_multiplier * base.clip) ** 2)
    assert base.share_variance == pytest.approx(base.full_variance / base.quorum)
    assert base.wrap_probability <= 1e-9
    assert _round(max_records=10_000_000).bits > base.bits
    assert _round(n_max=10_000, quorum=4, noise_multiplier=50.0, max_records=1).bits > \
        _round(n_max=4, quorum=4, noise_multiplier=50.0, max_records=1).bits
    assert "ring" in base.describe() and str(base.bits) in base.describe()
    assert sk.DDPRound.from_dict(json.loads(json.dumps(base.to_dict()))) == base  # travels as JSON
    with pytest.raises(ConfigError) as err:
        sk.DDPRound.from_dict({**base.to_dict(), "bits": 32.5})
    assert err.value.field == "ddp_round.bits"


def test_the_wrap_bound_is_above_the_exact_skellam_tail() -> None:
    for bits, dim, signal, var in [(9, 4, 3.0, 3200.0), (12, 1000, 500.0, 4e4), (20, 10**6, 1e5, 1e8)]:
        x = 2.0 ** (bits - 1) - 1 - signal
        exact_one = 2 * stats.skellam.sf(math.ceil(x) - 1, var / 2, var / 2)  # P(|N| ≥ x)
        exact = -math.expm1(dim * math.log1p(-exact_one))
        assert exact <= sk.wrap_bound(bits=bits, dim=dim, signal=signal, total_variance=var) < 1.0


def test_a_chosen_ring_wraps_no_more_often_than_stated() -> None:
    """8 bits on purpose, so the stated bound (≈ 0.75) is not vacuous and sums do wrap now and then."""
    round_ = sk.choose(clip=1.0, noise_multiplier=20.0, quorum=2, n_max=2, dim=4, sample_rate=1.0, max_records=1,
                       bits=8, wrap_target=0.9, rounding_share=1.0)
    rng = np.random.default_rng(5)
    trials, wraps = 4000, 0
    for _ in range(trials):
        record = sk.quantise(np.array([0.5, -0.5, 0.5, 0.5]), scale=round_.scale, rng=rng)  # norm 1 = C
        shares = [sk.noise_share(rng, size=4, variance=round_.full_variance) for _ in range(2)]
        true = record + shares[0] + shares[1]
        ring = sk.to_ring(record, bits=8) + sk.to_ring(shares[0], bits=8) + sk.to_ring(shares[1], bits=8)
        wraps += bool(np.any(sk.from_ring(ring, bits=8) != true))
    assert 0 < wraps / trials <= round_.wrap_probability


def test_share_variance_follows_the_mode_and_meets_the_floor_monotonically() -> None:
    round_ = _round(sample_rate=0.05)
    rounds = 50
    assert sk.share_variance_for(mode="local", round=round_, local_floor_epsilon=0.0, rounds=rounds,
                                 delta=DELTA) == round_.full_variance
    base = sk.share_variance_for(mode="distributed", round=round_, local_floor_epsilon=0.0, rounds=rounds,
                                 delta=DELTA)
    assert base == round_.share_variance
    shares = []
    for floor in (8.0, 4.0, 2.0, 1.0):
        mu_i = sk.share_variance_for(mode="distributed", round=round_, local_floor_epsilon=floor, rounds=rounds,
                                     delta=DELTA)
        assert mu_i >= base
        assert sk.local_floor_epsilon(round=round_, share_variance=mu_i, rounds=rounds, delta=DELTA) <= floor
        shares.append(mu_i)
    assert shares == sorted(shares) and shares[-1] > shares[0] > base  # stricter floor, more noise
    # the search stops at the least noise that meets the floor: 0.1% less misses it
    eps_below = sk.local_floor_epsilon(round=round_, share_variance=shares[-1] * 0.999, rounds=rounds, delta=DELTA)
    assert eps_below > 1.0


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"clip": 0.0}, "privacy.distributed.clip"),
    ({"noise_multiplier": -1.0}, "privacy.distributed.noise_multiplier"),
    ({"quorum": 0}, "privacy.distributed.quorum"),
    ({"n_max": 2, "quorum": 4}, "n_max"),
    ({"dim": 0}, "dim"),
    ({"sample_rate": 1.5}, "privacy.distributed.sample_rate"),
    ({"max_records": 0}, "max_records"),
    ({"bits": 65}, "bits"),
    ({"bits": 8}, "bits"),                     # 10k records of γC ≈ 3000 levels cannot fit 8 bits
    ({"max_records": 10**16}, "max_records"),  # nor any ring
    ({"wrap_target": 0.0}, "wrap_target"),
    ({"rounding_share": 2.0}, "rounding_share"),
])
def test_bad_settings_are_refused_naming_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        _round(**kwargs)
    assert err.value.field == field


def test_bad_modes_floors_and_deltas_are_refused_naming_the_field() -> None:
    round_ = _round()
    cases: list[tuple[dict[str, object], str]] = [
        ({"mode": "central"}, "dp.mode"), ({"local_floor_epsilon": -1.0}, "dp.local_floor_epsilon"),
        ({"local_floor_epsilon": 1e-9}, "dp.local_floor_epsilon"), ({"mode": ["local"]}, "dp.mode"),
        ({"rounds": -1}, "rounds"), ({"delta": 0.0}, "delta")]
    for kwargs, field in cases:
        args: dict[str, object] = {"mode": "distributed", "round": round_, "local_floor_epsilon": 1.0,
                                   "rounds": 10, "delta": DELTA}
        args.update(kwargs)
        with pytest.raises(ConfigError) as err:
            sk.share_variance_for(**args)  # type: ignore[arg-type]
        assert err.value.field == field
    with pytest.raises(ConfigError) as err:
        sk.epsilon_after(round=round_, variance=1.0, steps=1, delta=2.0)
    assert err.value.field == "delta"
    with pytest.raises(ConfigError) as err:
        sk.to_ring(np.array([1]), bits=4)
    assert err.value.field == "bits"
