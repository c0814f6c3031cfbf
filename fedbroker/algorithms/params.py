"""The typed parameters of every algorithm a job may name, each a frozen dataclass that checks its values.

They are the kernel's half of the plug-ins: the coordinator validates a job with them at submission, the
worker reads them to report its ISH, and the aggregation service's algorithm classes extend them with the
arithmetic (`FedDNA(FedDNAParams)`), so a job is checked by one set of rules wherever it is read. A bad
value raises a ValueError naming the parameter (the catalogue, `fedbroker.algorithms.catalogue`, adds the field path);
every parameter is bounded, so no job can ask for a close that runs for hours. docs/algorithms.md describes
each one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from numbers import Integral, Real

import numpy as np

from fedbroker.errors import ConfigError, ConfigErrors
from fedbroker.job.spec import EVALUATION_SETS, STALENESS_FUNCTIONS

# ---------------------------------------------------------------- value checks (ValueError naming the parameter)


class ParamErrors(ValueError):
    """Several bad parameters of one algorithm, each a ValueError naming its parameter (`check_all`)."""

    def __init__(self, errors: list[ValueError]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


def check_all(*checks: Callable[[], object]) -> None:
    """Run every check and raise every problem they find at once, so a job is fixed in one pass."""
    errors: list[ValueError] = []
    for check in checks:
        try:
            check()
        except ParamErrors as exc:
            errors.extend(exc.errors)
        except ValueError as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ParamErrors(errors)


def check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    """One of the allowed texts."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def check_bool(name: str, value: object) -> None:
    """A real boolean (YAML's `yes` is one; 1 is not)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false; got {value!r}")


def check_real(name: str, value: object, *, minimum: float, strict: bool, maximum: float = math.inf) -> None:
    """A finite number above `minimum` (strictly or not) and at most `maximum`."""
    ok = False
    if isinstance(value, Real) and not isinstance(value, bool):
        number = float(value)
        ok = math.isfinite(number) and (number > minimum if strict else number >= minimum) and number <= maximum
    if not ok:
        relation = ">" if strict else ">="
        upper = f" and <= {maximum:g}" if math.isfinite(maximum) else ""
        raise ValueError(f"{name} must be a finite number {relation} {minimum:g}{upper}; got {value!r}")


def check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    """An integer in [minimum, maximum] (no upper bound when maximum is None)."""
    if (not isinstance(value, Integral) or isinstance(value, bool) or int(value) < minimum
            or (maximum is not None and int(value) > maximum)):
        allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an integer {allowed}; got {value!r}")


def require_int(name: str, value: object, minimum: int, maximum: int | None = None) -> None:
    """Raise ValueError naming the parameter unless it is an integer in [minimum, maximum] (bools are not
    counts; maximum None = unbounded, for arguments that are not job parameters)."""
    allowed = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be an integer {allowed}, got {value}")


def _require(ok: bool, problem: str) -> None:
    if not ok:
        raise ValueError(problem)


def _is_real(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return False
    return math.isfinite(float(value))


# ---------------------------------------------------------------- alignment


@dataclass(frozen=True, kw_only=True)
class AlignmentParams:
    """Base of every alignment's parameters."""

    @property
    def layerwise(self) -> bool:
        """Whether the job runs the layer-wise scheme (one round per matched layer, matched layers frozen)."""
        return False


@dataclass(frozen=True, kw_only=True)
class NoAlignmentParams(AlignmentParams):
    """`none` takes no parameters."""


VARIANTS = ("mst", "fixed", "random")
GROWTHS = ("prim", "random_client")
DISTANCES = ("manhattan", "euclidean")
LAYER_CHOICES = ("first", "all")
MAX_FREEZE_AFTER = 100_000  # a job's most rounds (fedbroker.job.spec.MAX_ROUNDS): beyond it means "never"


