"""A job's model plan (fedbroker.weights): start weights pinned and checked by name, frozen nodes, LoRA adapters
and their merge into a plain model."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.settings import parse_settings, settings_message
from fedbroker.job.spec import job_from_json, parameter_shapes, parse_job, parse_model
from fedbroker.model import build_model, initial_weights, load_numpy_state, state_to_numpy
from fedbroker.weights.adapters import LoRALinear, planned_model, start_state
from fedbroker.weights.plan import (
    Adapters,
    ModelPlan,
    all_shapes,
    frozen_owner,
    merge_adapters,
    plan_from_json,
    trainable_names,
)
from fedbroker.weights.start import check_pin, decode, encode, read_pinned, sha256_hex, start_problems, weights_digest

MODEL = {"input_shape": [6], "layers": [
    {"type": "Linear", "in_features": 6, "out_features": 8}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 8, "out_features": 8}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 8, "out_features": 3}]}
SPEC = parse_model(MODEL)


def job(**model_fields: object) -> dict[str, object]:
    return {"name": "j", "category": "c", "model": {**MODEL, **model_fields}}


def problems(raw: dict[str, object]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_job(raw)
    errors = info.value.errors if isinstance(info.value, ConfigErrors) else [info.value]
    return {e.field: e.problem for e in errors}


def test_a_plan_is_parsed_kept_with_the_job_and_survives_its_wire_forms() -> None:
    spec = parse_job(job(freeze=["0"], adapters={"type": "lora", "rank": 2, "alpha": 4, "targets": ["2"],
                                                 "train": ["4"]},
                         initial_weights={"path": "w.safetensors", "sha256": "a" * 64}))
    assert spec.plan.freeze == ("0",) and spec.plan.adapters == Adapters("lora", 2, 4.0, ("2",), ("4",))
    assert spec.plan.adapters.scale == 2.0
    assert job_from_json(spec.to_json()) == spec
    installed = parse_settings(settings_message("j-1", spec, start_digest="d" * 64))
    assert installed.plan == spec.plan and installed.start_digest == "d" * 64
    assert plan_from_json(spec.plan.to_json()) == spec.plan
    assert parse_settings(settings_message("j-2", parse_job(job()))).plan == ModelPlan()


def test_every_bad_plan_field_is_named_at_once() -> None:
    found = problems(job(
        initial_weights={"path": "w.pt", "sha256": "XYZ"}, from_job="other-1",
        freeze=["9", "0", "0"],
        adapters={"type": "dora", "rank": 0, "alpha": -1, "targets": [], "train": ["4"]}))
    assert set(found) >= {"model.initial_weights.path", "model.initial_weights.sha256", "model.freeze[2]",
                          "model.adapters.type", "model.adapters.rank", "model.adapters.alpha"}
    assert "twice" in found["model.freeze[2]"]


def test_a_plan_naming_what_the_model_lacks_is_refused_naming_the_node() -> None:
    found = problems(job(freeze=["7", "1"], adapters={"rank": 2, "targets": ["1", "3"], "train": ["2"]}))
    assert "not a node" in found["model.freeze[0]"]
    assert "no weights" in found["model.freeze[1]"]          # a ReLU holds nothing to freeze
    assert "no weights" in found["model.adapters.targets[0]"]   # a ReLU: nothing to adapt
    found = problems(job(adapters={"rank": 2, "targets": ["2"], "train": ["2"]}))
    assert "carries an adapter" in found["model.adapters.train[0]"]
    found = problems(job(freeze=["0", "2", "4"]))
    assert "nothing would train" in found["model.freeze"]


def test_a_plan_beside_an_alignment_or_a_secure_round_is_refused() -> None:
    found = problems({**job(freeze=["0"]), "aggregation": {"alignment": "feddna", "secure": True}})
    assert "aggregation.alignment" in found and "aggregation.secure" in found


def test_freezing_and_adapters_decide_what_trains_and_why_the_rest_does_not() -> None:
    plan = ModelPlan(freeze=("0",))
    assert trainable_names(SPEC, plan) == ["2.weight", "2.bias", "4.weight", "4.bias"]
    assert "frozen" in frozen_owner("0.bias", SPEC, plan) and frozen_owner("2.bias", SPEC, plan) == ""
    lora = ModelPlan(adapters=Adapters("lora", 2, 2.0, ("0", "2"), ("4",)))
    assert all_shapes(SPEC, lora)["0.lora_a.weight"] == (2, 6) and all_shapes(SPEC, lora)["2.lora_b.weight"] == (8, 2)
    assert trainable_names(SPEC, lora) == ["4.weight", "4.bias", "0.lora_a.weight", "0.lora_b.weight",
                                           "2.lora_a.weight", "2.lora_b.weight"]
    assert "neither an adapter" in frozen_owner("2.weight", SPEC, lora)


def test_a_pinned_file_is_read_only_when_its_digest_is_the_pin(tmp_path) -> None:
    data = encode(initial_weights(SPEC, seed=1))
    path = tmp_path / "w.safetensors"
    path.write_bytes(data)
    assert read_pinned(path, sha256=sha256_hex(data)) == data
    with pytest.raises(ConfigError, match="the job pins") as info:
        read_pinned(path, sha256="0" * 64)
    assert info.value.field == "model.initial_weights.sha256" and sha256_hex(data) in str(info.value)
    with pytest.raises(ConfigError, match="cannot read"):
        read_pinned(tmp_path / "absent.safetensors", sha256="0" * 64)


def test_a_pickle_is_never_loaded_as_start_weights() -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:  # what a hostile pickle would run
            return (print, ("pwned",))

    with pytest.raises(ConfigError, match="not a safetensors file"):
        decode(pickle.dumps({"0.weight": Boom()}))


def test_start_weights_are_checked_by_name_shape_and_finiteness_naming_the_node() -> None:
    tensors = initial_weights(SPEC, seed=1)
    tensors["2.weight"] = np.zeros((8, 7), np.float32)
    tensors["4.bias"] = np.array([0.0, np.nan, 1.0], np.float32)
    del tensors["0.bias"]
    tensors["head.weight"] = np.zeros(3, np.float32)
    found = {e.field: e.problem for e in start_problems(parameter_shapes(SPEC), decode(encode(tensors)))}
    assert "node '0' needs" in found["model.initial_weights.0.bias"]
    assert "node '2' needs [8, 8]" in found["model.initial_weights.2.weight"]
    assert "NaN" in found["model.initial_weights.4.bias"]
    assert "extra" in found["model.initial_weights.head.weight"]


def test_the_weights_digest_is_canonical_over_names_shapes_and_values() -> None:
    tensors = initial_weights(SPEC, seed=1)
    assert weights_digest(tensors) == weights_digest(dict(reversed(list(tensors.items()))))
    assert weights_digest(tensors) == weights_digest(decode(encode(tensors)))
    changed = {**tensors, "4.bias": tensors["4.bias"] + np.float32(1e-6)}
    assert weights_digest(changed) != weights_digest(tensors)


def test_start_state_keeps_the_start_weights_and_adds_adapters_that_change_nothing() -> None:
    plan = ModelPlan(adapters=Adapters("lora", 2, 2.0, ("0",), ("4",)))
    base = initial_weights(SPEC, seed=5)
    state = start_state(SPEC, plan, seed=1, base=base)
    assert set(state) == set(all_shapes(SPEC, plan))
    for name in base:
        np.testing.assert_array_equal(state[name], base[name])
    assert not state["0.lora_b.weight"].any() and state["0.lora_a.weight"].any()
    plain, adapted = build_model(SPEC), planned_model(SPEC, plan)
    load_numpy_state(plain, base)
    load_numpy_state(adapted, state)
    x = torch.randn(5, 6)
    assert torch.equal(plain(x), adapted(x))   # B = 0: the adapted model is the start model exactly


def test_merging_adapters_gives_a_plain_model_with_exactly_the_same_outputs() -> None:
    # Small integers and a power-of-two scale: every product and sum is exact in float32, so the merged model's
    # outputs must equal the adapted model's bit for bit (a wrong transpose, scale or sign would not).
    rng = np.random.default_rng(0)
    base = nn_linear(6, 4, rng)
    lora = LoRALinear(base, rank=2, alpha=8.0)   # scale 4
    with torch.no_grad():
        lora.lora_a.weight.copy_(torch.from_numpy(rng.integers(-3, 4, (2, 6)).astype(np.float32)))
        lora.lora_b.weight.copy_(torch.from_numpy(rng.integers(-3, 4, (4, 2)).astype(np.float32)))
    state = {f"0.{k}": v for k, v in state_to_numpy(lora).items()}
    merged = merge_adapters(state, Adapters("lora", 2, 8.0, ("0",)))
    assert set(merged) == {"0.weight", "0.bias"}
    plain = torch.nn.Linear(6, 4)
    plain.load_state_dict({k[2:]: torch.from_numpy(v) for k, v in merged.items()})
    x = torch.from_numpy(rng.integers(-4, 5, (16, 6)).astype(np.float32))
    assert torch.equal(lora(x), plain(x))
    assert lora(x).abs().sum() > 0 and not torch.equal(lora(x), base(x))


def test_merging_random_adapters_matches_the_adapted_model() -> None:
    plan = ModelPlan(adapters=Adapters("lora", 3, 5.0, ("0", "2"), ("4",)))
    adapted = planned_model(SPEC, plan)
    with torch.no_grad():
        for p in adapted.parameters():
            p.normal_()
    plain = build_model(SPEC)
    load_numpy_state(plain, merge_adapters(state_to_numpy(adapted), plan.adapters))
    x = torch.randn(32, 6)
    torch.testing.assert_close(plain(x), adapted(x), rtol=1e-5, atol=1e-4)


def nn_linear(features_in: int, features_out: int, rng: np.random.Generator) -> torch.nn.Linear:
    layer = torch.nn.Linear(features_in, features_out)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(rng.integers(-4, 5, (features_out, features_in)).astype(np.float32)))
        layer.bias.copy_(torch.from_numpy(rng.integers(-4, 5, features_out).astype(np.float32)))
    return layer


def test_the_pin_check_names_both_digests() -> None:
    with pytest.raises(ConfigError) as info:
        check_pin(b"abc", sha256="f" * 64, where="model.initial_weights")
    assert sha256_hex(b"abc") in str(info.value) and "f" * 64 in str(info.value)
    assert json.loads(ModelPlan().to_json()) == {}
