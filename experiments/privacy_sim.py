"""One federated DP-SGD run for the privacy experiment: a numpy MLP, exact per-record clipping, three noise modes.

Why numpy and not Opacus: every mode here takes ONE DP-SGD step per round over the union of the sites' Poisson
samples, and the only thing that differs between modes is the noise on the sum. For a one-hidden-layer MLP the
per-record gradient norm has a closed form (‖x‖²‖δ₁‖² + ‖δ₁‖² + ‖h‖²‖δ₂‖² + ‖δ₂‖²), so clipping needs no
per-record gradient tensors and a run costs milliseconds a round on one core.

The distributed and local modes do what the secure round does with a site's sum: scale by γ, round
stochastically to integers, add the site's Skellam share, reduce mod 2^bits, sum the sites mod 2^bits, read the
sum as signed and divide by γ. The pairwise masks of secure aggregation are left out: they cancel exactly in the
modular sum, so the server's result is the same integer vector with or without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedbroker.secagg import skellam

MODES = ("central", "distributed", "local")
NON_PRIVATE = "none"


@dataclass(frozen=True)
class Noise:
    """The noise one run adds. mode: none | central | distributed | local. z: the noise multiplier (central:
    Gaussian σ = zC on the total; distributed/local: Skellam of variance (γzC)² levels² in total over the
    quorum, resp. on EVERY site). gamma: levels per unit; bits: the ring."""

    mode: str
    z: float = 0.0
    gamma: float = 1.0
    bits: int = 64


class MLP:
    """x → ReLU(x W1 + b1) W2 + b2, parameters held as one flat float64 vector (the thing that gets noise)."""

    def __init__(self, *, inputs: int, hidden: int, classes: int) -> None:
        self.shapes = [(inputs, hidden), (hidden,), (hidden, classes), (classes,)]
        self.sizes = [int(np.prod(s)) for s in self.shapes]
        self.dim = sum(self.sizes)

    def init(self, rng: np.random.Generator) -> np.ndarray:
        """Glorot-uniform weights, zero biases."""
        parts = []
        for shape in self.shapes:
            if len(shape) == 2:
                limit = np.sqrt(6.0 / (shape[0] + shape[1]))
                parts.append(rng.uniform(-limit, limit, size=shape).ravel())
            else:
                parts.append(np.zeros(shape[0]))
        return np.concatenate(parts)

    def unpack(self, theta: np.ndarray) -> list[np.ndarray]:
        out, start = [], 0
        for shape, size in zip(self.shapes, self.sizes):
            out.append(theta[start:start + size].reshape(shape))
            start += size
        return out

    def logits(self, theta: np.ndarray, x: np.ndarray) -> np.ndarray:
        w1, b1, w2, b2 = self.unpack(theta)
        return np.maximum(x @ w1 + b1, 0.0) @ w2 + b2

    def accuracy(self, theta: np.ndarray, data: tuple[np.ndarray, np.ndarray]) -> float:
        x, y = data
        return float(np.mean(self.logits(theta, x).argmax(axis=1) == y))

    def clipped_sum(self, theta: np.ndarray, *, x: np.ndarray, y: np.ndarray, clip: float) -> np.ndarray:
        """Σ_i clip_C(∇ℓ(θ; x_i, y_i)) for cross-entropy, without forming any per-record gradient."""
        if len(y) == 0:
            return np.zeros(self.dim)
        w1, b1, w2, b2 = self.unpack(theta)
        z1 = x @ w1 + b1
        h = np.maximum(z1, 0.0)
        z2 = h @ w2 + b2
        z2 -= z2.max(axis=1, keepdims=True)
        p = np.exp(z2)
        p /= p.sum(axis=1, keepdims=True)
        d2 = p
        d2[np.arange(len(y)), y] -= 1.0
        d1 = (d2 @ w2.T) * (z1 > 0)
        sq = lambda a: np.einsum("ij,ij->i", a, a)  # noqa: E731 - row-wise squared norms
        norms = np.sqrt(sq(x) * sq(d1) + sq(d1) + sq(h) * sq(d2) + sq(d2))
        c = np.minimum(1.0, clip / np.maximum(norms, 1e-12))[:, None]
        d1, d2 = d1 * c, d2 * c
        return np.concatenate([(x.T @ d1).ravel(), d1.sum(axis=0), (h.T @ d2).ravel(), d2.sum(axis=0)])


# ---------------------------------------------------------------- what a site and the server do with a sum

def site_share(g: np.ndarray, *, gamma: float, variance: float, bits: int,
               rng: np.random.Generator) -> np.ndarray:
    """A site's input to the secure sum: round(γ·g) + Sk(variance), as a ring element (masks would be added here)."""
    levels = skellam.quantise(g, scale=gamma, rng=rng) + skellam.noise_share(rng, size=g.size, variance=variance)
    return skellam.to_ring(levels, bits=bits).astype(np.uint64)


