"""The typed parameters of the robust aggregation rules (`aggregation.robust`), each a frozen dataclass that
checks its values, as `fedbroker.algorithms.params` does for the other kinds.

A robust rule replaces the round's weighted mean of the updates Δ_i = x_i − x_global by an estimate that a
few arbitrary (Byzantine) updates cannot drag far: docs/algorithms.md ("Robust aggregation") says what each
one does and what it does not protect against. Every parameter is bounded, so no job can ask for a close
that runs for hours; a bad value raises a ValueError naming the parameter (the catalogue adds the path).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from fedbroker.algorithms.params import (
    MAX_PROBE_SEED,
    MAX_PROBE_SIZE,
    check_all,
    check_int,
    check_real,
)
from fedbroker.errors import ConfigError
from fedbroker.job.spec import EVALUATION_SETS

# How a close judges each update a rule saw, from kept / expected: the weight the rule gave it over what the
# plain mean it replaces would have (docs/algorithms.md, "Robust aggregation"). Read by the aggregation service's
# stats and metrics and by the close report's verdicts (fedbroker.close_report).
DISCARDED_BELOW = 0.1      # less than a tenth of its share: discarded (0 for a rule that drops it outright)
DOWNWEIGHTED_BELOW = 0.5   # less than half of it: down-weighted

MAX_ASSUMED_ATTACKERS = 1_000   # multi_krum's f: a round holds at most a few thousand updates
MAX_AVERAGED = 10_000           # multi_krum's m
MAX_WEISZFELD_ITERATIONS = 1_000
MAX_NORM = 1e9
MAX_ROOT_EPOCHS = 100           # fltrust's root update: a few passes over a probe set of <= MAX_PROBE_SIZE
MAX_ROOT_LR = 10.0
MAX_ROOT_BATCH = 10_000
MAX_BUCKET = 1_000              # bucketing's s: at most a round's updates in one bucket
MAX_CLIP_ITERATIONS = 100       # centered clipping's L: each costs one pass over the updates
MAX_HISTORY = 100               # the history check's window and L-BFGS pairs: each pair keeps one model-sized vector
PREMIXES = ("none", "bucketing", "nnm")


@dataclass(frozen=True, kw_only=True)
class RobustParams:
    """Base of every robust rule's parameters; what the service and submission read of any rule.

    Every rule takes a pre-mix of the updates before it runs (docs/algorithms.md, "Mixing before a rule"):
    `premix: bucketing` averages random buckets of `bucket_size` updates (Karimireddy, He, Jaggi, ICLR 2022);
    `premix: nnm` replaces each update by the mean of its n − f nearest updates, itself included (Allouah et
    al., AISTATS 2023), with f = `nnm_f` (None: ⌊(n − 1)/2⌋, the most an honest majority allows).
    """

    premix: str = "none"
    bucket_size: int = 2
    nnm_f: int | None = None

    def __post_init__(self) -> None:
        check_all(*self.premix_checks())

    def premix_checks(self) -> list[Callable[[], None]]:
        """The checks of the pre-mix parameters (a rule's own __post_init__ adds them to its own)."""
        return [lambda: _check_premix(self.premix),
                lambda: check_int("bucket_size", self.bucket_size, minimum=1, maximum=MAX_BUCKET),
                lambda: None if self.nnm_f is None else check_int("nnm_f", self.nnm_f, minimum=0,
                                                                  maximum=MAX_ASSUMED_ATTACKERS)]

    @property
    def probe_set(self) -> str:
        """The probe set the rule trains on ("" for none), checked against the model at submission."""
        return ""

    @property
    def uses_weights(self) -> bool:
        """Whether the rule keeps the job's weighting (sample counts, DWFed) as each update's starting weight;
        the coordinate-wise rules and FLTrust count every update once, as their papers do."""
        return False


@dataclass(frozen=True, kw_only=True)
class NoRobustParams(RobustParams):
    """`none`: the job's weighted mean, as without this setting."""

    @property
    def uses_weights(self) -> bool:
        """The plain weighted mean."""
        return True


@dataclass(frozen=True, kw_only=True)
class MedianParams(RobustParams):
    """`median`: the coordinate-wise median takes no parameters."""


@dataclass(frozen=True, kw_only=True)
class TrimmedMeanParams(RobustParams):
    """`trimmed_mean`: β, the share of updates dropped at each end of every coordinate (⌈βn⌉ per side)."""

    beta: float = 0.1

    def __post_init__(self) -> None:
        check_all(*self.premix_checks(), lambda: _check_beta(self.beta))


def _check_premix(premix: object) -> None:
    if premix not in PREMIXES:
        raise ValueError(f"premix must be one of {', '.join(PREMIXES)}; got {premix!r}")


def _check_beta(beta: object) -> None:
    ok = isinstance(beta, Real) and not isinstance(beta, bool) and 0.0 <= float(beta) < 0.5
    if not ok:
        raise ValueError(f"beta must be a number >= 0 and < 0.5 (at 0.5 nothing is left to average); got {beta!r}")


@dataclass(frozen=True, kw_only=True)
class MultiKrumParams(RobustParams):
    """`multi_krum`: f, the attackers it assumes (a score sums the squared distances to the n − f − 2 nearest
    updates), and m, how many of the lowest-scoring updates it averages (None: n − f)."""

    f: int = 1
    m: int | None = None

    def __post_init__(self) -> None:
        check_all(*self.premix_checks(), lambda: check_int("f", self.f, minimum=0, maximum=MAX_ASSUMED_ATTACKERS),
                  lambda: None if self.m is None else check_int("m", self.m, minimum=1, maximum=MAX_AVERAGED))

    @property
    def uses_weights(self) -> bool:
        """The chosen updates are averaged with the job's weights (Multi-Krum's plain average when uniform)."""
        return True


@dataclass(frozen=True, kw_only=True)
class GeometricMedianParams(RobustParams):
    """`geometric_median`: the most smoothed Weiszfeld iterations of RFA (each costs O(n²) on the updates' Gram
    matrix, not a pass over the model), the smoothing ν, and the step (relative to the median distance to the
    estimate) below which it stops early."""

    iterations: int = 100
    nu: float = 1e-6
    tolerance: float = 1e-6

    def __post_init__(self) -> None:
        check_all(*self.premix_checks(),
                  lambda: check_int("iterations", self.iterations, minimum=1, maximum=MAX_WEISZFELD_ITERATIONS),
                  lambda: check_real("nu", self.nu, minimum=0.0, strict=True, maximum=1.0),
                  lambda: check_real("tolerance", self.tolerance, minimum=0.0, strict=False, maximum=1.0))

    @property
    def uses_weights(self) -> bool:
        """RFA's weighted geometric median: the job's weights are its α_i."""
        return True


@dataclass(frozen=True, kw_only=True)
class NormBoundParams(RobustParams):
    """`norm_bound`: M, the largest L2 norm an update keeps (Δ_i ← Δ_i · min(1, M/‖Δ_i‖)); no default, since a
    sensible M depends on the model and the learning rate."""

    max_norm: float

    def __post_init__(self) -> None:
        check_all(*self.premix_checks(), lambda: check_real("max_norm", self.max_norm, minimum=0.0, strict=True, maximum=MAX_NORM))

    @property
    def uses_weights(self) -> bool:
        """The bounded updates go into the job's weighted mean."""
        return True


@dataclass(frozen=True, kw_only=True)
class FLTrustParams(RobustParams):
    """`fltrust`: the root (probe) set the service trains its own update g_0 on, from the global model, and
    how: `epochs` passes of plain SGD at `lr` in batches of `batch_size` (set them to the workers' training)."""

    probe_dataset: str
    probe_size: int = 100
    probe_seed: int = 0
    epochs: int = 1
    lr: float = 0.01
    batch_size: int = 32

    def __post_init__(self) -> None:
        check_all(
            *self.premix_checks(),
            self._check_probe_dataset,
            lambda: check_int("probe_size", self.probe_size, minimum=1, maximum=MAX_PROBE_SIZE),
            lambda: check_int("probe_seed", self.probe_seed, minimum=0, maximum=MAX_PROBE_SEED),
            lambda: check_int("epochs", self.epochs, minimum=1, maximum=MAX_ROOT_EPOCHS),
            lambda: check_real("lr", self.lr, minimum=0.0, strict=True, maximum=MAX_ROOT_LR),
            lambda: check_int("batch_size", self.batch_size, minimum=1, maximum=MAX_ROOT_BATCH),
        )

    def _check_probe_dataset(self) -> None:
        if self.probe_dataset not in EVALUATION_SETS:
            raise ConfigError("aggregation.robust_params.probe_dataset",
                              f"fltrust trains its root update on a probe set the aggregation service holds (public "
                              f"or synthetic data, never a worker's): one of {', '.join(EVALUATION_SETS)}; got "
                              f"{self.probe_dataset!r}")

    @property
    def probe_set(self) -> str:
        """The root data set."""
        return self.probe_dataset


@dataclass(frozen=True, kw_only=True)
class CenteredClippingParams(RobustParams):
    """`centered_clipping`: v ← v + Σ w_i (Δ_i − v)·min(1, τ/‖Δ_i − v‖), `iterations` times, from the last round's
    aggregate (momentum). τ is `tau` when given, else `tau_scale` × the median of ‖Δ_i − v‖ this round: a scale
    fewer than half the updates cannot move past the honest updates' own distances."""

    tau: float | None = None
    tau_scale: float = 1.0
    iterations: int = 1

    def __post_init__(self) -> None:
        check_all(*self.premix_checks(),
                  lambda: None if self.tau is None else check_real("tau", self.tau, minimum=0.0, strict=True,
                                                                   maximum=MAX_NORM),
                  lambda: check_real("tau_scale", self.tau_scale, minimum=0.0, strict=True, maximum=1e3),
                  lambda: check_int("iterations", self.iterations, minimum=1, maximum=MAX_CLIP_ITERATIONS))

    @property
    def uses_weights(self) -> bool:
        """Each clipped difference counts with the job's weight (1/n under uniform weighting, as in the paper)."""
        return True


@dataclass(frozen=True, kw_only=True)
class HistoryCheckParams(RobustParams):
    """`history_check`: FLDetector's consistency check. Each site's update is predicted from its last one with an
    L-BFGS Hessian approximation over the last `pairs` rounds; its score is the mean, over its last `window`
    rounds, of its distance to the prediction (over the round's mean distance). Once `warmup` rounds have
    passed, the upper of two clusters of scores is flagged when it holds fewer than half the sites and its mean
    is at least `ratio` × the lower's; a flagged site stays excluded. The rest go to `inner` with
    `inner_params` (any other rule, a pre-mix included)."""

    window: int = 10
    pairs: int = 5
    warmup: int = 3
    ratio: float = 2.0
    inner: str = "none"
    inner_params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_all(lambda: None if self.premix == "none" else _raise(
                      "premix must be none for history_check: mixing hides which site sent what (set it in "
                      "inner_params)"),
                  lambda: check_int("window", self.window, minimum=1, maximum=MAX_HISTORY),
                  lambda: check_int("pairs", self.pairs, minimum=1, maximum=MAX_HISTORY),
                  lambda: check_int("warmup", self.warmup, minimum=1, maximum=MAX_HISTORY),
                  lambda: check_real("ratio", self.ratio, minimum=1.0, strict=True, maximum=1e3),
                  self._check_inner)

    def _check_inner(self) -> None:
        """The inner rule and its parameters, checked as the catalogue checks a job's rule."""
        if self.inner == "history_check" or self.inner not in INNER_RULES:
            raise ValueError(f"inner must be another robust rule, one of {', '.join(sorted(INNER_RULES))}; "
                             f"got {self.inner!r}")
        if not isinstance(self.inner_params, Mapping):
            raise ValueError(f"inner must come with inner_params, a mapping; got {self.inner_params!r}")
        try:
            INNER_RULES[self.inner](**self.inner_params)
        except (TypeError, ValueError) as exc:   # an unknown or missing parameter, or a bad value
            raise ValueError(f"inner {self.inner!r}'s inner_params: {exc}") from None

    @property
    def uses_weights(self) -> bool:
        """The inner rule's."""
        return True

    @property
    def probe_set(self) -> str:
        """The inner rule's probe set (fltrust's root set)."""
        return str(self.inner_params.get("probe_dataset", "")) if self.inner == "fltrust" else ""


def _raise(message: str) -> None:
    raise ValueError(message)


# The rules a history check may run on the sites it did not flag (the catalogue holds the same names: a contract
# test holds the two equal).
INNER_RULES: dict[str, type[RobustParams]] = {
    "none": NoRobustParams, "median": MedianParams, "trimmed_mean": TrimmedMeanParams,
    "multi_krum": MultiKrumParams, "geometric_median": GeometricMedianParams, "norm_bound": NormBoundParams,
    "fltrust": FLTrustParams, "centered_clipping": CenteredClippingParams,
}
