"""Genetic base-model selection (Wang, Zhong & Wang 2025, Algorithm 1).

Every `ga_gap`-th round a genetic algorithm picks the m of N updates whose aggregate should teach the
global model most: updates whose features are near-orthogonal to the global model's (Loss1) and whose
aggregate classifies a probe set well (Loss2). Other rounds
pick m at random. A chromosome is m distinct candidate indices; gene order carries no meaning except
that mutation replaces a contiguous block of positions.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from fedbroker.aggregators.selection.base import (
    SELECTION,
    Candidate,
    ProbeRequest,
    Selection,
    SelectionInput,
    random_choice,
)
from fedbroker.aggregators.selection.probe import Probe
from fedbroker.algorithms.params import GeneticParams

CHECK_EVERY = 64                # children bred (or chromosomes evaluated) between two looks at the deadline

Fitness = Callable[[np.ndarray], np.ndarray]
"""(P, m) chromosomes of candidate indices -> (P,) values to minimise."""


# --- operators -------------------------------------------------------------------------------------


def initial_population(num_candidates: int, m: int, size: int, rng: np.random.Generator) -> np.ndarray:
    """`size` chromosomes, each m distinct indices drawn uniformly from range(num_candidates)."""
    if not 1 <= m <= num_candidates:
        raise ValueError(f"m must lie in [1, {num_candidates}], got {m}")
    return np.argsort(rng.random((size, num_candidates)), axis=1)[:, :m].astype(np.int64)


def crossover(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Keep the ids both parents share; swap a random non-empty *proper* subset of their unique ids.

    Swapping all unique ids would only give back the parents (chromosomes are sets), so with fewer
    than two unique ids each the children are copies of the parents.
    """
    a = np.asarray(a, dtype=np.int64)
    b = np.asarray(b, dtype=np.int64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"parents must be 1-D of equal length, got shapes {a.shape} and {b.shape}")
    only_a = np.flatnonzero(~np.isin(a, b))
    only_b = np.flatnonzero(~np.isin(b, a))
    child_a, child_b = a.copy(), b.copy()
    unique = only_a.size
    if unique < 2:
        return child_a, child_b
    k = int(rng.integers(1, unique))  # 1 … unique-1
    pos_a = rng.choice(only_a, size=k, replace=False)
    pos_b = rng.choice(only_b, size=k, replace=False)
    child_a[pos_a] = b[pos_b]
    child_b[pos_b] = a[pos_a]
    return child_a, child_b


def mutate(
    chromosome: np.ndarray, num_candidates: int, rng: np.random.Generator, *, max_block: int | None = None
) -> np.ndarray:
    """Replace one contiguous block of 1 … ⌈m/2⌉ genes with distinct ids not in the chromosome.

    The block is also capped by how many outside ids exist; with none (m = N) the chromosome is
    returned unchanged.
    """
    c = np.asarray(chromosome, dtype=np.int64)
    m = c.size
    outside = np.setdiff1d(np.arange(num_candidates, dtype=np.int64), c)
    cap = min(max_block if max_block is not None else math.ceil(m / 2), outside.size, m)
    if cap < 1:
        return c.copy()
    length = int(rng.integers(1, cap + 1))
    start = int(rng.integers(0, m - length + 1))
    out = c.copy()
    out[start : start + length] = rng.choice(outside, size=length, replace=False)
    return out


def _adjacent_pairs(count: int) -> Iterator[tuple[int, int]]:
    """(0,1), (2,3), … then (1,2), (3,4), … and round again, so any number of children can be bred."""
    if count == 1:
        while True:
            yield 0, 0
    while True:
        for offset in (0, 1):
            for j in range(offset, count - 1, 2):
                yield j, j + 1


