"""The ring, the quantiser and the graph size of one secure round, checked once when built.

A worker's weighted update w_i·x_i is clipped to [−B, B] per coordinate and mapped to an integer level
in [0, L] by stochastic rounding (unbiased: E[level]·Δ = v + B, step Δ = 2B/L). The sum of n levels is
at most n·L, and `SecAggParams` refuses any L with n_max·L ≥ R = 2^bits, so the masked sum, taken mod R,
is the true integer sum: it can never wrap. Dequantising a sum of n levels S gives S·Δ − n·B.

Error of the dequantised sum of n values, per coordinate (clipping aside): each term's rounding error is
in (−Δ, Δ), has mean 0 and variance at most Δ²/4, so the sum's error is below n·Δ in the worst case and
its standard deviation at most √n·Δ/2 (`sum_error_bound`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedbroker.errors import ConfigError

MAX_LEVELS = 2**40  # float64 keeps 12 fractional bits of every scaled value: the rounding stays unbiased
RING_BITS = (32, 64)  # the ring sizes `choose` picks from (any 8..64 is accepted when given)


def ring_dtype(bits: int) -> type[np.unsignedinteger[Any]]:
    """The numpy dtype that holds ring elements of `bits` bits (arithmetic wraps mod 2^32 or 2^64)."""
    return np.uint32 if bits <= 32 else np.uint64


def mask_ring(values: NDArray[np.unsignedinteger[Any]], bits: int) -> NDArray[np.unsignedinteger[Any]]:
    """Reduce in place mod 2^bits where the dtype is wider than the ring (no-op for 32 and 64 bits)."""
    if bits not in (32, 64):
        values &= values.dtype.type((1 << bits) - 1)
    return values


@dataclass(frozen=True)
class SecAggParams:
    """One secure round's settings: who may take part, how many shares unmask, and the ring.

    n_max: most inputs the round may sum (the no-wrap guarantee is for this many).
    threshold: t, shares needed to rebuild a secret; any t−1 shares reveal nothing about it.
    neighbours: k, peers each worker masks with and shares its secrets to (k ≥ n − 1: everyone).
    bits: the ring Z_R, R = 2^bits. clip: B, each weighted coordinate is clipped to [−B, B].
    """

    n_max: int
    threshold: int
    neighbours: int
    bits: int
    clip: float

    def __post_init__(self) -> None:
        """Refuse settings under which the sum could wrap or no secret could be rebuilt."""
        if self.n_max < 2:
            raise ConfigError("secagg.n_max", f"must be at least 2, got {self.n_max}")
        if not 8 <= self.bits <= 64:
            raise ConfigError("secagg.bits", f"must be in 8..64, got {self.bits}")
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError("secagg.clip", f"must be a positive finite number, got {self.clip}")
        if self.neighbours < 1:
            raise ConfigError("secagg.neighbours", f"must be at least 1, got {self.neighbours}")
        holders = min(self.neighbours, self.n_max - 1) + 1  # a worker's neighbours and itself
        if not 2 <= self.threshold <= holders:
            raise ConfigError("secagg.threshold",
                              f"must be in 2..{holders} (neighbours {self.neighbours} + the worker itself), "
                              f"got {self.threshold}")
        if self.levels < 2:
            raise ConfigError("secagg.bits", f"2^{self.bits} leaves fewer than 2 quantisation levels for "
                              f"n_max={self.n_max} inputs; use more bits")

    @property
    def levels(self) -> int:
        """L, the top quantisation level: as many as fit n_max·L < 2^bits, at most 2^40."""
        return min(((1 << self.bits) - 1) // self.n_max, MAX_LEVELS)

    @property
    def step(self) -> float:
        """Δ = 2B/L, the value of one quantisation level."""
        return 2.0 * self.clip / self.levels

    @property
    def dtype(self) -> type[np.unsignedinteger[Any]]:
        """The numpy dtype of this ring's elements (masked inputs and sums travel in it)."""
        return ring_dtype(self.bits)

    def complete_graph(self, n: int) -> bool:
        """Whether n workers all mask with each other (k ≥ n − 1) instead of a sparse graph."""
        return self.neighbours >= n - 1

    @classmethod
    def choose(cls, n: int, clip: float, *, precision_bits: int = 24, neighbours: int | None = None,
               threshold: int | None = None, bits: int | None = None) -> SecAggParams:
        """Settings for a round of up to n workers whose weighted coordinates lie in [−clip, clip].

        bits: the smallest of 32, 64 that gives each value at least `precision_bits` bits of levels
        after reserving log2(n) bits so the sum of n cannot wrap. neighbours: everyone for n ≤ 20, else
        the even number nearest 3·log2(n) (SecAgg+: k = O(log n)). threshold: a strict majority of the
        k + 1 holders of each secret, so the round survives up to just under half of a neighbourhood
        dropping.
        """
        if n < 2:
            raise ConfigError("secagg.n", f"a secure round needs at least 2 workers, got {n}")
        if bits is None:
            need = precision_bits + math.ceil(math.log2(n + 1))
            fitting = [b for b in RING_BITS if b >= need]
            if not fitting:
                raise ConfigError("secagg.precision_bits",
                                  f"{precision_bits} bits per value for {n} workers needs a {need}-bit ring; "
                                  f"the largest is 64")
            bits = fitting[0]
        if neighbours is None:
            neighbours = n - 1 if n <= 20 else min(n - 1, 2 * round(1.5 * math.log2(n)))
        k = min(neighbours, n - 1)
        if threshold is None:
            threshold = (k + 1) // 2 + 1
        return cls(n_max=n, threshold=threshold, neighbours=neighbours, bits=bits, clip=clip)

    def describe(self) -> dict[str, Any]:
        """The settings and what they imply, for the job's view and logs (plain JSON values)."""
        worst, std = sum_error_bound(self, self.n_max)
        return {
            "n_max": self.n_max, "threshold": self.threshold, "neighbours": self.neighbours,
            "bits": self.bits, "clip": self.clip, "levels": self.levels, "step": self.step,
            "sum_error_max": worst, "sum_error_std": std,
        }


