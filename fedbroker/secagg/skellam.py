"""Distributed DP's arithmetic: integer Skellam noise inside the secure sum, and what it costs in ε.

Each round is one federated DP-SGD step. A site scales its records' clipped gradients by γ, rounds them
stochastically to integers, sums them and adds Skellam noise Sk(μ_i/2, μ_i/2) (variance μ_i per coordinate,
in levels) before masking. Skellam is closed under summation, so the secure sum of any set of survivors
carries exactly Skellam noise of variance Σ μ_i: the accounting below is of that one mechanism.

ε of the sum: the Skellam RDP bound (Agarwal, Kairouz, Liu, NeurIPS 2021) at the rounding-inflated
sensitivities (`sensitivities`), amplified by Poisson sampling of records (Zhu & Wang, ICML 2019, general
upper bound), composed over rounds by adding RDP, and converted to (ε, δ) by the same rule as Opacus's
accountant (Balle et al., AISTATS 2020), so the figures compare with fedbroker.privacy's. docs/privacy.md,
"Distributed DP: the mechanism and its accounting", states every bound and where it is conservative.

numpy/scipy only: the workers, the service and the experiments all import it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy.special import gammaln

from fedbroker.errors import ConfigError

# Integer orders only: the subsampling bound below holds at integer α ≥ 2. Large orders serve small ε·steps.
ORDERS: NDArray[np.int64] = np.array([*range(2, 257), 320, 384, 512], dtype=np.int64)
ORDERS.setflags(write=False)

# Largest variance a share may have: each Poisson mean is ≤ 2^49, so a draw (mean + many std) stays far below
# 2^53, where float64 (numpy's Poisson sampler) still counts exactly, and far below int64's range.
MAX_VARIANCE = float(2**50)
MAX_BITS = 64
MIN_BITS = 8
_TINY = 5e-324  # the smallest positive float64


def skellam_rdp(orders: ArrayLike, *, mu: float, l1: float, l2: float) -> NDArray[np.float64]:
    """ε(α) of adding Skellam noise of variance `mu` per coordinate to integer vectors of L1/L2 sensitivity l1, l2.

    Agarwal, Kairouz, Liu (NeurIPS 2021), Theorem 3.5 (multi-dimensional Skellam mechanism), written with μ the
    variance of the noise Sk(μ/2, μ/2) per coordinate, for integer α > 1:

        ε(α) ≤ α·l2²/(2μ) + min( ((2α − 1)·l2² + 6·l1) / (4μ²),  3·l1/(2μ) ).

    The first term is the Gaussian mechanism's at the same variance; the second is what discreteness costs,
    O(1/μ²) for large μ. μ = 0 gives ∞ (no noise, no privacy).
    """
    a = np.asarray(orders, dtype=np.float64)
    if not (math.isfinite(mu) and mu >= 0):
        raise ConfigError("mu", f"must be a finite number >= 0, got {mu!r}")
    if not (l1 >= 0 and l2 >= 0):
        raise ConfigError("l1", f"sensitivities must be >= 0, got l1={l1!r}, l2={l2!r}")
    if mu == 0:
        return np.full(a.shape, math.inf)
    gauss = a * l2 * l2 / (2.0 * mu)
    extra = np.minimum(((2.0 * a - 1.0) * l2 * l2 + 6.0 * l1) / (4.0 * mu * mu), 3.0 * l1 / (2.0 * mu))
    out: NDArray[np.float64] = gauss + extra
    return out


def poisson_subsampled_rdp(rdp: Callable[[int], float], *, q: float,
                           orders: Sequence[int] | NDArray[np.int64] = ORDERS) -> NDArray[np.float64]:
    """RDP at integer `orders` of a mechanism with RDP curve `rdp` run on a Poisson sample (rate q) of the records.

    Zhu & Wang (ICML 2019), general upper bound for any mechanism, at integer α ≥ 2:

        ε'(α) ≤ 1/(α−1) · log[ (1−q)^(α−1)·(αq − q + 1) + C(α,2)·q²·(1−q)^(α−2)·e^(ε(2))
                               + 3·Σ_{l=3..α} C(α,l)·q^l·(1−q)^(α−l)·e^((l−1)·ε(l)) ].

    Each term is summed in log space (logsumexp), so large orders neither overflow nor lose the small terms.
    Subsampling never costs privacy, so the result is the smaller of the bound and ε(α); at q = 1 it is ε(α)
    exactly (the bound's factor 3 would otherwise add log 3/(α−1)).
    """
    ords = np.asarray(orders, dtype=np.int64)
    if ords.ndim != 1 or ords.size == 0 or int(ords.min()) < 2:
        raise ConfigError("orders", "must be a non-empty list of integers >= 2")
    if not (isinstance(q, (int, float)) and not isinstance(q, bool) and 0.0 < q <= 1.0):
        raise ConfigError("sample_rate", f"must lie in (0, 1], got {q!r}")
    top = int(ords.max())
    curve = np.zeros(top + 1)  # curve[l] = ε(l) for l ≥ 2
    curve[2:] = [float(rdp(order)) for order in range(2, top + 1)]
    plain = curve[ords]
    if q == 1.0:
        return plain.copy()
    head, weights = _subsampling_weights(tuple(ords.tolist()), float(q))
    ls = np.arange(top + 1, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # −∞ + ∞ where l > α and ε(l) = ∞: masked out just below
        terms = np.where(np.isfinite(weights), weights + (ls - 1.0) * curve, -np.inf)
    total = _logsumexp_rows(np.concatenate((head[:, None], terms), axis=1))
    out: NDArray[np.float64] = np.minimum(total / (ords - 1.0), plain)
    return out


def _logsumexp_rows(x: NDArray[np.float64]) -> NDArray[np.float64]:
    """log Σ_j exp(x[i, j]) per row, shifted by the row's maximum (scipy's logsumexp costs 20× more here)."""
    top = x.max(axis=1)
    shift = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        out: NDArray[np.float64] = np.log(np.exp(x - shift[:, None]).sum(axis=1)) + shift
    return np.where(np.isposinf(top), np.inf, out)


@functools.lru_cache(maxsize=32)
def _subsampling_weights(orders: tuple[int, ...], q: float) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The parts of Zhu & Wang's bound that depend only on (α, q), computed once per rate (read-only).

    head[i]: log of the l = 0 and l = 1 terms together, (α−1)·log(1−q) + log(1 + (α−1)q). weights[i, l]:
    log C(α, l) + l·log q + (α−l)·log(1−q) (+ log 3 for l ≥ 3), −∞ where l < 2 or l > α.
    """
    a = np.asarray(orders, dtype=np.float64)[:, None]
    ls = np.arange(int(a.max()) + 1, dtype=np.float64)[None, :]
    valid = (ls >= 2) & (ls <= a)
    with np.errstate(invalid="ignore"):
        log_binom = gammaln(a + 1) - gammaln(ls + 1) - gammaln(np.maximum(a - ls, 0) + 1)
    weights = log_binom + ls * math.log(q) + (a - ls) * math.log1p(-q) + np.where(ls >= 3, math.log(3.0), 0.0)
    weights = np.where(valid, weights, -np.inf)
    head = (a[:, 0] - 1.0) * math.log1p(-q) + np.log1p((a[:, 0] - 1.0) * q)
    weights.setflags(write=False)
    head.setflags(write=False)
    return head, weights


