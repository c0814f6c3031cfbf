"""The GA's default fitness (`fitness: probe`): Loss1 = feature cosine on a probe set, Loss2 = the probe
cross-entropy of the chosen updates' aggregate; the numpy forward pass that computes both, against torch."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from fedbroker.aggregators.selection import Candidate, GeneticSelection, Probe, SelectionInput
from fedbroker.job.spec import ModelSpec, parameter_shapes, parse_model
from fedbroker.model import build_model, load_numpy_state

MLP = parse_model({"input_shape": [2], "layers": [
    {"type": "Linear", "in_features": 2, "out_features": 3, "bias": False}, {"type": "ReLU"},
    {"type": "Linear", "in_features": 3, "out_features": 2, "bias": False}]})

CONV = parse_model({"input_shape": [2, 7, 7], "layers": [
    {"type": "Conv2d", "in_channels": 2, "out_channels": 4, "kernel_size": 3, "padding": 1},
    {"type": "GroupNorm", "num_groups": 2, "num_channels": 4}, {"type": "ReLU"},
    {"type": "MaxPool2d", "kernel_size": 2},
    {"type": "Conv2d", "in_channels": 4, "out_channels": 3, "kernel_size": 2, "stride": 2, "bias": False},
    {"type": "Tanh"}, {"type": "AvgPool2d", "kernel_size": 1}, {"type": "Flatten"}, {"type": "Dropout", "p": 0.3},
    {"type": "Linear", "in_features": 3, "out_features": 5}, {"type": "Sigmoid"},
    {"type": "Linear", "in_features": 5, "out_features": 4}]})


def flat(spec: ModelSpec, state: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ravel(state[name]) for name in parameter_shapes(spec)])


def random_state(spec: ModelSpec, rng: np.random.Generator, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Values float32 holds exactly, as the models loaded into torch do."""
    return {name: (scale * rng.normal(size=shape)).astype(np.float32).astype(np.float64)
            for name, shape in parameter_shapes(spec).items()}