def breed(
    survivors: np.ndarray, count: int, num_candidates: int, mutation_rate: float, rng: np.random.Generator,
    *, deadline: float | None = None,
) -> np.ndarray:
    """`count` children: crossover of adjacent survivors (best first), each then mutated with probability
    `mutation_rate`. Raises `GenerationOverrun` once `deadline` (time.monotonic()) has passed."""
    m = survivors.shape[1]
    children = np.empty((count, m), dtype=np.int64)
    filled = 0
    pairs = _adjacent_pairs(survivors.shape[0])
    while filled < count:
        if filled % CHECK_EVERY == 0 and _overrun(deadline):
            raise GenerationOverrun(filled)
        i, j = next(pairs)
        for child in crossover(survivors[i], survivors[j], rng):
            if filled < count:
                children[filled] = child
                filled += 1
    flips = rng.random(count) < mutation_rate
    for done, idx in enumerate(np.flatnonzero(flips)):
        if done % CHECK_EVERY == 0 and _overrun(deadline):
            raise GenerationOverrun(count)
        children[idx] = mutate(children[idx], num_candidates, rng)
    return children


class GenerationOverrun(Exception):
    """The deadline passed inside a generation: `evolve` keeps the last complete generation's best."""


def _evaluate(fitness: Fitness, pop: np.ndarray, deadline: float | None) -> np.ndarray:
    """fitness(pop) in blocks of CHECK_EVERY chromosomes, looking at the deadline between blocks."""
    if deadline is None:
        return np.asarray(fitness(pop), dtype=np.float64)
    out = np.empty(pop.shape[0], dtype=np.float64)
    for start in range(0, pop.shape[0], CHECK_EVERY):
        if _overrun(deadline):
            raise GenerationOverrun(start)
        out[start:start + CHECK_EVERY] = np.asarray(fitness(pop[start:start + CHECK_EVERY]), dtype=np.float64)
    return out


@dataclass(frozen=True)
class Evolution:
    """The best chromosome found (sorted indices), its fitness, and whether every generation ran."""

    best: np.ndarray
    best_fitness: float
    generations_run: int
    completed: bool


def evolve(
    fitness: Fitness,
    *,
    num_candidates: int,
    m: int,
    population: int = 100,
    survival: float = 0.5,
    mutation_rate: float = 0.1,
    generations: int = 20,
    rng: np.random.Generator,
    deadline: float | None = None,
) -> Evolution:
    """Minimise `fitness` over m-subsets of range(num_candidates).

    Each generation keeps the best `survival` share (elitism: the best never gets worse) and refills the
    population with children. `deadline` (a time.monotonic() value) is checked inside every generation too
    (every CHECK_EVERY children bred or chromosomes evaluated), so one huge generation cannot overrun it by
    much; an overrun stops early with completed=False and the best of the last complete generation
    (fitness NaN if nothing was evaluated).
    """
    survivors_n = min(population - 1, max(1, round(population * survival)))
    pop = initial_population(num_candidates, m, population, rng)
    try:
        fit = _evaluate(fitness, pop, deadline)
    except GenerationOverrun:
        return Evolution(best=np.sort(pop[0]), best_fitness=math.nan, generations_run=0, completed=False)
    ran = 0
    completed = True
    for _ in range(generations):
        order = np.argsort(fit, kind="stable")[:survivors_n]
        survivors, survivor_fit = pop[order], fit[order]
        try:
            children = breed(survivors, population - survivors_n, num_candidates, mutation_rate, rng,
                             deadline=deadline)
            children_fit = _evaluate(fitness, children, deadline)
        except GenerationOverrun:
            completed = False
            break
        pop = np.concatenate([survivors, children])
        fit = np.concatenate([survivor_fit, children_fit])
        ran += 1
    best = int(np.argmin(fit))
    return Evolution(best=np.sort(pop[best]), best_fitness=float(fit[best]), generations_run=ran, completed=completed)


