"""The segmentation experiment's plumbing at a tiny size: the lesion recipe, the DP noise choice, a study writing
its table (named synthetic, the paper's numbers beside) and its per-round Dice for every method."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from experiments import segmentation
from experiments.lesions import make_site, site_sizes, site_styles
from fedbroker.privacy import dp_sample_rate, planned_steps, project_epsilon


def test_the_recipe_gives_unbalanced_sites_with_lesions_and_is_seeded():
    rng = np.random.default_rng(0)
    sizes = site_sizes(200, 8, 0.5, 8, rng)
    assert sum(sizes) == 200 and min(sizes) >= 8 and max(sizes) > 2 * min(sizes)
    style = site_styles(1, 32, np.random.default_rng(1))[0]
    x, y = make_site(20, 32, style, np.random.default_rng(2))
    x2, y2 = make_site(20, 32, style, np.random.default_rng(2))
    assert x.shape == (20, 1, 32, 32) and x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert 0.0 < y.mean() < 0.5 and set(np.unique(y)) == {0, 1}


def test_each_site_picks_the_least_noise_that_keeps_its_epsilon_at_the_target():
    config = segmentation._config(segmentation.Protocol(), 1)
    sigma = segmentation.noise_for(40, config, 13, epsilon=8.0, delta=1e-5, tol=0.5)

    def eps(s: float) -> float:
        return project_epsilon([], noise_multiplier=s, sample_rate=dp_sample_rate(40, config),
                               steps=13 * planned_steps(40, config), delta=1e-5)

    assert eps(sigma) <= 8.0 < eps(sigma - 0.5)


@pytest.mark.parametrize("methods", [("FedAvg", "NAFI", "FedAvg + DP")])
def test_a_tiny_study_writes_the_table_and_every_methods_dice_per_round(tmp_path, methods):
    protocol = replace(segmentation.QUICK, sizes=(2,), image=8, train_total=16, test=4, methods=methods)
    result = segmentation.run(str(tmp_path), protocol, progress=False)
    assert [r["method"] for r in result["runs"]] == list(methods)
    for r in result["runs"]:
        assert len(r["dice"]) == segmentation.N_LAYERS
        assert all(0.0 <= d <= 100.0 for d in r["dice"])
    nafi = next(r for r in result["runs"] if r["method"] == "NAFI")
    assert len(nafi["global_widths"]) == segmentation.N_LAYERS - 1 and len(nafi["local_dice"]) == 2
    dp = next(r for r in result["runs"] if r["method"] == "FedAvg + DP")
    assert dp["epsilon_max"] <= protocol.dp_epsilon + 1e-9
    md = (tmp_path / "segmentation.md").read_text()
    assert "synthetic" in md and "| 2 | NAFI |" in md
    assert json.loads((tmp_path / "segmentation.json").read_text())["protocol"]["image"] == 8
    assert (tmp_path / "segmentation.png").stat().st_size > 0


def test_permuted_copies_of_the_experiments_unet_with_bn_folded_realign_to_the_same_outputs():
    import torch

    from experiments.segmentation_net import GRAPH, N_LAYERS, OUT, Client, UNet, client_of, model_of, widths_for
    from fedbroker.aggregators.alignment.concat import class_average, match_graph_layer, permute_layer
    from fedbroker.algorithms.params import MatchingParams

    torch.manual_seed(0)
    model = UNet(widths_for((3, 4, 5)), ["bn"] * N_LAYERS)
    with torch.no_grad():
        for norm in model.norms:
            if isinstance(norm, torch.nn.BatchNorm2d):
                norm.weight.normal_()
                norm.bias.normal_()
                norm.running_mean.normal_()
                norm.running_var.uniform_(0.5, 2.0)
    model.eval()
    x = torch.randn(2, 1, 8, 8)
    want = model(x).detach().numpy()
    fused = client_of(model)
    for i in range(N_LAYERS):
        fused = fused.folded(i)
    rng = np.random.default_rng(0)
    copies = []
    for _ in range(3):
        layers = list(fused.layers)
        for i in range(N_LAYERS - 1):
            layers = permute_layer(GRAPH, layers, i, rng.permutation(layers[i].weight.shape[0]))
        copies.append(layers)
    np.testing.assert_allclose(model_of(Client(copies[0], fused.bns)).eval()(x).detach().numpy(), want, atol=1e-5)
    for i in range(N_LAYERS - 1):
        copies, match = match_graph_layer(GRAPH, copies, i, weights=np.ones(3), params=MatchingParams(lam=0.01),
                                          rng=np.random.default_rng(i))
        assert match.width == fused.layers[i].weight.shape[0]
    out = class_average([c[OUT] for c in copies], np.ones((3, 2)))
    got = model_of(Client(copies[0][:OUT] + [out], fused.bns)).eval()(x).detach().numpy()
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_parts_over_disjoint_sizes_merge_into_one_table_and_other_protocols_are_refused(tmp_path):
    runs = [{"J": 2, "seed": 0, "method": "FedAvg", "dice": [1.0, 2.0]}]
    protocol = {**segmentation.asdict(segmentation.QUICK), "methods": ["FedAvg"], "sizes": [2]}
    for name, n_sites in (("a", 2), ("b", 3)):
        (tmp_path / name).mkdir()
        part = {"protocol": {**protocol, "sizes": [n_sites]}, "runs": [{**runs[0], "J": n_sites}], "seconds": 5.0}
        (tmp_path / name / "segmentation.json").write_text(json.dumps(part))
    merged = segmentation.merge([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "out"))
    assert merged["protocol"]["sizes"] == [2, 3] and merged["seconds"] == 10.0
    md = (tmp_path / "out" / "segmentation.md").read_text()
    assert "| 2 | FedAvg | 2.00 ± 0.00 | 2.00 ± 0.00 |" in md and "| 3 | FedAvg |" in md
    other = json.loads((tmp_path / "b" / "segmentation.json").read_text())
    other["protocol"]["lr"] = 0.5
    (tmp_path / "b" / "segmentation.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="different protocols"):
        segmentation.merge([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "out"))
