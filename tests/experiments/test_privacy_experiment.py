"""The privacy experiment's smoke run: its table has the protocol's shape, and the modes order as the noise says."""

from __future__ import annotations

import json

import numpy as np

from experiments import privacy_dp as pe
from experiments.privacy_sim import Noise, RunSpec, federated_dp_sgd, secure_sum, site_share
from fedbroker.secagg import skellam


def test_secure_sum_without_noise_is_the_plain_sum_of_the_rounded_shares_even_across_the_wrap():
    rng = np.random.default_rng(0)
    sums = [rng.normal(0.0, 50.0, size=200) for _ in range(4)]  # signed: negative levels wrap in the ring
    shares = [site_share(g, gamma=1000.0, variance=0.0, bits=24, rng=rng) for g in sums]
    out = secure_sum(shares, gamma=1000.0, bits=24)
    # 4 × |50·1000| stays inside the 24-bit signed range; stochastic rounding moves each share by < 1 level
    np.testing.assert_array_less(np.abs(out - np.sum(sums, axis=0)), 4 / 1000.0)


def test_quick_grid_has_the_protocol_shape_and_local_pays_for_n(tmp_path):
    protocol = pe.Protocol(datasets=("digits",), epsilons=(1.0,), sites=(20,), seeds=(0,), rounds=40, eval_every=20,
                           diagnostic=False)
    md = pe.run(protocol, out=str(tmp_path), jobs=1, progress=False)
    saved = json.loads((tmp_path / "privacy.json").read_text())
    assert (tmp_path / "privacy.png").stat().st_size > 0
    assert sorted((r["mode"], r["epsilon"]) for r in saved["runs"]) == [
        ("central", 1.0), ("distributed", 1.0), ("local", 1.0), ("none", None)]
    rows = [line for line in md.splitlines() if line.startswith("| digits | 20 | 1 |")]
    # task, N, ε, three modes, no noise, the two gaps: one row, every cell filled
    assert len(rows) == 1 and len(rows[0].strip("|").split("|")) == 9 and "—" not in rows[0]
    calibration = saved["calibration"]
    assert calibration["digits|20|distributed|1"]["epsilon"] <= 1.0 + 1e-6
    assert calibration["digits|20|central|1"]["epsilon"] <= 1.0 + 1e-6
    acc = {r["mode"]: r["accuracy"] for r in saved["runs"]}
    # ε = 1, N = 20: a local site adds the whole dose, so the sum carries 20× the variance of distributed's
    assert acc["local"] < acc["distributed"] - 0.10


def test_with_negligible_noise_every_mode_trains_the_no_noise_model():
    """Quantisation, Skellam shares, the ring sum and dequantisation leave the model as the plain sum does."""
    x, y, classes = pe.load("digits", seed=0, protocol=pe.Protocol())
    sites = [(x[i::4][:300], y[i::4][:300]) for i in range(4)]
    test = (x[1200:], y[1200:])
    spec = RunSpec(rounds=30, sample_rate=0.05, clip=1.0, lr=2.0, hidden=8, eval_every=30)
    r = skellam.choose(clip=1.0, noise_multiplier=1e-3, quorum=4, n_max=4, dim=64 * 8 + 8 + 8 * 10 + 10,
                       sample_rate=0.05, max_records=1200)
    acc = {mode: federated_dp_sgd(spec=spec, noise=Noise(mode, z=1e-3, gamma=r.scale, bits=r.bits), sites=sites,
                                  test=test, classes=classes, seed=0)["accuracy"]
           for mode in ("none", "central", "distributed", "local")}
    assert acc["none"] > 0.5  # it learnt something, so agreement is not agreement at chance
    assert max(acc.values()) - min(acc.values()) <= 0.01