def _overrun(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


# --- fitness ---------------------------------------------------------------------------------------


def cosine_to_global(candidates: Sequence[Candidate], global_vector: np.ndarray) -> np.ndarray:
    """cos(w_k, w_global) per candidate, computed once per round (a zero vector counts as orthogonal)."""
    g = np.asarray(global_vector, dtype=np.float64).ravel()
    g_norm = float(np.linalg.norm(g))
    if not math.isfinite(g_norm):
        raise ValueError("global vector holds non-finite values")
    out = np.zeros(len(candidates))
    for k, c in enumerate(candidates):
        v = np.asarray(c.vector, dtype=np.float64).ravel()
        if v.shape != g.shape:
            raise ValueError(
                f"worker {c.worker_id!r}: update has {v.size} parameters, the global model {g.size}"
            )
        v_norm = float(np.linalg.norm(v))
        if not math.isfinite(v_norm):
            raise ValueError(f"worker {c.worker_id!r}: update holds non-finite values")
        if v_norm > 0.0 and g_norm > 0.0:
            out[k] = float(np.dot(v, g)) / (v_norm * g_norm)
    return out


def reported_loss2(candidates: Sequence[Candidate]) -> Fitness:
    """Loss2 per chromosome: the data-size-weighted mean of the chosen workers' reported losses
    (plain mean when the chosen workers hold no samples)."""
    losses = np.empty(len(candidates))
    for k, c in enumerate(candidates):
        if c.reported_loss is None or not math.isfinite(float(c.reported_loss)):
            raise ValueError(
                f"worker {c.worker_id!r}: fitness 'reported_loss' needs a finite reported loss, got {c.reported_loss!r}"
            )
        losses[k] = float(c.reported_loss)
    sizes = np.array([float(c.num_samples) for c in candidates])

    def loss2(pop: np.ndarray) -> np.ndarray:
        w, chosen = sizes[pop], losses[pop]
        total = w.sum(axis=1)
        weighted = np.divide((w * chosen).sum(axis=1), total, out=np.zeros(pop.shape[0]), where=total > 0)
        mixed: np.ndarray = np.where(total > 0, weighted, chosen.mean(axis=1))
        return mixed

    return loss2


def candidate_matrix(candidates: Sequence[Candidate], size: int) -> np.ndarray:
    """The candidates' flat parameter vectors as rows (N, size), each checked for shape and finiteness;
    float32 when every update is (as uploads are), so the stack costs no more than the updates themselves."""
    wide = any(np.asarray(c.vector).dtype != np.float32 for c in candidates)
    out = np.empty((len(candidates), size), dtype=np.float64 if wide else np.float32)
    for k, c in enumerate(candidates):
        v = np.asarray(c.vector).ravel()
        if v.shape != (size,):
            raise ValueError(f"worker {c.worker_id!r}: update has {v.size} parameters, the model {size}")
        if not np.all(np.isfinite(v)):
            raise ValueError(f"worker {c.worker_id!r}: update holds non-finite values")
        out[k] = v
    return out


def aggregate_loss2(candidates: Sequence[Candidate], vectors: np.ndarray, probe: Probe) -> Fitness:
    """Loss2 per chromosome: the probe set's cross-entropy of the aggregate Σ α_k w_k of the chosen updates,
    α the job's coefficients for that set (`probe.coefficients` of their raw weights). Every chromosome
    of a call is one row of a coefficient matrix, so the call's aggregates are one product and one
    batched forward; a set already scored is not scored again."""
    raw = np.array([float(c.raw_weight) for c in candidates])
    cache: dict[tuple[int, ...], float] = {}

    def loss2(pop: np.ndarray) -> np.ndarray:
        keys = [tuple(sorted(int(i) for i in row)) for row in pop]
        todo = sorted({k for k in keys if k not in cache})
        if todo:
            coef = np.zeros((len(todo), len(candidates)))
            for r, key in enumerate(todo):
                idx = np.array(key)
                coef[r, idx] = probe.coefficients(raw[idx])
            step = probe.models_per_forward  # aggregates are built a stack at a time: memory stays bounded
            values = np.concatenate([probe.cross_entropy(coef[a:a + step].astype(vectors.dtype) @ vectors)
                                     for a in range(0, len(todo), step)])
            for key, value in zip(todo, values):
                if not math.isfinite(float(value)):
                    raise ValueError(f"the probe cross-entropy of candidates {list(key)} is {value!r}")
                cache[key] = float(value)
        return np.array([cache[k] for k in keys])

    return loss2


# --- the registered selector -----------------------------------------------------------------------


@SELECTION.register("ga")
class GeneticSelection(GeneticParams):
    """Minimise Loss1 + μ·Loss2 over m-subsets every `ga_gap`-th round; m at random otherwise.

    `fitness: probe` (the paper's reading, eq. 33 and §4): Loss1 = mean cosine between the penultimate-layer
    features the global model and each chosen model produce on a probe set the service holds; Loss2 = the
    probe cross-entropy of the chosen updates' aggregate. `fitness: reported_loss`: Loss1 on raw parameter
    vectors, Loss2 from the workers' reported losses (no probe set). See docs/algorithms.md, `ga`.
    """

    def is_ga_round(self, round_index: int) -> bool:
        """Rounds ga_gap, 2·ga_gap, … (1-based): the GA runs only after some federated iterations."""
        return round_index % self.ga_gap == 0

    def needs_vectors(self, round_index: int) -> bool:
        """Only GA rounds read the parameters."""
        return self.is_ga_round(round_index)

    def probe_request(self, round_index: int) -> ProbeRequest | None:
        """The probe set a GA round with `fitness: probe` evaluates models on."""
        if self.fitness != "probe" or not self.is_ga_round(round_index):
            return None
        return ProbeRequest(self.probe_dataset, self.probe_size, self.probe_seed)

    def fitness_for(
        self,
        candidates: Sequence[Candidate],
        global_vector: np.ndarray,
        probe: Probe | None = None,
    ) -> tuple[Fitness, Fitness, Fitness | None]:
        """(fitness, loss1, loss2) over chromosomes of indices into `candidates`; loss2 is None when μ = 0."""
        vectors = None
        if self.fitness == "probe":
            if probe is None:
                raise ValueError("fitness 'probe' needs the probe set from the service")
            vectors = candidate_matrix(candidates, probe.size)
            own = candidate_matrix([Candidate("global model", np.asarray(global_vector), 0)], probe.size)[0]
            cos = probe.feature_cosine(vectors, own)
        else:
            cos = cosine_to_global(candidates, global_vector)

        def loss1(pop: np.ndarray) -> np.ndarray:
            mean_cosine: np.ndarray = cos[pop].mean(axis=1)
            return mean_cosine

        if self.mu == 0.0:
            return loss1, loss1, None
        loss2 = reported_loss2(candidates) if vectors is None or probe is None \
            else aggregate_loss2(candidates, vectors, probe)
        mu = float(self.mu)

        def fitness(pop: np.ndarray) -> np.ndarray:
            return loss1(pop) + mu * loss2(pop)

        return fitness, loss1, loss2

    def choose(self, problem: SelectionInput) -> Selection:
        """The GA's best m-subset on GA rounds, m at random on the others (or when the GA overruns). Stats say
        which chose: `ga_round` (this round is one of the GA's), `ga_ran`, `fallback` (the GA overran)."""
        candidates, rng, round_index = problem.candidates, problem.rng, problem.round_index
        ga_round = float(self.is_ga_round(round_index))
        if self.m >= len(candidates):
            return Selection(chosen=[c.worker_id for c in candidates],
                             stats={"ga_round": ga_round, "ga_ran": 0.0, "fallback": 0.0})
        if not ga_round:
            chosen = random_choice(candidates, self.m, rng)
            return Selection(chosen=chosen, stats={"ga_round": 0.0, "ga_ran": 0.0, "fallback": 0.0})

        started = time.monotonic()
        fitness, loss1, loss2 = self.fitness_for(candidates, problem.global_vector, problem.probe)
        result = evolve(
            fitness,
            num_candidates=len(candidates),
            m=self.m,
            population=self.population,
            survival=self.survival,
            mutation_rate=self.mutation_rate,
            generations=self.generations,
            rng=rng,
            deadline=problem.deadline,
        )
        seconds = time.monotonic() - started
        if not result.completed:
            return Selection(
                chosen=random_choice(candidates, self.m, rng),
                stats={
                    "ga_round": 1.0,
                    "ga_ran": 0.0,
                    "fallback": 1.0,
                    "seconds": seconds,
                    "generations": float(result.generations_run),
                },
                reason=(
                    f"ga exceeded its time limit after {result.generations_run}/{self.generations} generations; "
                    f"chose {self.m} at random"
                ),
            )
        best = result.best[None, :]
        stats = {
            "ga_round": 1.0,
            "ga_ran": 1.0,
            "fallback": 0.0,
            "fitness": result.best_fitness,
            "loss1": float(loss1(best)[0]),
            "seconds": seconds,
            "generations": float(result.generations_run),
        }
        if loss2 is not None:  # with μ = 0 Loss2 is never computed, so there is nothing to report
            stats["loss2"] = float(loss2(best)[0])
        return Selection(chosen=[candidates[int(i)].worker_id for i in result.best], stats=stats)