def rdp_to_epsilon(orders: ArrayLike, rdp: ArrayLike, *, delta: float) -> tuple[float, float]:
    """(ε, best order) of an RDP curve at `delta`, by the conversion Opacus's accountant uses.

    Balle et al. (AISTATS 2020), Theorem 21: ε = min_α [ rdp(α) + log((α−1)/α) − (log δ + log α)/(α − 1) ],
    the formula of opacus.accountants.analysis.rdp.get_privacy_spent (fedbroker.privacy's ε), so the two
    accountants' figures differ only by their RDP curves and their orders.
    """
    a = np.asarray(orders, dtype=np.float64)
    r = np.asarray(rdp, dtype=np.float64)
    if a.shape != r.shape or a.ndim != 1 or a.size == 0:
        raise ConfigError("orders", f"orders and rdp must be equal-length vectors, got {a.shape} and {r.shape}")
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ConfigError("delta", f"must lie strictly between 0 and 1, got {delta!r}")
    eps = r - (math.log(delta) + np.log(a)) / (a - 1.0) + np.log((a - 1.0) / a)
    if not np.isfinite(eps).any():
        return math.inf, float("nan")
    best = int(np.nanargmin(np.where(np.isfinite(eps), eps, np.inf)))
    return float(eps[best]), float(a[best])


