"""GA base-model selection end to end: the schedule, the `reported_loss` fitness, the optimum, the deadline fallback
(the probe fitness: test_probe_fitness.py)."""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

from fedbroker.aggregators.selection import Candidate, GeneticSelection, SelectionInput
from fedbroker.aggregators.selection import genetic as genetic_module


def random_problem(seed: int, n: int = 8, dim: int = 20) -> tuple[np.ndarray, list[Candidate]]:
    rng = np.random.default_rng(seed)
    g = rng.normal(size=dim)
    candidates = [
        Candidate(
            worker_id=f"w{i}",
            vector=(g * rng.uniform(-0.5, 1.5) + rng.normal(size=dim)).astype(np.float32),
            num_samples=int(rng.integers(1, 500)),
            reported_loss=float(rng.uniform(0.1, 3.0)),
        )
        for i in range(n)
    ]
    return g, candidates


def brute_force(algo: GeneticSelection, candidates: list[Candidate], g: np.ndarray) -> tuple[list[str], float]:
    fitness, _, _ = algo.fitness_for(candidates, g)
    combos = np.array(list(itertools.combinations(range(len(candidates)), algo.m)))
    values = fitness(combos)
    best = combos[int(np.argmin(values))]
    return [candidates[i].worker_id for i in best], float(values.min())


def test_ga_runs_every_ga_gap_rounds_counting_from_one() -> None:
    algo = GeneticSelection(fitness="reported_loss", m=2, ga_gap=10)
    assert [r for r in range(1, 31) if algo.is_ga_round(r)] == [10, 20, 30]
    g, candidates = random_problem(0)
    assert algo.choose(SelectionInput(candidates=candidates, round_index=9, global_vector=g, rng=np.random.default_rng(0))).stats["ga_ran"] == 0
    assert algo.choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(0))).stats["ga_ran"] == 1


@pytest.mark.parametrize("problem_seed", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("ga_seed", [0, 1, 2])
def test_ga_finds_the_brute_force_optimum_for_8_candidates_choose_3(problem_seed: int, ga_seed: int) -> None:
    g, candidates = random_problem(problem_seed)
    algo = GeneticSelection(fitness="reported_loss", m=3)
    expected, best = brute_force(algo, candidates, g)
    selection = algo.choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(ga_seed)))
    assert selection.chosen == expected
    assert selection.stats["fitness"] == pytest.approx(best)
    assert selection.stats["fitness"] == pytest.approx(selection.stats["loss1"] + 0.2 * selection.stats["loss2"])


def test_with_mu_zero_the_chosen_set_minimises_mean_cosine_to_the_global_model() -> None:
    e1 = np.array([1.0, 0.0, 0.0])
    vectors = {
        "same": [1.0, 0.0, 0.0],  # cos 1
        "diag": [1.0, 1.0, 0.0],  # cos 0.707
        "ortho": [0.0, 1.0, 0.0],  # cos 0
        "near": [0.2, 0.0, 1.0],  # cos 0.196
        "tilt": [1.0, 0.0, 1.0],  # cos 0.707
    }
    # no reported losses: with μ = 0 Loss2 is never needed
    candidates = [Candidate(worker_id=k, vector=np.array(v), num_samples=1) for k, v in vectors.items()]
    selection = GeneticSelection(fitness="reported_loss", m=2, mu=0.0).choose(SelectionInput(candidates=candidates, round_index=10, global_vector=e1, rng=np.random.default_rng(0)
    ))
    assert selection.chosen == ["ortho", "near"]
    assert selection.stats["loss1"] == pytest.approx(0.2 / math.sqrt(1.04) / 2)


def test_reported_loss2_is_the_data_size_weighted_mean() -> None:
    g = np.array([1.0, 0.0])
    candidates = [
        Candidate(worker_id="a", vector=np.array([0.0, 1.0]), num_samples=1, reported_loss=1.0),
        Candidate(worker_id="b", vector=np.array([0.0, 2.0]), num_samples=3, reported_loss=2.0),
        Candidate(worker_id="c", vector=np.array([1.0, 0.0]), num_samples=5, reported_loss=9.0),
    ]
    algo = GeneticSelection(fitness="reported_loss", m=2, mu=1.0)
    selection = algo.choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(0)))
    assert selection.chosen == ["a", "b"]
    assert selection.stats["loss2"] == pytest.approx((1 * 1.0 + 3 * 2.0) / 4)


def test_missing_reported_loss_names_the_worker() -> None:
    g, candidates = random_problem(0)
    candidates[5] = Candidate(worker_id="quiet", vector=candidates[5].vector, num_samples=3)
    with pytest.raises(ValueError, match="quiet"):
        GeneticSelection(fitness="reported_loss", m=3).choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(0)))