def secure_sum(shares: list[np.ndarray], *, gamma: float, bits: int) -> np.ndarray:
    """The server's dequantised sum: Σ shares mod 2^bits (uint64 wraps mod 2^64, `from_ring` cuts to the ring),
    read as signed, divided by γ."""
    total = np.zeros(shares[0].shape, dtype=np.uint64)
    for share in shares:
        total += share
    return skellam.dequantise(skellam.from_ring(total, bits=bits), scale=gamma)


def noisy_sum(sums: list[np.ndarray], noise: Noise, *, clip: float, rng: np.random.Generator) -> np.ndarray:
    """The round's Σ_sites g_i + noise, as each mode produces it."""
    if noise.mode == NON_PRIVATE:
        return np.sum(sums, axis=0)
    if noise.mode == "central":
        total = np.sum(sums, axis=0)
        return total + rng.normal(0.0, noise.z * clip, total.shape)
    full = (noise.gamma * noise.z * clip) ** 2
    variance = full / len(sums) if noise.mode == "distributed" else full  # the quorum is every site here
    shares = [site_share(g, gamma=noise.gamma, variance=variance, bits=noise.bits, rng=rng) for g in sums]
    return secure_sum(shares, gamma=noise.gamma, bits=noise.bits)


# ---------------------------------------------------------------- one run

@dataclass(frozen=True)
class RunSpec:
    """One federation's DP-SGD: rounds T, sample rate q, clip C, step lr, evaluated every `eval_every` rounds."""

    rounds: int
    sample_rate: float
    clip: float
    lr: float
    hidden: int
    eval_every: int


def federated_dp_sgd(*, spec: RunSpec, noise: Noise, sites: list[tuple[np.ndarray, np.ndarray]],
                     test: tuple[np.ndarray, np.ndarray], classes: int, seed: int) -> dict[str, Any]:
    """Run T rounds; every round each site Poisson-samples its records, sums their clipped gradients, the sum
    over sites gets the mode's noise and x ← x − lr·(sum + noise)/(q·Σn).

    Within a seed the initial weights and every round's Poisson samples are the same for every mode and noise
    level (their generators depend on the seed only), so two modes differ by their noise alone."""
    model = MLP(inputs=sites[0][0].shape[1], hidden=spec.hidden, classes=classes)
    theta = model.init(np.random.default_rng([seed, 1]))
    sampler = np.random.default_rng([seed, 2])
    noise_rng = np.random.default_rng([seed, 3, MODES.index(noise.mode) if noise.mode in MODES else 9])
    total = sum(len(y) for _, y in sites)
    curve: list[tuple[int, float]] = []
    for r in range(1, spec.rounds + 1):
        sums = []
        for x, y in sites:
            take = sampler.random(len(y)) < spec.sample_rate
            sums.append(model.clipped_sum(theta, x=x[take], y=y[take], clip=spec.clip))
        theta = theta - spec.lr * noisy_sum(sums, noise, clip=spec.clip, rng=noise_rng) / (spec.sample_rate * total)
        if r % spec.eval_every == 0 or r == spec.rounds:
            curve.append((r, model.accuracy(theta, test)))
    return {"accuracy": curve[-1][1], "curve": curve, "dim": model.dim}
