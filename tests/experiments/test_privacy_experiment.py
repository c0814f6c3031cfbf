"""The privacy experiment's smoke run: its table has the protocol's shape, and the modes order as the noise says."""

from __future__ import annotations

import json
import warnings

import numpy as np

from experiments import privacy_dp as pe
from experiments.privacy_sim import secure_sum, site_share


def test_secure_sum_without_noise_is_the_plain_sum_of_the_rounded_shares_even_across_the_wrap():
    rng = np.random.default_rng(0)
    sums = [rng.normal(0.0, 50.0, size=200) for _ in range(4)]  # signed: negative levels wrap in the ring
    shares = [site_share(g, gamma=1000.0, variance=0.0, bits=24, rng=rng) for g in sums]
    out = secure_sum(shares, gamma=1000.0, bits=24)
    # 4 × |50·1000| stays inside the 24-bit signed range; stochastic rounding moves each share by < 1 level
    np.testing.assert_array_less(np.abs(out - np.sum(sums, axis=0)), 4 / 1000.0)


def test_quick_grid_has_the_protocol_shape_and_noise_orders_the_modes(tmp_path):
    protocol = pe.Protocol(datasets=("digits",), epsilons=(1.0, 1000.0), sites=(20,), seeds=(0,), rounds=40,
                           eval_every=20, diagnostic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's "largest alpha" note at ε = 1000
        md = pe.run(protocol, out=str(tmp_path), jobs=1, progress=False)
    saved = json.loads((tmp_path / "privacy.json").read_text())
    assert (tmp_path / "privacy.png").stat().st_size > 0
    assert len(saved["runs"]) == 1 + 2 * 3  # the no-noise reference + ε × modes
    rows = [line for line in md.splitlines() if line.startswith("| digits | 20 |")]
    assert [r.split("|")[3].strip() for r in rows[:2]] == ["1", "1000"]
    assert rows[0].count("|") == len(("task", "N", "ε", "central", "distributed", "local", "no noise", "d-c",
                                      "d-l")) + 1
    acc = {(r["mode"], r["epsilon"]): r["accuracy"] for r in saved["runs"]}
    # ε = 1000: noise is negligible in every mode, so they agree (the ring sum and dequantisation are right)
    assert max(acc[(m, 1000.0)] for m in pe.MODES) - min(acc[(m, 1000.0)] for m in pe.MODES) < 0.03
    # ε = 1, N = 20: a local site adds the whole dose, so the sum carries 20× the variance of distributed's
    assert acc[("local", 1.0)] < acc[("distributed", 1.0)] - 0.10