@dataclass(frozen=True, kw_only=True)
class FedDNAParams(AlignmentParams):
    """`feddna`: how trees grow and are measured, which layers align, and for how many rounds."""

    variant: str = "mst"
    growth: str = "prim"
    distance: str = "manhattan"
    include_bias_in_distance: bool = False
    freeze_after: int | None = 2
    layers: str = "first"
    weighted_means: bool = False
    static_fallback: bool = True

    def __post_init__(self) -> None:
        check_all(
            lambda: check_choice("variant", self.variant, VARIANTS),
            lambda: check_choice("growth", self.growth, GROWTHS),
            lambda: check_choice("distance", self.distance, DISTANCES),
            lambda: check_choice("layers", self.layers, LAYER_CHOICES),
            lambda: check_bool("include_bias_in_distance", self.include_bias_in_distance),
            lambda: check_bool("weighted_means", self.weighted_means),
            lambda: check_bool("static_fallback", self.static_fallback),
            self._check_freeze_after,
        )

    def _check_freeze_after(self) -> None:
        if self.freeze_after is not None:  # None: never freeze
            check_int("freeze_after", self.freeze_after, minimum=0, maximum=MAX_FREEZE_AFTER)


KL_MODES = ("exact", "reference")
OUTPUT_WEIGHTINGS = ("class_share", "plain")
# "oneshot": every round matches every hidden layer at once (PFNM); "layerwise": round r matches layer r only,
# layers before it frozen (NAFI Appendix D; fedbroker.job.alignment_plan counts the rounds)
MATCHING_MODES = ("oneshot", "layerwise")
# Upper bounds: a close stays within minutes on one core, and no value overflows.
MAX_ITERATIONS = 100            # re-assignment sweeps; each solves one assignment per client
MAX_GLOBAL_WIDTH = 65_536       # a model layer's widest (fedbroker.job.spec.MAX_WIDTH)
MAX_COUNT_CLIP = 100_000
MAX_VARIANCE = 1e6              # sigma2, sigma0_2 (and gamma0): below it the precisions stay representable
MIN_VARIANCE = 1e-6
MAX_COEFFICIENT = 1e3           # popularity_coef, lam, |bias_prior_mean|


@dataclass(frozen=True, kw_only=True)
class MatchingPriors:
    """The Bayesian matching engine's priors and bounds, which PFNM and NAFI share; defaults follow the public
    PFNM code (see docs/algorithms.md, `pfnm`)."""

    sigma2: float = 1.0
    sigma0_2: float = 1.0
    gamma0: float = 1.0
    iterations: int = 5
    popularity_coef: float = 1.0
    count_clip: int = 10
    max_global_width: int = 700
    bias_prior_mean: float = 0.1


@dataclass(frozen=True, kw_only=True)
class MatchingParams(MatchingPriors):
    """Everything the matching engine reads: the priors, and NAFI's KL term (λ 0: none)."""

    lam: float = 0.0
    kl_mode: str = "exact"
    kl_count_clip: int = 10

    def __post_init__(self) -> None:
        check_all(
            lambda: check_real("sigma2", self.sigma2, minimum=MIN_VARIANCE, strict=False, maximum=MAX_VARIANCE),
            lambda: check_real("sigma0_2", self.sigma0_2, minimum=MIN_VARIANCE, strict=False, maximum=MAX_VARIANCE),
            lambda: check_real("gamma0", self.gamma0, minimum=MIN_VARIANCE, strict=False, maximum=MAX_VARIANCE),
            lambda: check_int("iterations", self.iterations, minimum=0, maximum=MAX_ITERATIONS),
            lambda: check_real("popularity_coef", self.popularity_coef, minimum=0.0, strict=False,
                               maximum=MAX_COEFFICIENT),
            lambda: check_int("count_clip", self.count_clip, minimum=1, maximum=MAX_COUNT_CLIP),
            lambda: check_int("max_global_width", self.max_global_width, minimum=1, maximum=MAX_GLOBAL_WIDTH),
            lambda: check_real("bias_prior_mean", self.bias_prior_mean, minimum=-MAX_COEFFICIENT, strict=False,
                               maximum=MAX_COEFFICIENT),
            lambda: check_real("lam", self.lam, minimum=0.0, strict=False, maximum=MAX_COEFFICIENT),
            lambda: check_choice("kl_mode", self.kl_mode, KL_MODES),
            lambda: check_int("kl_count_clip", self.kl_count_clip, minimum=1, maximum=MAX_COUNT_CLIP),
        )