def sum_error_bound(params: SecAggParams, n: int) -> tuple[float, float]:
    """(worst-case, standard-deviation bound) of the quantisation error of a dequantised sum of n inputs.

    Per coordinate, for values inside [−B, B]: |error| < n·Δ always, and std ≤ √n·Δ/2 (stochastic
    rounding is unbiased with variance at most Δ²/4 per term, independent across terms).
    """
    return n * params.step, math.sqrt(n) * params.step / 2.0


def quantise(x: NDArray[np.floating[Any]], params: SecAggParams,
             rng: np.random.Generator) -> NDArray[np.unsignedinteger[Any]]:
    """Clip to [−B, B] and round stochastically to a level in [0, L]: a ring element per coordinate.

    Unbiased: the expected level times Δ is the clipped value plus B. Raises on a non-finite value (a
    NaN would become an arbitrary level and corrupt the whole sum unseen).
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1:
        raise ConfigError("secagg.input", f"must be a flat vector, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ConfigError("secagg.input", "holds NaN or infinity")
    scale = params.levels / (2.0 * params.clip)
    scaled = np.multiply(x, scale)
    scaled += params.clip * scale + rng.random(x.shape[0])  # floor(v + U) rounds v up with prob. frac(v)
    np.floor(scaled, out=scaled)
    np.clip(scaled, 0.0, float(params.levels), out=scaled)  # clipping to ±B, in level units
    levels: NDArray[np.unsignedinteger[Any]] = scaled.astype(params.dtype)
    return levels


def clipped_count(x: NDArray[np.floating[Any]], params: SecAggParams) -> int:
    """How many coordinates `quantise` would clip: a worker can report it (it changes the sum)."""
    return int(np.count_nonzero(np.abs(np.asarray(x, dtype=np.float64)) > params.clip))


def dequantise_sum(ring_sum: NDArray[np.unsignedinteger[Any]], n_summed: int,
                   params: SecAggParams) -> NDArray[np.float64]:
    """The float sum of n_summed quantised inputs from their integer sum: S·Δ − n·B."""
    if not 0 < n_summed <= params.n_max:
        raise ConfigError("secagg.n_summed", f"must be in 1..{params.n_max}, got {n_summed}")
    total = np.asarray(ring_sum).astype(np.float64)
    total *= params.step
    total -= n_summed * params.clip
    return total
