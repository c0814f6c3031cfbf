"""Training a job's plan on a site: frozen tensors are never stepped, clipped or noised, LoRA adapters and the
named heads train under DP in every clipping mode, and what travels is only what trains."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedbroker.config import DPPolicy
from fedbroker.job.spec import TrainingConfig, parse_model
from fedbroker.model import initial_weights, state_to_numpy
from fedbroker.weights.adapters import planned_model, start_state, trained_names
from fedbroker.weights.plan import Adapters, ModelPlan, trainable_names, trainable_shapes
from fedbroker.weights.start import frozen_digest
from fedbroker.worker import clipping
from fedbroker.worker.global_model import build_global
from fedbroker.worker.training import train_local

SPEC = parse_model({"input_shape": [12], "layers": [
    {"type": "Linear", "in_features": 12, "out_features": 64}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 64, "out_features": 64}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 64, "out_features": 4}]})
POLICY = DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=1000.0)
CONFIG = TrainingConfig(rounds=1, local_epochs=1, batch_size=16, lr=0.5)
FREEZE = ModelPlan(freeze=("0",))
LORA = ModelPlan(adapters=Adapters("lora", 2, 4.0, ("0", "2"), ("4",)))


def data(n: int = 96) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 12)).astype(np.float32), rng.integers(0, 4, size=n)


def planned(plan: ModelPlan) -> torch.nn.Module:
    model = planned_model(SPEC, plan)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in start_state(SPEC, plan, seed=3).items()})
    return model


@pytest.mark.parametrize("mode", ["bk", "ghost", "ew"])
@pytest.mark.parametrize("plan", [FREEZE, LORA], ids=["freeze", "lora"])
def test_dp_noise_and_steps_reach_only_what_trains(plan: ModelPlan, mode: str) -> None:
    model = planned(plan)
    before = state_to_numpy(model)
    x, y = data()
    result = train_local(model, x, y, config=CONFIG, dp=POLICY, seed=1, clipping=mode)
    trains = set(trainable_names(SPEC, plan))
    assert result.clipping == mode and result.epsilon is not None
    for name, value in result.state.items():
        if name in trains:   # noised and stepped: moved, even a zero-initialised B
            assert not np.array_equal(value, before[name]), name
        else:                # frozen: bit for bit the start weights, though the step added noise elsewhere
            np.testing.assert_array_equal(value, before[name], err_msg=name)
    assert set(trained_names(model)) == trains   # the caller's module keeps the plan's freezing


def test_book_keeping_clipping_leaves_frozen_parameters_frozen() -> None:
    model = planned(LORA)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    hooked, dp_optimizer, backward = clipping.dp_engine(model, optimizer, clipping="bk", noise_multiplier=1.0,
                                                         max_grad_norm=1.0, expected_batch_size=16, generator=None)
    x, y = data(16)
    backward(torch.from_numpy(x), torch.from_numpy(y))
    dp_optimizer.step()
    hooked.cleanup()
    assert frozen and not any(p.requires_grad or p.grad is not None for p in frozen)
    assert {id(p) for p in dp_optimizer.params} == {id(p) for p in model.parameters() if p.requires_grad}


def test_an_adapter_update_is_a_small_fraction_of_the_model() -> None:
    full = sum(np.prod(s) for s in trainable_shapes(SPEC, ModelPlan()).values()) * 4
    update = sum(np.prod(s) for s in trainable_shapes(SPEC, LORA).values()) * 4
    assert update < 0.15 * full     # rank 2 on 12→64 and 64→64, plus the 64→4 head: 2.6 KiB of 20.5 KiB (12.7 %)
    model = planned(LORA)
    x, y = data()
    result = train_local(model, x, y, config=CONFIG, dp=POLICY, seed=1)
    sent = {name: result.state[name] for name in trainable_names(SPEC, LORA)}
    assert sum(a.nbytes for a in sent.values()) == update


def test_a_site_builds_the_planned_model_and_refuses_frozen_weights_that_are_not_the_pinned_ones() -> None:
    start = start_state(SPEC, LORA, seed=3)
    pin = frozen_digest(start, SPEC, LORA)
    _, model = build_global((1, SPEC.to_json(), start), LORA, start_digest=pin)
    assert set(trained_names(model)) == set(trainable_names(SPEC, LORA))
    other = {**start, "0.weight": start["0.weight"] + np.float32(0.01)}   # a server's other start weights
    with pytest.raises(ValueError, match="not the job's start weights"):
        build_global((1, SPEC.to_json(), other), LORA, start_digest=pin)
    trained = {**start, "4.bias": start["4.bias"] + 1, "0.lora_b.weight": start["0.lora_b.weight"] + 1}
    build_global((5, SPEC.to_json(), trained), LORA, start_digest=pin)   # what trains may move: the pin holds


def test_without_a_plan_every_tensor_trains_as_before() -> None:
    assert trainable_names(SPEC, ModelPlan()) == list(initial_weights(SPEC, seed=0))


GRAPH = {"input_shape": [1, 8, 8],
         "blocks": {"res": {"params": ["c"], "nodes": {
             "conv": {"type": "Conv2d", "in_channels": "$c", "out_channels": "$c", "kernel_size": 3, "padding": 1},
             "norm": {"type": "GroupNorm", "num_groups": 2, "num_channels": "$c"},
             "sum": {"type": "add", "inputs": ["norm", "x"]}}}},
         "nodes": {"stem": {"type": "Conv2d", "in_channels": 1, "out_channels": 4, "kernel_size": 3, "padding": 1},
                   "b1": {"block": "res", "c": 4},
                   "flat": {"type": "Flatten"},
                   "hidden": {"type": "Linear", "in_features": 256, "out_features": 16},
                   "act": {"type": "ReLU"},
                   "head": {"type": "Linear", "in_features": 16, "out_features": 4}}}


def test_a_graph_freezes_a_block_instance_and_adapts_a_named_node_under_dp() -> None:
    from fedbroker.job.spec import parse_job
    from fedbroker.model import build_model, load_numpy_state
    from fedbroker.weights.plan import merge_adapters

    job = parse_job({"name": "g", "category": "c", "model": {
        **GRAPH, "freeze": ["stem", "b1"], "adapters": {"rank": 2, "targets": ["hidden"], "train": ["head"]}}})
    plan = job.plan
    assert trainable_names(job.model, plan) == ["head.weight", "head.bias", "hidden.lora_a.weight",
                                                "hidden.lora_b.weight"]
    model = planned_model(job.model, plan)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in start_state(job.model, plan, seed=2).items()})
    before = state_to_numpy(model)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 1, 8, 8)).astype(np.float32), rng.integers(0, 4, size=64)
    result = train_local(model, x, y, config=CONFIG, dp=POLICY, seed=1, clipping="bk")
    for name in ("stem.weight", "b1.conv.weight", "b1.norm.bias", "hidden.weight"):
        np.testing.assert_array_equal(result.state[name], before[name], err_msg=name)
    assert not np.array_equal(result.state["hidden.lora_b.weight"], before["hidden.lora_b.weight"])
    assert plan.adapters is not None
    plain = build_model(job.model)
    load_numpy_state(plain, merge_adapters(result.state, plan.adapters))
    probe = torch.from_numpy(x[:8])
    torch.testing.assert_close(plain(probe), model(probe), rtol=1e-5, atol=1e-5)