def sensitivities(*, clip: float, scale: float, dim: int) -> tuple[float, float]:
    """(l1, l2) of one record's contribution to a site's integer sum, in levels.

    A clipped gradient g has ‖g‖₂ ≤ C, so ‖γg‖₂ ≤ γC. Stochastic rounding moves each coordinate by less than 1,
    so the rounded vector r has ‖r‖₂ < γC + ‖(1, …, 1)‖₂ = γC + √d =: l2 (triangle inequality). r is an integer
    vector, so |r_j| ≤ r_j² and ‖r‖₁ ≤ ‖r‖₂² ≤ l2²; and ‖r‖₁ ≤ √d·‖r‖₂ (Cauchy–Schwarz): l1 = min(√d·l2, l2²).
    (With the +√d inflation l2 > √d, so the √d·l2 arm is the smaller one; the Skellam bound's discreteness term,
    where l1 enters, is a factor of order 1/μ below its Gaussian term anyway.)
    A site that rounds per record and sums integers changes its sum by exactly r when a record joins. One that
    rounds its float sum with uniforms U (⌊x + U⌋) changes it, for each fixed U, by an integer vector with
    |Δ_j| < |γg_j| + 1, the same bounds; Rényi divergence is jointly quasi-convex, so the mixture over U is
    no worse than the worst U.
    """
    _positive("privacy.distributed.clip", clip)
    _positive("scale", scale)
    _integer("dim", dim, low=1)
    l2 = scale * clip + math.sqrt(dim)
    return min(math.sqrt(dim) * l2, l2 * l2), l2


@dataclass(frozen=True)
class DDPRound:
    """One distributed-DP round's settings, chosen once by `choose` and stated in the round's record.

    scale: γ, integer levels per unit of gradient. share_variance: μ/quorum, a `distributed`-mode site's share
    (before any local floor). full_variance: μ = (γzC)², the dose the quorum's sum carries (and a `local`-mode
    site adds alone). bits: the ring Z_(2^bits). wrap_probability: a proven upper bound on the chance that any
    coordinate of the round's sum leaves the ring's signed range (`wrap_bound`), for up to `n_max` sites each
    adding at most `max_share_variance`, holding `max_records` records in all.
    """

    scale: float
    share_variance: float
    full_variance: float
    bits: int
    wrap_probability: float
    quorum: int
    dim: int
    clip: float
    noise_multiplier: float
    sample_rate: float
    n_max: int = 0
    max_records: int = 0
    max_share_variance: float = 0.0

    @property
    def sensitivities(self) -> tuple[float, float]:
        """(l1, l2) of one record, in levels (`sensitivities`)."""
        return sensitivities(clip=self.clip, scale=self.scale, dim=self.dim)

    @property
    def rounding_share(self) -> float:
        """√d/(γC): how much the rounding inflates the L2 sensitivity, relative to the clip."""
        return math.sqrt(self.dim) / (self.scale * self.clip)

    def describe(self) -> str:
        """One line for the round's record: what the sum carries and how safely it fits the ring."""
        return (f"skellam γ={self.scale:.6g} μ={self.full_variance:.6g} (share {self.share_variance:.6g} × quorum "
                f"{self.quorum}) z={self.noise_multiplier:g} C={self.clip:g} q={self.sample_rate:g} d={self.dim} "
                f"ring {self.bits} bits, P(wrap) ≤ {self.wrap_probability:.3g} for ≤ {self.n_max} sites, "
                f"{self.max_records} records")

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain JSON values."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DDPRound:
        """A round from `to_dict`'s values (as a round's record or a task carries them), field types checked."""
        names = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ConfigError("ddp_round", f"unknown fields {unknown}")
        out: dict[str, Any] = {}
        for name, kind in names.items():
            if name not in data:
                continue
            value = data[name]
            integral = kind in ("int", int)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (integral and value != int(value)):
                raise ConfigError(f"ddp_round.{name}", f"must be {'an integer' if integral else 'a number'}, "
                                                       f"got {value!r}")
            out[name] = int(value) if integral else float(value)
        return cls(**out)