@dataclass(frozen=True, kw_only=True)
class PFNMParams(AlignmentParams, MatchingPriors):
    """`pfnm`: the matching engine's priors and bounds, and how the output layer weighs each client."""

    output_weighting: str = "class_share"
    mode: str = "oneshot"

    def __post_init__(self) -> None:
        check_all(self.matching_params,
                  lambda: check_choice("output_weighting", self.output_weighting, OUTPUT_WEIGHTINGS),
                  lambda: check_choice("mode", self.mode, MATCHING_MODES))

    @property
    def layerwise(self) -> bool:
        """`mode: layerwise`."""
        return self.mode == "layerwise"

    def matching_params(self) -> MatchingParams:
        """The engine's parameters, those this algorithm has (PFNM: no KL term; checked on the way, every bad one
        at once, so a bad prior fails at submission)."""
        return MatchingParams(**{f.name: getattr(self, f.name) for f in fields(MatchingParams) if hasattr(self, f.name)})


@dataclass(frozen=True, kw_only=True)
class NAFIParams(PFNMParams):
    """`nafi`: PFNM's parameters plus the weight λ of the KL term and how it is computed."""

    lam: float = 0.01
    kl_mode: str = "exact"
    kl_count_clip: int = 10


# ---------------------------------------------------------------- weighting

ISH_FORMS: tuple[str, ...] = ("ratio", "one_minus")


def check_max_share(value: object) -> None:
    """`max_share` (the largest coefficient any one update may get) must be a number in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not 0.0 < float(value) <= 1.0:
        raise ValueError(f"max_share must be a number in (0, 1], got {value!r}")


@dataclass(frozen=True, kw_only=True)
class WeightingParams:
    """Base of every weighting's parameters; what the service and the workers read of any weighting."""

    @property
    def proportional(self) -> bool:
        """Whether the normalised weights are raw / Σ raw, so a running Σ raw·x / Σ raw is the round's mean
        (False under a `max_share` cap: the close needs every update's row)."""
        return True

    @property
    def reported_ish_form(self) -> str:
        """The form of the ISH workers report (DWFed's `ish_form`; any other weighting ignores the ISH)."""
        return ISH_FORMS[0]


@dataclass(frozen=True, kw_only=True)
class FedAvgParams(WeightingParams):
    """`fedavg`: the cap on any one update's coefficient."""

    max_share: float = 1.0

    def __post_init__(self) -> None:
        check_max_share(self.max_share)

    @property
    def proportional(self) -> bool:
        """Proportional unless capped."""
        return self.max_share >= 1.0


@dataclass(frozen=True, kw_only=True)
class UniformParams(WeightingParams):
    """`uniform` takes no parameters."""


@dataclass(frozen=True, kw_only=True)
class DWFedParams(WeightingParams):
    """`dwfed`: which reading of eq. 12 the workers' ISH follows, and the cap on any one coefficient."""

    ish_form: str = "ratio"
    max_share: float = 1.0

    def __post_init__(self) -> None:
        check_all(lambda: check_choice("ish_form", self.ish_form, ISH_FORMS), lambda: check_max_share(self.max_share))

    @property
    def proportional(self) -> bool:
        """Proportional unless capped."""
        return self.max_share >= 1.0

    @property
    def reported_ish_form(self) -> str:
        """The job's form."""
        return self.ish_form


# ---------------------------------------------------------------- selection

MAX_M = 100_000  # the most updates a round may choose: the most clients it may have (schedule.clients_per_round)