def torch_outputs(spec: ModelSpec, state: dict[str, np.ndarray], x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(inputs of the last Linear, outputs) of the torch model built from the spec, in eval mode."""
    model = build_model(spec).double().eval()
    load_numpy_state(model, {k: v.astype(np.float64) for k, v in state.items()})
    seen: list[torch.Tensor] = []
    last = [m for m in model if isinstance(m, torch.nn.Linear)][-1]
    last.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        out = model(torch.from_numpy(x))
    return seen[0].numpy(), out.numpy()


def test_numpy_forward_of_a_stack_of_models_equals_torch_layer_by_layer() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 2, 7, 7))
    states = [random_state(CONV, rng) for _ in range(3)]
    for name in states[0]:
        if name.startswith("1."):  # GroupNorm affine: keep it near the identity
            for s in states:
                s[name] = (1.0 + 0.1 * s[name]).astype(np.float32).astype(np.float64)
    probe = Probe(CONV, x, np.zeros(6, dtype=np.int64))
    features, outputs = probe.forward(np.stack([flat(CONV, s) for s in states]))
    for k, state in enumerate(states):
        want_features, want_outputs = torch_outputs(CONV, state, x)
        np.testing.assert_allclose(features[k], want_features, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(outputs[k], want_outputs, rtol=1e-10, atol=1e-12)


def test_loss2_is_the_probe_cross_entropy_of_the_weighted_aggregate_of_the_chosen_updates() -> None:
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(20, 2, 7, 7)), rng.integers(0, 4, size=20)
    states = [random_state(CONV, rng, 0.5) for _ in range(4)]
    raw = np.array([1.0, 5.0, 2.0, 3.0])
    candidates = [Candidate(f"w{k}", flat(CONV, s), 10, raw_weight=float(raw[k])) for k, s in enumerate(states)]
    probe = Probe(CONV, x, y)
    _, _, loss2 = GeneticSelection(m=2, probe_dataset="digits").fitness_for(candidates, flat(CONV, states[0]), probe)
    assert loss2 is not None
    for pair in ([0, 2], [1, 3]):
        alpha = raw[pair] / raw[pair].sum()  # the default coefficients: raw weights normalised over the set
        aggregate = {n: sum(a * states[k][n] for a, k in zip(alpha, pair)) for n in states[0]}
        _, logits = torch_outputs(CONV, aggregate, x)
        want = torch.nn.functional.cross_entropy(torch.from_numpy(logits), torch.from_numpy(y)).item()
        assert loss2(np.array([pair]))[0] == pytest.approx(want, rel=1e-6)  # torch holds the aggregate in float32


def test_with_mu_zero_the_probe_fitness_picks_the_set_whose_features_are_least_like_the_global_models() -> None:
    """Probe input (1, 0): the features are relu(first column of W1). The global model's are e1; the
    clients' are the hand example's vectors. Their second columns (never read by the probe) point against
    the global model's for the clients whose features agree with it, so the raw-parameter reading picks
    those instead."""
    features = {
        "same": [1.0, 0.0, 0.0],  # cos 1
        "diag": [1.0, 1.0, 0.0],  # cos 0.707
        "ortho": [0.0, 1.0, 0.0],  # cos 0
        "near": [0.2, 0.0, 1.0],  # cos 0.196
        "tilt": [1.0, 0.0, 1.0],  # cos 0.707
    }
    out = np.ones((2, 3))

    def model(first: list[float], second: float) -> np.ndarray:
        w1 = np.column_stack([first, np.full(3, second)])
        return flat(MLP, {"0.weight": w1, "2.weight": out})

    g = model([1.0, 0.0, 0.0], 5.0)
    candidates = [Candidate(k, model(v, -5.0 if k in ("same", "diag", "tilt") else 5.0), 1)
                  for k, v in features.items()]
    probe = Probe(MLP, np.array([[1.0, 0.0]]), np.array([0]))
    chosen = GeneticSelection(m=2, mu=0.0, probe_dataset="digits").choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(0), probe=probe))
    assert chosen.chosen == ["ortho", "near"]
    assert chosen.stats["loss1"] == pytest.approx(0.2 / math.sqrt(1.04) / 2)
    assert "loss2" not in chosen.stats
    raw = GeneticSelection(m=2, mu=0.0, fitness="reported_loss").choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(0)))
    assert set(raw.chosen) <= {"same", "diag", "tilt"}


def _problem(seed: int, n: int = 8) -> tuple[np.ndarray, list[Candidate], Probe]:
    spec = parse_model({"input_shape": [4], "layers": [
        {"type": "Linear", "in_features": 4, "out_features": 6}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 6, "out_features": 3}]})
    rng = np.random.default_rng(seed)
    g = random_state(spec, rng)
    candidates = [Candidate(f"w{k}", flat(spec, {n_: v + rng.normal(size=v.shape) for n_, v in g.items()}),
                            int(rng.integers(1, 100)), raw_weight=float(rng.uniform(0.5, 2.0))) for k in range(n)]
    probe = Probe(spec, rng.normal(size=(32, 4)), rng.integers(0, 3, size=32))
    return flat(spec, g), candidates, probe


@pytest.mark.parametrize("problem_seed", [0, 1, 2])
@pytest.mark.parametrize("ga_seed", [0, 1])
def test_probe_fitness_ga_finds_the_brute_force_optimum_for_8_candidates_choose_3(problem_seed: int, ga_seed: int) -> None:
    g, candidates, probe = _problem(problem_seed)
    algo = GeneticSelection(m=3, mu=1.0, probe_dataset="digits")
    fitness, _, _ = algo.fitness_for(candidates, g, probe)
    combos = np.array(list(itertools.combinations(range(8), 3)))
    values = fitness(combos)
    expected = [candidates[i].worker_id for i in combos[int(np.argmin(values))]]
    chosen = algo.choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(ga_seed), probe=probe))
    assert chosen.chosen == expected
    assert chosen.stats["fitness"] == pytest.approx(float(values.min()))
    assert chosen.stats["fitness"] == pytest.approx(chosen.stats["loss1"] + 1.0 * chosen.stats["loss2"])


def test_probe_fitness_without_a_probe_set_is_an_error() -> None:
    g, candidates, _ = _problem(0)
    with pytest.raises(ValueError, match="probe"):
        GeneticSelection(m=3, probe_dataset="digits").choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(0)))


def test_a_probe_set_the_model_cannot_read_is_refused() -> None:
    with pytest.raises(ValueError, match="shape"):
        Probe(MLP, np.zeros((3, 5)), np.zeros(3, dtype=np.int64))


def test_a_forward_split_into_chunks_gives_the_same_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Big models go through the stack in chunks (PROBE_BYTES): the chunking must not change any number."""
    from fedbroker.aggregators.selection import probe as probe_module

    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 2, 7, 7))
    stack = np.stack([flat(CONV, random_state(CONV, rng)) for _ in range(5)])
    whole = Probe(CONV, x, np.zeros(5, dtype=np.int64)).forward(stack)
    monkeypatch.setattr(probe_module, "PROBE_BYTES", 1)  # one model per chunk
    assert Probe(CONV, x, np.zeros(5, dtype=np.int64))._chunk() == 1
    chunked = Probe(CONV, x, np.zeros(5, dtype=np.int64)).forward(stack)
    for a, b in zip(whole, chunked):
        np.testing.assert_array_equal(a, b)
