"""The research harness runs the service's own trainer and RoundBook, seeded, and samples rounds like the coordinator."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from experiments.harness import make_workers, simulate, training_seed
from fedbroker.coordinator.participants import sample_participants
from fedbroker.evaluation import evaluate
from fedbroker.job.spec import TrainingConfig, parse_job
from fedbroker.model import build_model, initial_weights, load_numpy_state
from fedbroker.worker.training import train_local

IDS = [f"w{i:02d}" for i in range(10)]


def digits_job(alignment: str = "none", rounds: int = 3, **schedule: int) -> dict:
    return {
        "name": "t", "category": "digits", "seed": 3,
        "training": {"rounds": rounds, "local_epochs": 2, "lr": 0.2, "batch_size": 32},
        "aggregation": {"alignment": alignment},
        "schedule": dict(schedule),
        "model": {"input_shape": [1, 8, 8], "layers": [
            {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 16}, {"type": "ReLU"},
            {"type": "Linear", "in_features": 16, "out_features": 10}]},
    }


@pytest.fixture(scope="module")
def digits_iid():
    return make_workers("digits", num_workers=3, scheme="iid", seed=0)


def test_sample_participants_is_deterministic_and_returns_k_distinct_sorted_ids():
    first = sample_participants(IDS, 4, seed=7, round_number=2)
    assert first == sample_participants(list(reversed(IDS)), 4, seed=7, round_number=2)
    assert len(set(first)) == 4 and set(first) <= set(IDS) and first == sorted(first)
    draws = {tuple(sample_participants(IDS, 4, seed=7, round_number=r)) for r in range(1, 11)}
    assert len(draws) > 1


@pytest.mark.parametrize("k", [0, 10, 12])
def test_sample_participants_takes_everyone_when_k_is_zero_or_not_smaller_than_the_population(k):
    assert sample_participants(list(reversed(IDS)), k, seed=0, round_number=1) == IDS


def test_sample_participants_refuses_a_negative_k():
    with pytest.raises(ValueError, match="k must be"):
        sample_participants(IDS, -1, seed=0, round_number=1)


def test_make_workers_partitions_the_training_split_exactly_once(digits_iid):
    workers, test = digits_iid
    total = sum(len(w.y) for w in workers) + len(test)
    assert total == 1797
    assert [w.worker_id for w in workers] == ["w00", "w01", "w02"]
    for w in workers:
        assert w.histogram.sum() == len(w.y) and len(w.histogram) == 10


def test_fedavg_simulation_improves_and_equals_a_replay_of_the_same_updates(digits_iid):
    workers, test = digits_iid
    job = digits_job()
    sim = simulate(job, workers, test, progress=False)
    assert [r.round for r in sim.rounds] == [1, 2, 3]
    assert all(r.aggregated == r.participants == 3 for r in sim.rounds)
    assert {"accepted", "aggregated", "weighting_fallback"} <= set(sim.rounds[0].stats)
    assert sim.rounds[-1].accuracy > sim.rounds[0].accuracy and sim.rounds[-1].accuracy > 0.5
    assert {"auc", "f1_macro", "balanced_accuracy"} <= set(sim.rounds[-1].extra)

    # replay: the same trainer and seeds, then a sample-weighted mean written out by hand
    spec = parse_job(job)
    config = TrainingConfig(local_epochs=2, batch_size=32, lr=0.2)
    state = initial_weights(spec.model, seed=spec.seed)
    for r in (1, 2, 3):
        states, sizes = [], []
        for i, w in enumerate(workers):
            model = build_model(spec.model)
            load_numpy_state(model, state)
            result = train_local(model, w.x, w.y, config=config, dp=None, seed=training_seed(spec.seed, r, i))
            states.append(result.state)
            sizes.append(result.num_samples)
        share = np.array(sizes, dtype=np.float64) / sum(sizes)
        state = {k: sum(s[k].astype(np.float64) * a for s, a in zip(states, share)).astype(np.float32) for k in state}
    for name, arr in state.items():
        np.testing.assert_allclose(sim.final_state[name], arr, rtol=1e-5, atol=1e-6)
    model = build_model(spec.model)
    load_numpy_state(model, sim.final_state)
    assert evaluate(model, test.x, test.y)[0] == pytest.approx(sim.rounds[-1].accuracy)


def test_the_same_initial_state_and_seed_give_the_same_simulation(digits_iid):
    workers, test = digits_iid
    start = initial_weights(parse_job(digits_job()).model, seed=123)
    a = simulate(digits_job(rounds=2), workers, test, initial_state=copy.deepcopy(start), progress=False)
    b = simulate(digits_job(rounds=2), workers, test, initial_state=copy.deepcopy(start), progress=False)
    assert [r.accuracy for r in a.rounds] == [r.accuracy for r in b.rounds]
    c = simulate(digits_job(rounds=2), workers, test, progress=False)
    assert [r.accuracy for r in a.rounds] != [r.accuracy for r in c.rounds]


def test_feddna_runs_through_the_round_book_and_reports_widths_and_distance(digits_iid):
    workers, test = digits_iid
    sim = simulate(digits_job("feddna"), workers, test, progress=False)
    assert [r.widths for r in sim.rounds] == [[16, 10]] * 3
    first, last = sim.rounds[0].stats, sim.rounds[-1].stats
    assert first["alignment_frozen"] == 0.0 and first["alignment_total_matched_distance"] > 0
    assert last["alignment_frozen"] == 1.0  # freeze_after=2: round 3 is plain FedAvg


def test_clients_per_round_samples_the_participants_of_each_round():
    workers, test = make_workers("wine", num_workers=4, scheme="iid", seed=0)
    job = digits_job(rounds=2, clients_per_round=2)
    job.update(category="wine", model={"input_shape": [13], "layers": [
        {"type": "Linear", "in_features": 13, "out_features": 8}, {"type": "ReLU"},
        {"type": "Linear", "in_features": 8, "out_features": 3}]})
    sim = simulate(job, workers, test, progress=False)
    assert [(r.participants, r.aggregated) for r in sim.rounds] == [(2, 2), (2, 2)]


def test_quick_alignment_experiment_writes_tables_plots_and_raw_numbers(tmp_path):
    from experiments.alignment import main

    assert main(["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    assert {"alignment.json", "alignment_fusion.md", "alignment_rounds.md", "alignment_fusion.png",
            "alignment_rounds.png"} <= names
    table = (tmp_path / "alignment_fusion.md").read_text()
    assert "| 5 | shared |" in table and "PFNM" in table and "NAFI" in table
    assert "FedDNA_random" in (tmp_path / "alignment_rounds.md").read_text()


def test_first_states_start_each_worker_from_its_own_weights_in_round_one_only(digits_iid):
    workers, test = digits_iid
    spec = parse_job(digits_job(rounds=1))
    own = {w.worker_id: initial_weights(spec.model, seed=50 + i) for i, w in enumerate(workers)}
    sim = simulate(digits_job(rounds=1), workers, test, progress=False, first_states=copy.deepcopy(own))
    config = TrainingConfig(local_epochs=2, batch_size=32, lr=0.2)
    states, sizes = [], []
    for i, w in enumerate(workers):
        model = build_model(spec.model)
        load_numpy_state(model, own[w.worker_id])
        result = train_local(model, w.x, w.y, config=config, dp=None, seed=training_seed(spec.seed, 1, i))
        states.append(result.state)
        sizes.append(result.num_samples)
    share = np.array(sizes, dtype=np.float64) / sum(sizes)
    for name in states[0]:
        want = sum(s[name].astype(np.float64) * a for s, a in zip(states, share))
        np.testing.assert_allclose(sim.final_state[name], want, rtol=1e-5, atol=1e-6)