@dataclass(frozen=True, kw_only=True)
class SelectionParams:
    """Base of every selection's parameters; what the kernel reads of any selection."""

    @property
    def chooses_at_most(self) -> int | None:
        """The most updates a round aggregates (None: every one it receives): K in a worker's ISH."""
        return None

    @property
    def probe_set(self) -> str:
        """The probe set the selection evaluates models on ("" for none), checked against the model."""
        return ""

    def rounds_problem(self, rounds: int) -> ConfigError | None:
        """Why a job of `rounds` rounds would never use this selection as it says (None when it would)."""
        return None


@dataclass(frozen=True, kw_only=True)
class AllParams(SelectionParams):
    """`all` takes no parameters."""


@dataclass(frozen=True, kw_only=True)
class RandomParams(SelectionParams):
    """`random`: how many updates a round aggregates."""

    m: int

    def __post_init__(self) -> None:
        require_int("m", self.m, 1, MAX_M)  # the most clients a round may have

    @property
    def chooses_at_most(self) -> int | None:
        """m."""
        return self.m


FITNESS_MODES: tuple[str, ...] = ("probe", "reported_loss")
MAX_PROBE_SIZE = 10_000         # probe samples: one forward of a population chunk stays small
MAX_PROBE_SEED = 2**32 - 1
# Upper bounds, so a GA round closes within minutes on one core whatever the job says: at most
# MAX_POPULATION · MAX_GENERATIONS children, each O(m), and one (population × m) array at a time.
MAX_POPULATION = 1_000
MAX_GENERATIONS = 1_000
MAX_POPULATION_TIMES_M = 10_000_000
MAX_GA_GAP = 100_000            # a job's most rounds
MAX_MU = 1e3


@dataclass(frozen=True, kw_only=True)
class GeneticParams(SelectionParams):
    """`ga`: m, the genetic algorithm's size and rates, how often it runs, and what its fitness reads."""

    m: int
    population: int = 100
    survival: float = 0.5
    mutation_rate: float = 0.1
    generations: int = 20
    mu: float = 0.2
    ga_gap: int = 10
    fitness: str = "probe"
    probe_dataset: str = ""
    probe_size: int = 256
    probe_seed: int = 0

    def __post_init__(self) -> None:
        counts = all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in (self.population, self.m))
        check_all(
            lambda: require_int("m", self.m, 1, MAX_M),
            lambda: require_int("population", self.population, 2, MAX_POPULATION),
            lambda: require_int("generations", self.generations, 1, MAX_GENERATIONS),
            lambda: require_int("ga_gap", self.ga_gap, 1, MAX_GA_GAP),
            lambda: require_int("probe_size", self.probe_size, 1, MAX_PROBE_SIZE),
            lambda: require_int("probe_seed", self.probe_seed, 0, MAX_PROBE_SEED),
            lambda: _require(not counts or self.population * self.m <= MAX_POPULATION_TIMES_M,
                             f"population × m must be <= {MAX_POPULATION_TIMES_M}, got {self.population} × {self.m}"),
            lambda: _require(_is_real(self.survival) and 0.0 < self.survival < 1.0,
                             f"survival must be a number in (0, 1), got {self.survival!r}"),
            lambda: _require(_is_real(self.mutation_rate) and 0.0 <= self.mutation_rate <= 1.0,
                             f"mutation_rate must be a number in [0, 1], got {self.mutation_rate!r}"),
            lambda: _require(_is_real(self.mu) and 0.0 <= self.mu <= MAX_MU,
                             f"mu must be a number in [0, {MAX_MU:g}], got {self.mu!r}"),
            lambda: check_choice("fitness", self.fitness, FITNESS_MODES),
            self._check_probe_dataset,
        )

    def rounds_problem(self, rounds: int) -> ConfigError | None:
        """The GA runs in rounds ga_gap, 2·ga_gap, …: a job that never reaches one would choose at random in
        every round while it says `ga`."""
        if rounds >= self.ga_gap:
            return None
        return ConfigError("aggregation.selection_params.ga_gap", (
            f"the genetic algorithm runs every ga_gap = {self.ga_gap} rounds (rounds {self.ga_gap}, {2 * self.ga_gap}, "
            f"…), but training.rounds is {rounds}: every round would choose {self.m} update(s) at random. Set ga_gap "
            f"to at most {rounds}, training.rounds to at least {self.ga_gap}, or use selection: random"))

    def _check_probe_dataset(self) -> None:
        field = "aggregation.selection_params.probe_dataset"
        known = ", ".join(EVALUATION_SETS)
        if self.fitness == "probe" and not self.probe_dataset:
            raise ConfigError(field, f"fitness 'probe' needs a probe set the aggregation service holds (public or "
                                     f"synthetic data, never a worker's): one of {known}; or set fitness: reported_loss")
        if self.probe_dataset and self.probe_dataset not in EVALUATION_SETS:
            raise ConfigError(field, f"unknown probe set {self.probe_dataset!r}; the service holds {known}")
        if self.probe_dataset and self.fitness != "probe":
            raise ConfigError(field, f"is only read with fitness 'probe', not {self.fitness!r}; remove it")

    @property
    def chooses_at_most(self) -> int | None:
        """m."""
        return self.m

    @property
    def probe_set(self) -> str:
        """`probe_dataset` (read only with fitness `probe`)."""
        return self.probe_dataset


