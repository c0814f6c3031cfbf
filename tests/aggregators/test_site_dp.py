"""Site-level DP-FedAvg (`aggregators.site_dp`, privacy.site): the clip bounds every site, the noise has the
stated std, adaptive clipping finds the target quantile, the noise is unpredictable in production, the clip
survives a restart, and the settings that break the sensitivity argument are refused naming their field."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from fedbroker.aggregators import site_dp
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.app.round_notes import robust_note
from fedbroker.errors import ConfigError
from fedbroker.job.privacy import SiteDP
from fedbroker.job.settings import sections_settings
from fedbroker.job.spec import parse_job, parse_model
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc import codec

SPEC = parse_model({"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 2}]})
SITES = ["w1", "w2", "w3"]


def weights(value: float) -> dict[str, np.ndarray]:
    return {"0.weight": np.full((2, 4), value, np.float32), "0.bias": np.full(2, value, np.float32)}


def flat(state: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([state["0.weight"].ravel(), state["0.bias"].ravel()]).astype(np.float64)


def stream(tensors, *, rnd=1, worker="w1", n=10):
    header = pb.UpdateHeader(job_id="j", round=rnd, worker_id=worker, num_samples=n,
                             tensors=codec.tensor_specs(tensors))
    return codec.stream_messages(pb.UpdateChunk, header, tensors, chunk_bytes=64)


def site_settings(*, weighting: str = "uniform", robust: str = "none", selection: str = "all",
                  **site: object) -> pb.JobSettings:
    message = sections_settings("j", aggregation={"alignment": "none", "weighting": weighting,
                                                  "selection": selection, "robust": robust})
    values = {"enabled": True, "clipping": "fixed", "noise_multiplier": 1.0, "clip_norm": 1.0,
              "target_quantile": 0.5, "clip_lr": 0.2, "count_noise_multiplier": 0.0, **site}
    message.privacy.site.CopyFrom(pb.SiteDPSettings(**values))
    return message


def book_with(tmp: Path | None = None, *, seed: int | None = 7, **site: object) -> RoundBook:
    book = RoundBook(max_update_bytes=100_000, clock=lambda: 1000.0, spool_dir=tmp, site_dp_seed=seed)
    book.installed.install(site_settings(**site))
    book.put_global("j", 1, SPEC.to_json(), weights(0.0))
    book.open_round("j", 1, SITES, deadline=2000.0, seed=0)
    return book


def close_with(book: RoundBook, values: dict[str, float], rnd: int = 1) -> np.ndarray:
    for worker, value in values.items():
        book.receive_update(stream(weights(value), rnd=rnd, worker=worker))
    book.close("j", rnd)
    return flat(book.global_model("j")[2])


# ----- the pure module -----

def test_a_clipped_update_never_exceeds_the_clip_and_the_noise_std_is_z_s_over_n():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(50, 30)) * rng.lognormal(0, 3, size=(50, 1))
    clipped, norms = site_dp.clip_rows(rows, 0.7)
    assert np.all(np.linalg.norm(clipped, axis=1) <= 0.7 * (1 + 1e-12))
    small = norms <= 0.7
    np.testing.assert_array_equal(clipped[small], rows[small])  # scaled, never dropped: the small ones untouched
    # noise only (zero updates): the mean's per-coordinate std is z·S/n with n the sites asked
    site = SiteDP(enabled=True, noise_multiplier=1.3, clip_norm=0.7)
    d, asked = 200_000, {w: 1.0 for w in ("a", "b", "c", "d")}
    out = site_dp.aggregate(np.zeros((2, d)), ["a", "b"], weights=asked, site=site, clip=0.7,
                            rng=np.random.default_rng(1))
    expected = 1.3 * 0.7 / 4
    assert out.stats["site_dp_noise_std"] == pytest.approx(expected)
    assert abs(out.delta.std() / expected - 1) < 0.02  # relative error of the estimate ≈ 1/sqrt(2d) = 0.16%
    assert abs(out.delta.mean()) < 5 * expected / math.sqrt(d)


def test_adaptive_clipping_converges_to_the_target_quantile_of_the_norms():
    rng = np.random.default_rng(3)
    site = SiteDP(enabled=True, clipping="adaptive", noise_multiplier=1.0, clip_norm=0.01, target_quantile=0.3,
                  clip_lr=0.2)
    workers = [f"s{i}" for i in range(200)]
    norms = rng.lognormal(0.0, 1.0, size=200)  # a fixed norm distribution: median 1, 30% quantile ≈ 0.59
    deltas = np.zeros((200, 3))
    deltas[:, 0] = norms
    clip = site.clip_norm
    for _ in range(250):
        out = site_dp.aggregate(deltas, workers, weights=dict.fromkeys(workers, 1.0), site=site, clip=clip, rng=rng)
        clip = out.next_clip
    assert out.stats["site_dp_count_noise_multiplier"] == pytest.approx(10.0)  # derived: n/20
    assert 0.22 <= float(np.mean(norms <= clip)) <= 0.38
    assert clip == pytest.approx(float(np.quantile(norms, 0.3)), rel=0.25)


def test_the_update_noise_multiplier_spends_exactly_z_and_bad_combinations_are_refused():
    z, sigma_b = 1.0, 5.0
    z_update = site_dp.update_noise_multiplier(z, sigma_b)
    assert z_update ** -2 + (2 * sigma_b) ** -2 == pytest.approx(z ** -2)  # the pair's RDP is z's
    with pytest.raises(ConfigError) as info:
        site_dp.update_noise_multiplier(1.0, 0.5)  # 2σ_b = z: undefined
    assert info.value.field == "privacy.site.count_noise_multiplier"
    # a derived σ_b is always defined, and costs at most a tenth of the round's RDP (z_Δ ≤ z/√0.9)
    for asked in (2, 3, 10, 1000):
        derived = site_dp.count_noise_multiplier(SiteDP(enabled=True, clipping="adaptive", noise_multiplier=2.0), asked)
        assert site_dp.update_noise_multiplier(2.0, derived) <= 2.0 / math.sqrt(0.9) + 1e-12


def test_fedavg_site_weights_come_from_the_registered_counts_never_from_the_upload():
    got = site_dp.site_weights("fedavg", ["a", "b", "c"], registered={"a": 100, "b": 50})
    assert got == {"a": 1.0, "b": 0.5, "c": 1.0}  # c registered no count: weight 1, never above
    assert site_dp.site_weights("uniform", ["a", "b"], registered={"a": 100}) == {"a": 1.0, "b": 1.0}


# ----- at the aggregation service -----

def test_a_site_sending_a_huge_update_moves_the_model_by_at_most_s_over_n():
    honest = close_with(book_with(clip_norm=0.5), {"w1": 0.0, "w2": 0.1, "w3": -0.1})
    attacked = close_with(book_with(clip_norm=0.5), {"w1": 5000.0, "w2": 0.1, "w3": -0.1})  # same seed: same noise
    moved = float(np.linalg.norm(attacked - honest))
    assert 0.5 / 3 * 0.99 < moved <= 0.5 / 3 * (1 + 1e-5)  # it pushes as far as S/n allows, never farther


def test_a_site_that_drops_out_leaves_its_share_empty_the_denominator_stays_the_sites_asked():
    moved = close_with(book_with(noise_multiplier=0.0, clip_norm=10.0), {"w1": 0.3, "w2": 0.6})  # w3 never answers
    np.testing.assert_allclose(moved, (0.3 + 0.6) / 3, rtol=1e-6)


def test_under_fedavg_a_huge_update_is_bounded_by_its_weight_fixed_at_registration():
    book = RoundBook(max_update_bytes=100_000, clock=lambda: 1000.0, site_dp_seed=1)
    book.installed.install(site_settings(weighting="fedavg", noise_multiplier=0.0, clip_norm=0.5))
    book.put_global("j", 1, SPEC.to_json(), weights(0.0))
    book.open_round("j", 1, SITES, deadline=2000.0, seed=0, num_samples={"w1": 10, "w2": 40, "w3": 40})
    book.receive_update(stream(weights(5000.0), worker="w1", n=10))
    book.close("j", 1)
    # w1's weight is 10/40 of the largest site's, W = 0.25 + 1 + 1: it moves the model by 0.25·S/W
    assert float(np.linalg.norm(flat(book.global_model("j")[2]))) == pytest.approx(0.25 * 0.5 / 2.25, rel=1e-5)


def test_the_noise_is_unpredictable_in_production_and_reproducible_only_with_an_injected_seed():
    uploads = {"w1": 0.01, "w2": 0.02}
    a, b = (close_with(book_with(seed=None), uploads) for _ in range(2))  # same job seed, same uploads
    assert not np.allclose(a, b)
    c, d = (close_with(book_with(seed=5), uploads) for _ in range(2))
    np.testing.assert_array_equal(c, d)
    first, second = site_dp.noise_rng(None, 1), site_dp.noise_rng(None, 1)
    assert first.normal(size=4).tolist() != second.normal(size=4).tolist()


def test_the_adaptive_clip_survives_a_service_restart(tmp_path: Path):
    site = {"clipping": "adaptive", "clip_norm": 0.2, "clip_lr": 0.5, "target_quantile": 0.9}
    book = book_with(tmp_path, **site)
    for worker in SITES:
        book.receive_update(stream(weights(0.01), worker=worker))
    first = book.close("j", 1)
    assert first.stats["site_dp_clip"] == 0.2 and first.stats["site_dp_next_clip"] != 0.2
    book.stop()
    again = RoundBook(max_update_bytes=100_000, clock=lambda: 1000.0, spool_dir=tmp_path, site_dp_seed=7)
    assert again.table.jobs["j"].site_clip == first.stats["site_dp_next_clip"]
    again.open_round("j", 2, SITES, deadline=2000.0, seed=0)
    for worker in SITES:
        again.receive_update(stream(weights(0.01), rnd=2, worker=worker))
    second = again.close("j", 2)
    assert second.stats["site_dp_clip"] == first.stats["site_dp_next_clip"]  # the round resumes from the kept S
    clipped = [v for v in second.verdicts if v.rule == "site_dp"]
    assert len(clipped) == 3
    again.stop()


@pytest.mark.parametrize(("settings", "field"), [
    ({"clipping": "adaptive", "noise_multiplier": 1.0, "count_noise_multiplier": 0.4},
     "privacy.site.count_noise_multiplier"),
    ({"weighting": "dwfed"}, "aggregation.weighting"),
    ({"robust": "median"}, "aggregation.robust"),
    ({"selection": "random"}, "aggregation.selection"),
    ({"clip_norm": -1.0}, "privacy.site.clip_norm"),
    ({"clipping": "sometimes"}, "privacy.site.clipping"),
])
def test_bad_site_dp_settings_are_refused_at_install_naming_the_field(settings, field):
    book = RoundBook(max_update_bytes=100_000)
    with pytest.raises(ConfigError) as info:
        book.installed.install(site_settings(**settings))
    assert field in str(info.value)


JOB = {"name": "n", "category": "c", "model": {"input_shape": [4], "layers": [
    {"type": "Linear", "in_features": 4, "out_features": 2}]},
    "training": {"rounds": 2, "local_epochs": 1, "batch_size": 8, "lr": 0.1}}


@pytest.mark.parametrize(("extra", "problem"), [
    ({"aggregation": {"secure": True}}, "cannot run with aggregation.secure"),
    ({"schedule": {"mode": "async"}}, "needs schedule.mode sync"),
])
def test_a_site_dp_job_is_refused_with_secure_aggregation_or_an_async_schedule(extra, problem):
    with pytest.raises(ConfigError) as info:
        parse_job({**JOB, **extra, "privacy": {"site": {"noise_multiplier": 1.0}}})
    assert "privacy.site" in str(info.value) and problem in str(info.value)
    assert parse_job({**JOB, "privacy": {"site": {"noise_multiplier": 1.0}}}).privacy.site.enabled


def test_one_site_moves_the_adaptive_clip_by_at_most_a_factor_exp_lr_over_n_per_round():
    site = SiteDP(enabled=True, clipping="adaptive", noise_multiplier=1.0, clip_norm=1.0, clip_lr=0.5)
    workers = [f"s{i}" for i in range(10)]
    honest = np.full((10, 2), 0.1)
    lying = honest.copy()
    lying[0] = 1e6  # it flips its own bit: counted as clipped
    clips = [site_dp.aggregate(rows, workers, weights=dict.fromkeys(workers, 1.0), site=site, clip=1.0,
                               rng=np.random.default_rng(9)).next_clip for rows in (honest, lying)]
    assert clips[1] / clips[0] == pytest.approx(math.exp(0.5 / 10))  # b̄ one site lower: S one step higher


def test_the_service_refuses_an_asynchronous_buffer_for_a_site_dp_job():
    book = RoundBook(max_update_bytes=100_000)
    book.installed.install(site_settings())
    book.put_global("j", 1, SPEC.to_json(), weights(0.0))
    with pytest.raises(ConfigError) as info:
        book.open_buffer("j", {"buffer_size": 2, "max_staleness": 2, "staleness": "constant", "staleness_params": {},
                               "server_lr": 1.0, "seed": 0}, num_samples={"w1": 10})
    assert info.value.field == "privacy.site" and book.table.jobs["j"].asynchronous is None


def test_each_sites_clipping_is_reported_with_its_norm_and_the_clip_of_the_round():
    book = book_with(clip_norm=0.5)
    for worker, value in (("w1", 10.0), ("w2", 0.01)):
        book.receive_update(stream(weights(value), worker=worker))
    result = book.close("j", 1)
    verdicts = {v.worker_id: v for v in result.verdicts}
    assert verdicts["w1"].judgement == "clipped" and verdicts["w2"].judgement == "kept"
    assert verdicts["w1"].ratio == pytest.approx(0.5 / (10.0 * math.sqrt(10)))  # S / its norm
    assert result.stats["site_dp_clip"] == 0.5 and result.stats["site_dp_clipped"] == 1
    assert robust_note(result.verdicts) == f"site_dp clipped w1 ({verdicts['w1'].ratio:.0%} of its share)"
