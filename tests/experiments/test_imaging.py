"""The imaging study's parts at tiny size: the stand-in data, the scaled catalogue ResNet, the pinned start file,
each site's DP calibration, frozen tensors through the harness, and one end-to-end plumbing run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from experiments import imaging
from experiments.harness import VirtualWorker, simulate
from experiments.imaging_data import pretext, tissue
from fedbroker.datasets import Dataset
from fedbroker.errors import ConfigError
from fedbroker.job.spec import TrainingConfig, parse_job, parse_model
from fedbroker.model import build_model, initial_weights
from fedbroker.privacy import dp_sample_rate, planned_steps, project_epsilon
from fedbroker.weights.start import encode, sha256_hex


def test_the_stand_in_data_are_seeded_balanced_images_in_the_unit_range():
    x, y = tissue(36, seed=4)
    again, _ = tissue(36, seed=4)
    other, _ = tissue(36, seed=5)
    assert x.shape == (36, 3, 28, 28) and x.dtype == np.float32 and y.dtype == np.int64
    assert np.array_equal(x, again) and not np.array_equal(x, other)
    assert np.bincount(y, minlength=9).tolist() == [4] * 9
    assert x.min() >= 0.0 and x.max() <= 1.0
    px, py = pretext(20, seed=0)
    assert px.shape == (20, 3, 28, 28) and set(py.tolist()) == set(range(10))


def test_the_small_resnet_is_the_catalogue_graph_with_every_width_divided():
    small = parse_model(imaging.resnet18(9, divisor=8, groups=4))
    full = yaml.safe_load(imaging.CATALOGUE_RESNET.read_text())["model"]
    full["input_shape"] = [3, 28, 28]
    full_model, small_model = build_model(parse_model(full)), build_model(small)
    full_shapes = {k: tuple(v.shape) for k, v in full_model.state_dict().items()}
    small_shapes = {k: tuple(v.shape) for k, v in small_model.state_dict().items()}
    assert set(small_shapes) == set(full_shapes)  # the same nodes and tensors, by name
    assert small_shapes["layer4_1.conv2.weight"] == (64, 64, 3, 3) and small_shapes["conv1.weight"] == (8, 3, 3, 3)
    assert small_shapes["fc.weight"] == (9, 64)
    import torch

    assert small_model(torch.zeros(2, 3, 28, 28)).shape == (2, 9)


def test_the_start_file_is_read_against_its_pin(tmp_path):
    spec = parse_model(imaging.resnet18(9, divisor=8, groups=4))
    state = initial_weights(spec, seed=1)
    path = tmp_path / "start.safetensors"
    path.write_bytes(encode(state))
    loaded = imaging.load_start(path, sha256_hex(path.read_bytes()), spec)
    assert all(np.array_equal(loaded[k], state[k]) for k in state)
    with pytest.raises(ConfigError, match="sha256"):
        imaging.load_start(path, "0" * 64, spec)
    path.write_bytes(encode({k: v for k, v in state.items() if k != "fc.bias"}))
    with pytest.raises(ConfigError, match="fc.bias"):
        imaging.load_start(path, sha256_hex(path.read_bytes()), spec)


def test_each_site_spends_its_target_epsilon_from_its_own_sample_rate():
    config = TrainingConfig(local_epochs=1, batch_size=16, lr=1e-3, optimizer="adam")
    workers = [VirtualWorker(f"s{i}", np.zeros((n, 3, 28, 28), np.float32), np.zeros(n, np.int64), 9)
               for i, n in enumerate((40, 120))]
    policies = imaging.site_policies(3.0, workers, config, rounds=4, delta=1e-5, clip=0.85)
    for w in workers:
        p = policies[w.worker_id]
        spent = project_epsilon([], noise_multiplier=p.noise_multiplier, sample_rate=dp_sample_rate(len(w.y), config),
                                steps=4 * planned_steps(len(w.y), config), delta=1e-5)
        assert 2.99 <= spent <= 3.0 and p.max_grad_norm == 0.85
    assert policies["s0"].noise_multiplier > policies["s1"].noise_multiplier  # the smaller site samples more


def test_frozen_tensors_come_back_unchanged_through_the_harness():
    protocol = imaging.ImagingProtocol()
    job = parse_job({"name": "t", "category": "tissue", "seed": 0, "model": imaging.resnet18(9, divisor=8, groups=4),
                     "training": {"rounds": 1, "local_epochs": 1, "batch_size": 8, "lr": 1e-2, "optimizer": "adam"}})
    x, y = tissue(18, seed=0)
    workers = [VirtualWorker("a", x[:9], y[:9], 9), VirtualWorker("b", x[9:], y[9:], 9)]
    start = initial_weights(job.model, seed=0)
    frozen = imaging.frozen_names(job.model, protocol.freeze)
    assert "conv1.weight" in frozen and "layer2_1.conv2.weight" in frozen and "layer3_0.conv1.weight" not in frozen
    sim = simulate(job, workers, Dataset(x=x, y=y, num_classes=9, name="t"), initial_state=start, frozen=frozen,
                   progress=False, metrics=lambda _m, _t: {})
    assert all(np.array_equal(sim.final_state[k], start[k]) for k in frozen)
    assert not np.array_equal(sim.final_state["fc.weight"], start["fc.weight"])


def test_a_plumbing_run_writes_every_arm_of_every_model(tmp_path):
    result = imaging.run(imaging.quick_protocol(), tmp_path, progress=False)
    arms = ["central", "FedAvg", "FedAvg + DP ε=8"]
    assert [r["model"] for r in result["runs"]] == list(imaging.quick_protocol().models)
    for row in result["runs"]:
        assert list(row["arms"]) == arms
        for arm in row["arms"].values():
            assert 0.0 <= arm["accuracy"] <= 1.0 and 0.0 <= arm["mia_auc"] <= 1.0
        assert len(row["arms"]["FedAvg + DP ε=8"]["noise_multipliers"]) == 2
    saved = json.loads((tmp_path / "imaging.json").read_text())
    assert saved["runs"] == json.loads(json.dumps(result["runs"], default=float))
    table = (tmp_path / "imaging.md").read_text()
    assert "synthetic stand-in" in table and "pretrained on synthetic pretext" in table
    assert (tmp_path / "imaging.png").stat().st_size > 0
    assert (tmp_path / "imaging_start" / "resnet18_pretext_start.safetensors").exists()
    assert not (tmp_path / "imaging.partial.json").exists()


def _part(seed: int, **protocol: object) -> dict:
    arms = {arm: {"accuracy": 0.5 + seed / 10, "mia_auc": 0.55, "epsilon": None, "noise_multipliers": None}
            for arm in ("central", "FedAvg")}
    base = {**imaging.asdict(imaging.ImagingProtocol(seeds=(seed,), models=("cnn",))), **protocol}
    return {"protocol": base, "runs": [{"model": "cnn", "seed": seed, "arms": arms}], "seconds": 10.0,
            "pretext": {"sha256": "ab", "pretext_accuracy": 0.9, "samples": 10}}


def test_runs_over_other_seeds_merge_into_one_table_and_different_protocols_do_not():
    merged = imaging.merge([_part(1), _part(0)])
    assert merged["protocol"]["seeds"] == [0, 1] and [r["seed"] for r in merged["runs"]] == [0, 1]
    assert merged["seconds"] == 20.0
    assert "| cnn | central | 0,1 | 55.00 ± 7.07 |" in imaging.table(merged)
    with pytest.raises(ValueError, match="protocols"):
        imaging.merge([_part(0), _part(1, rounds=9)])
    with pytest.raises(ValueError, match="twice"):
        imaging.merge([_part(0), _part(0)])