# ---------------------------------------------------------------- asynchronous mode's staleness function

# The defaults of each function's parameters (FedAsync's experiments).
STALENESS_DEFAULTS: Mapping[str, Mapping[str, float]] = {
    "constant": {},
    "polynomial": {"a": 0.5},
    "hinge": {"a": 10.0, "b": 4.0},
}


@dataclass(frozen=True)
class Staleness:
    """s(τ): `constant` 1; `polynomial` (1 + τ)^(−a); `hinge` 1 if τ ≤ b else 1 / (a(τ − b) + 1)."""

    kind: str = "polynomial"
    a: float = 0.5
    b: float = 0.0

    def __call__(self, tau: int) -> float:
        """The factor of an update `tau` versions behind."""
        if tau < 0:
            raise ValueError(f"staleness must be >= 0, got {tau}")
        if self.kind == "constant":
            return 1.0
        if self.kind == "polynomial":
            return float((1.0 + tau) ** (-self.a))
        if tau <= self.b:
            return 1.0
        return 1.0 / (self.a * (tau - self.b) + 1.0)


def staleness_function(kind: str, params: Mapping[str, object] | None = None, *,
                       where: str = "schedule") -> Staleness:
    """The named staleness function with its parameters (defaults filled in); a bad name or value raises
    a ConfigError naming the field (`<where>.staleness`, `<where>.staleness_params.<name>`), every one at once."""
    if kind not in STALENESS_FUNCTIONS:
        raise ConfigError(f"{where}.staleness", f"must be one of {', '.join(STALENESS_FUNCTIONS)}, got {kind!r}")
    given = dict(params or {})
    defaults = STALENESS_DEFAULTS[kind]
    known = ", ".join(sorted(defaults)) or "none"
    problems = [ConfigError(f"{where}.staleness_params.{name}", f"is not a parameter of {kind!r} (it takes: {known})")
                for name in sorted(set(given) - set(defaults))]
    values = {**defaults}
    for name, value in sorted(given.items()):
        if name not in defaults:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            problems.append(ConfigError(f"{where}.staleness_params.{name}", f"must be a finite number, got {value!r}"))
        elif not 0.0 <= value <= 1000.0:  # a < 0 would make s grow with τ; hinge's b is a staleness in versions
            problems.append(ConfigError(f"{where}.staleness_params.{name}", f"must be in [0, 1000], got {value:g}"))
        else:
            values[name] = float(value)
    if problems:
        raise problems[0] if len(problems) == 1 else ConfigErrors(problems)
    return Staleness(kind, values.get("a", 0.0), values.get("b", 0.0))