def test_update_of_the_wrong_size_names_the_worker_in_a_ga_round() -> None:
    g, candidates = random_problem(0)
    candidates[2] = Candidate(worker_id="short", vector=np.zeros(3), num_samples=3, reported_loss=1.0)
    with pytest.raises(ValueError, match="short"):
        GeneticSelection(fitness="reported_loss", m=3).choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(0)))


def test_deadline_in_the_past_falls_back_to_random_with_a_reason() -> None:
    g, candidates = random_problem(0)
    selection = GeneticSelection(fitness="reported_loss", m=3).choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(0), deadline=time.monotonic() - 1.0
    ))
    assert selection.stats["fallback"] == 1 and selection.stats["ga_ran"] == 0
    assert "ga exceeded its time limit after 0/20 generations" in selection.reason
    assert len(selection.chosen) == len(set(selection.chosen)) == 3


class _RowClock:
    """A fake time.monotonic that jumps past every deadline once the fitness has evaluated `after` rows."""

    def __init__(self, after: int) -> None:
        self.after, self.rows, self.now = after, 0, 0.0

    def monotonic(self) -> float:
        return self.now

    def wrap(self, fitness: genetic_module.Fitness) -> genetic_module.Fitness:
        def counted(pop: np.ndarray) -> np.ndarray:
            self.rows += pop.shape[0]
            if self.rows > self.after:
                self.now = 10.0
            return fitness(pop)
        return counted


def test_deadline_overrun_mid_run_reports_the_generations_done(monkeypatch: pytest.MonkeyPatch) -> None:
    # population 100 keeps 50 and breeds 50 children a generation: the time passes while generation 3's
    # children are evaluated (rows 201-250), so generation 4 is never bred
    clock = _RowClock(after=100 + 2 * 50)
    monkeypatch.setattr(genetic_module, "time", clock)
    algo = GeneticSelection(fitness="reported_loss", m=3)
    fitness_for = algo.fitness_for
    monkeypatch.setattr(GeneticSelection, "fitness_for",
                        lambda self, *a, **k: tuple(clock.wrap(f) if f else f for f in fitness_for(*a, **k)))
    g, candidates = random_problem(0)
    selection = algo.choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(0), deadline=5.0))
    assert selection.stats["fallback"] == 1
    assert "after 3/20 generations" in selection.reason


def test_the_deadline_is_checked_inside_a_generation_not_only_between_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # one huge generation (1,000 chromosomes: 500 children) must not run to its end past the deadline: the
    # time passes on the first block of generation 1's children, and no further chromosome is evaluated
    clock = _RowClock(after=1000)
    monkeypatch.setattr(genetic_module, "time", clock)
    fitness = clock.wrap(lambda pop: pop.sum(axis=1).astype(np.float64))
    result = genetic_module.evolve(fitness, num_candidates=50, m=5, population=1000, generations=20,
                                   rng=np.random.default_rng(0), deadline=5.0)
    assert not result.completed and result.generations_run == 0
    assert clock.rows == 1000 + genetic_module.CHECK_EVERY  # the block that crossed the deadline, then no more
    assert np.isfinite(result.best_fitness)  # the best of the last complete population


def test_same_seed_gives_the_same_choice() -> None:
    g, candidates = random_problem(11, n=30)
    algo = GeneticSelection(fitness="reported_loss", m=6, population=40, generations=10)
    for round_index in (3, 10):
        a = algo.choose(SelectionInput(candidates=candidates, round_index=round_index, global_vector=g, rng=np.random.default_rng(99)))
        b = algo.choose(SelectionInput(candidates=candidates, round_index=round_index, global_vector=g, rng=np.random.default_rng(99)))
        assert a.chosen == b.chosen


def test_ga_beats_almost_every_random_subset_on_a_larger_problem() -> None:
    g, candidates = random_problem(3, n=30)
    algo = GeneticSelection(fitness="reported_loss", m=6)
    fitness, _, _ = algo.fitness_for(candidates, g)
    rng = np.random.default_rng(0)
    random_sets = np.array([rng.choice(30, size=6, replace=False) for _ in range(2000)])
    selection = algo.choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(0)))
    assert selection.stats["fitness"] <= np.quantile(fitness(random_sets), 0.01)


def test_m_at_least_the_number_of_candidates_chooses_everyone() -> None:
    g, candidates = random_problem(0, n=4)
    selection = GeneticSelection(fitness="reported_loss", m=4).choose(SelectionInput(candidates=candidates, round_index=10, global_vector=g, rng=np.random.default_rng(0)))
    assert selection.chosen == ["w0", "w1", "w2", "w3"] and selection.stats["ga_ran"] == 0