def wrap_bound(*, bits: int, dim: int, signal: float, total_variance: float) -> float:
    """Upper bound on P(some coordinate of signal + Skellam noise leaves [−2^(bits−1), 2^(bits−1))).

    |signal| ≤ `signal` per coordinate, so a wrap needs |N| ≥ x := 2^(bits−1) − 1 − signal for the noise N of
    that coordinate. N = P₁ − P₂ with P₁, P₂ ~ Poisson(V/2): log E e^(tN) = V(cosh t − 1) ≤ V(e^t − 1 − t)
    ≤ V t²/(2(1 − t/3)) (0 ≤ t < 3), which is Bernstein's condition for variance V and jumps of 1, so
    P(|N| ≥ x) ≤ 2·exp(−x² / (2(V + x/3))). A union over the `dim` coordinates gives the bound (capped at 1).
    """
    x = 2.0 ** (bits - 1) - 1.0 - signal
    if x <= 0:
        return 1.0
    if total_variance <= 0:
        return 0.0
    log_p = math.log(2.0 * dim) - x * x / (2.0 * (total_variance + x / 3.0))
    return 1.0 if log_p >= 0 else max(math.exp(log_p), _TINY)  # never 0 by underflow: still an upper bound


def choose(*, clip: float, noise_multiplier: float, quorum: int, n_max: int, dim: int, sample_rate: float,
           max_records: int, bits: int | None = None, wrap_target: float = 1e-9, rounding_share: float = 0.01,
           max_share_variance: float | None = None) -> DDPRound:
    """A round's γ, variances and ring width, or ConfigError naming the field that cannot fit 64 bits.

    γ = √d/(rounding_share·C), so the rounding's +√d is at most `rounding_share` of γC in the sensitivity;
    lowered if need be so that μ = (γzC)² stays ≤ MAX_VARIANCE (Poisson draws exact in float64/int64).
    bits: the smallest width in 8..64 (or the given one, checked) whose half-range holds the worst-case signal,
    max_records·(γC + 1) per coordinate (each record's coordinate is at most γC, plus < 1 from rounding), plus
    Skellam noise of n_max·max_share_variance (default: every site adds the full dose, as `local` mode does)
    with `wrap_bound` ≤ wrap_target.
    """
    _positive("privacy.distributed.clip", clip)
    _positive("privacy.distributed.noise_multiplier", noise_multiplier)
    _integer("privacy.distributed.quorum", quorum, low=1)
    _integer("n_max", n_max, low=quorum)
    _integer("dim", dim, low=1)
    _rate("privacy.distributed.sample_rate", sample_rate)
    _integer("max_records", max_records, low=1)
    if not (isinstance(wrap_target, float) and 0.0 < wrap_target < 1.0):
        raise ConfigError("wrap_target", f"must lie strictly between 0 and 1, got {wrap_target!r}")
    if not (isinstance(rounding_share, (int, float)) and 0.0 < rounding_share <= 1.0):
        raise ConfigError("rounding_share", f"must lie in (0, 1], got {rounding_share!r}")
    scale = min(math.sqrt(dim) / (rounding_share * clip), math.sqrt(MAX_VARIANCE) / (noise_multiplier * clip))
    full = (scale * noise_multiplier * clip) ** 2
    share_cap = full if max_share_variance is None else float(max_share_variance)
    if not (math.isfinite(share_cap) and 0 <= share_cap <= MAX_VARIANCE):
        raise ConfigError("max_share_variance", f"must be a number in [0, {MAX_VARIANCE:g}], got {share_cap!r}")
    signal = max_records * (scale * clip + 1.0)
    total = n_max * share_cap
    widths = range(MIN_BITS, MAX_BITS + 1) if bits is None else [bits]
    if bits is not None and not (isinstance(bits, int) and MIN_BITS <= bits <= MAX_BITS):
        raise ConfigError("bits", f"must be an integer in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
    for width in widths:
        p = wrap_bound(bits=width, dim=dim, signal=signal, total_variance=total)
        if p <= wrap_target:
            return DDPRound(scale=scale, share_variance=full / quorum, full_variance=full, bits=width,
                            wrap_probability=p, quorum=quorum, dim=dim, clip=clip,
                            noise_multiplier=noise_multiplier, sample_rate=sample_rate, n_max=n_max,
                            max_records=max_records, max_share_variance=share_cap)
    top = widths[-1]
    if signal >= 2.0 ** (top - 1) - 1:
        raise ConfigError("max_records" if bits is None else "bits",
                          f"the worst-case sum of {max_records} records ({signal:.3g} levels) does not fit a "
                          f"{top}-bit ring")
    raise ConfigError("privacy.distributed.noise_multiplier" if bits is None else "bits",
                      f"noise of variance {total:.3g} from {n_max} sites wraps a {top}-bit ring with probability "
                      f"above {wrap_target:g}")


def round_rdp(*, round: DDPRound, variance: float) -> NDArray[np.float64]:
    """RDP at ORDERS of one round whose sum carries Skellam noise of `variance`, records sampled at q."""
    l1, l2 = round.sensitivities
    curve = skellam_rdp(np.arange(int(ORDERS.max()) + 1), mu=variance, l1=l1, l2=l2)  # one vectorised pass
    return poisson_subsampled_rdp(lambda a: float(curve[a]), q=round.sample_rate, orders=ORDERS)


def epsilon_after(*, round: DDPRound, variance: float, steps: int, delta: float) -> float:
    """ε after `steps` rounds like `round` whose sums each carry Skellam noise of `variance` (RDP adds up)."""
    _integer("steps", steps, low=0)
    if steps == 0:
        return 0.0
    return rdp_to_epsilon(ORDERS, round_rdp(round=round, variance=variance) * steps, delta=delta)[0]


def distributed_epsilon(*, round: DDPRound, total_variance: float, rounds: int, delta: float) -> float:
    """ε of a site's records against the server that sees only the sum, which carries `total_variance`."""
    return epsilon_after(round=round, variance=total_variance, steps=rounds, delta=delta)


def local_floor_epsilon(*, round: DDPRound, share_variance: float, rounds: int, delta: float) -> float:
    """ε of a site's records if every other site colluded with the server: only its own share protects them."""
    return epsilon_after(round=round, variance=share_variance, steps=rounds, delta=delta)


def share_variance_for(*, mode: str, round: DDPRound, local_floor_epsilon: float, rounds: int,
                       delta: float) -> float:
    """μ_i, the variance a site adds: the full dose (`local`) or μ/quorum (`distributed`), raised if need be.

    With a floor > 0, μ_i is raised until the site's own share alone gives ε ≤ floor over `rounds` rounds:
    bisection in log μ over a fixed bracket with a fixed number of steps, keeping the upper end, so the result
    meets the floor and is monotone in it (a stricter floor never gets less noise).
    """
    if not isinstance(mode, str) or mode not in ("local", "distributed"):
        raise ConfigError("dp.mode", f"must be 'local' or 'distributed', got {mode!r}")
    floor = local_floor_epsilon
    if isinstance(floor, bool) or not (isinstance(floor, (int, float)) and math.isfinite(floor) and floor >= 0):
        raise ConfigError("dp.local_floor_epsilon", f"must be a number >= 0 (0: no floor), got {floor!r}")
    _integer("rounds", rounds, low=0)
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ConfigError("delta", f"must lie strictly between 0 and 1, got {delta!r}")
    return _share_variance(mode, round, float(floor), int(rounds), float(delta))


@functools.lru_cache(maxsize=256)
def _share_variance(mode: str, round: DDPRound, floor: float, rounds: int, delta: float) -> float:
    """`share_variance_for`, once per setting (a worker asks each round; the answer costs ~30 accountings)."""
    base = round.full_variance if mode == "local" else round.full_variance / round.quorum
    if floor == 0 or _floor_eps(round, base, rounds, delta) <= floor:
        return base
    if _floor_eps(round, MAX_VARIANCE, rounds, delta) > floor:
        raise ConfigError("dp.local_floor_epsilon", f"ε ≤ {floor:g} over {rounds} rounds needs more noise than a "
                                                    f"share may carry ({MAX_VARIANCE:g} levels²)")
    lo, hi = math.log(base), math.log(MAX_VARIANCE)
    for _ in range(32):
        mid = 0.5 * (lo + hi)
        if _floor_eps(round, math.exp(mid), rounds, delta) <= floor:
            hi = mid
        else:
            lo = mid
    return min(math.exp(hi), MAX_VARIANCE)


def _floor_eps(round: DDPRound, variance: float, rounds: int, delta: float) -> float:
    return epsilon_after(round=round, variance=variance, steps=rounds, delta=delta)


# --- sampling and the ring ------------------------------------------------------------------------------------


def quantise(values: ArrayLike, *, scale: float, rng: np.random.Generator) -> NDArray[np.int64]:
    """γ·v rounded stochastically to an integer per coordinate: ⌊γv + U⌋, U uniform, so E = γv (unbiased)."""
    _positive("scale", scale)
    v = np.asarray(values, dtype=np.float64)
    if not np.isfinite(v).all():
        raise ConfigError("values", "hold NaN or infinity")
    scaled = v * scale
    if scaled.size and float(np.abs(scaled).max()) >= 2.0**52:
        raise ConfigError("scale", f"γ·|v| reaches {float(np.abs(scaled).max()):.3g}: beyond float64's exact "
                                   f"integers, rounding would be biased")
    scaled += rng.random(v.shape)
    out: NDArray[np.int64] = np.floor(scaled).astype(np.int64)
    return out


def noise_share(rng: np.random.Generator, *, size: int | tuple[int, ...], variance: float) -> NDArray[np.int64]:
    """One site's Skellam share: Poisson(variance/2) − Poisson(variance/2) per coordinate (variance `variance`)."""
    if not (isinstance(variance, (int, float)) and 0 <= variance <= MAX_VARIANCE):
        raise ConfigError("variance", f"must be a number in [0, {MAX_VARIANCE:g}], got {variance!r}")
    if variance == 0:
        return np.zeros(size, dtype=np.int64)
    lam = variance / 2.0
    out: NDArray[np.int64] = rng.poisson(lam, size).astype(np.int64) - rng.poisson(lam, size).astype(np.int64)
    return out


def to_ring(ints: ArrayLike, *, bits: int) -> NDArray[np.unsignedinteger[Any]]:
    """Signed integers as elements of Z_(2^bits) (two's complement mod 2^bits), uint32 up to 32 bits, else uint64."""
    _bits(bits)
    x = np.asarray(ints, dtype=np.int64).astype(np.uint64)  # modular: −1 → 2^64 − 1
    if bits < 64:
        x &= np.uint64((1 << bits) - 1)
    if bits <= 32:
        return x.astype(np.uint32)
    return x


def from_ring(ring_sum: ArrayLike, *, bits: int) -> NDArray[np.int64]:
    """A ring element read as a signed integer in [−2^(bits−1), 2^(bits−1)): the sum, if it did not wrap."""
    _bits(bits)
    x = np.asarray(ring_sum).astype(np.uint64)
    if bits == 64:
        return x.view(np.int64).copy()
    x &= np.uint64((1 << bits) - 1)
    out = x.astype(np.int64)
    out[out >= (1 << (bits - 1))] -= 1 << bits
    return out


def dequantise(ints: ArrayLike, *, scale: float) -> NDArray[np.float64]:
    """Integer levels back to values: n/γ."""
    _positive("scale", scale)
    out: NDArray[np.float64] = np.asarray(ints, dtype=np.int64).astype(np.float64) / scale
    return out


# --- checks ------------------------------------------------------------------------------------------------------


def _positive(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(field, f"must be a finite number > 0, got {value!r}")


def _rate(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ConfigError(field, f"must lie in (0, 1], got {value!r}")


def _integer(field: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(field, f"must be an integer >= {low}, got {value!r}")


def _bits(bits: object) -> None:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not MIN_BITS <= bits <= MAX_BITS:
        raise ConfigError("bits", f"must be an integer in {MIN_BITS}..{MAX_BITS}, got {bits!r}")
