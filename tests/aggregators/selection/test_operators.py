"""The GA operators as pure functions: crossover, mutation, breeding, and evolve on a toy fitness."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbroker.aggregators.selection import breed, crossover, evolve, initial_population, mutate


@st.composite
def parent_pairs(draw: st.DrawFn) -> tuple[int, np.ndarray, np.ndarray, int]:
    n = draw(st.integers(min_value=2, max_value=30))
    m = draw(st.integers(min_value=1, max_value=n))
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    rng = np.random.default_rng(seed)
    a = rng.choice(n, size=m, replace=False)
    b = rng.choice(n, size=m, replace=False)
    return n, a, b, seed


@settings(max_examples=300, deadline=None)
@given(parent_pairs())
def test_crossover_children_keep_m_unique_ids_and_all_common_ids(case: tuple[int, np.ndarray, np.ndarray, int]) -> None:
    _, a, b, seed = case
    common = set(a.tolist()) & set(b.tolist())
    child_a, child_b = crossover(a, b, np.random.default_rng(seed))
    for child in (child_a, child_b):
        assert child.size == a.size
        assert len(set(child.tolist())) == a.size
        assert common <= set(child.tolist())
    # ids are exchanged, never invented or lost
    assert sorted(child_a.tolist() + child_b.tolist()) == sorted(a.tolist() + b.tolist())
    unique = a.size - len(common)
    if unique >= 2:  # a non-empty proper subset was swapped: both children are new sets
        assert set(child_a.tolist()) not in (set(a.tolist()), set(b.tolist()))
        assert set(child_b.tolist()) not in (set(a.tolist()), set(b.tolist()))
    else:
        assert child_a.tolist() == a.tolist() and child_b.tolist() == b.tolist()


def test_crossover_swaps_only_part_of_the_unique_ids() -> None:
    a, b = np.array([0, 1, 2, 3, 4]), np.array([0, 5, 6, 7, 8])
    for seed in range(50):
        child_a, _ = crossover(a, b, np.random.default_rng(seed))
        taken = len(set(child_a.tolist()) & {5, 6, 7, 8})
        assert 1 <= taken <= 3 and 0 in child_a


@settings(max_examples=300, deadline=None)
@given(
    n=st.integers(min_value=2, max_value=40),
    m_frac=st.floats(min_value=0.0, max_value=1.0),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_mutation_changes_exactly_one_contiguous_block_with_ids_not_in_the_chromosome(
    n: int, m_frac: float, seed: int
) -> None:
    m = max(1, min(n - 1, round(m_frac * n)))
    rng = np.random.default_rng(seed)
    chromosome = rng.choice(n, size=m, replace=False)
    mutant = mutate(chromosome, n, rng)
    changed = np.flatnonzero(mutant != chromosome)
    assert changed.size >= 1
    assert changed.size <= min(math.ceil(m / 2), n - m)
    assert np.all(np.diff(changed) == 1), "the changed genes form one contiguous block"
    assert not set(mutant[changed].tolist()) & set(chromosome.tolist())
    assert len(set(mutant.tolist())) == m
    assert np.all((mutant >= 0) & (mutant < n))


def test_mutation_block_lengths_cover_one_to_half_m() -> None:
    chromosome = np.arange(6)
    lengths = {int((mutate(chromosome, 40, np.random.default_rng(s)) != chromosome).sum()) for s in range(300)}
    assert lengths == {1, 2, 3}


def test_mutation_of_a_chromosome_holding_every_id_is_a_no_op() -> None:
    chromosome = np.array([2, 0, 1])
    assert mutate(chromosome, 3, np.random.default_rng(0)).tolist() == [2, 0, 1]


def test_initial_population_holds_distinct_ids_per_chromosome() -> None:
    pop = initial_population(9, 4, 50, np.random.default_rng(1))
    assert pop.shape == (50, 4)
    assert all(len(set(row.tolist())) == 4 for row in pop)
    assert pop.min() >= 0 and pop.max() < 9


def test_breed_gives_the_requested_number_of_valid_children() -> None:
    rng = np.random.default_rng(5)
    survivors = initial_population(12, 4, 7, rng)
    children = breed(survivors, 13, 12, 0.5, rng)
    assert children.shape == (13, 4)
    assert all(len(set(row.tolist())) == 4 for row in children)


def test_evolve_finds_the_subset_with_the_smallest_sum() -> None:
    scores = np.array([5.0, 3.0, 9.0, 0.5, 7.0, 1.0, 8.0, 2.0, 6.0, 4.0])
    result = evolve(
        lambda pop: scores[pop].sum(axis=1), num_candidates=10, m=3, rng=np.random.default_rng(0)
    )
    assert result.completed and result.generations_run == 20
    assert result.best.tolist() == [3, 5, 7]
    assert result.best_fitness == 3.5


def test_evolve_stops_at_a_passed_deadline_without_evaluating() -> None:
    calls: list[int] = []

    def fitness(pop: np.ndarray) -> np.ndarray:
        calls.append(pop.shape[0])
        return np.zeros(pop.shape[0])

    result = evolve(fitness, num_candidates=10, m=3, rng=np.random.default_rng(0), deadline=-math.inf)
    assert not result.completed and result.generations_run == 0 and calls == []
