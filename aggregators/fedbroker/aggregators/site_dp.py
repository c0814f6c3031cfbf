"""Site-level DP-FedAvg at the aggregation service: clip each site's whole update, sum, add Gaussian noise, and
(adaptive clipping) move the clip towards a quantile of the update norms (McMahan, Ramage, Talwar, Zhang, ICLR
2018; Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021). Pure: numpy only, the noise from a Generator passed in.

The unit protected is a whole site: the round's output must barely change whether a site's update is in it or
not, whatever that update is. Per round, with S the clip, z the job's `noise_multiplier`:

    Δ_i ← Δ_i · min(1, S / ‖Δ_i‖₂)                    (scaled, never dropped)
    Δ   = (Σ_i ω_i Δ_i + N(0, (z_Δ·S)² I)) / W          (noise on the SUM; the mean's std is z_Δ·S/W)

Weights. A normalised weight ω_i / Σ_accepted ω_j lets one site's presence change every other site's coefficient,
and the sum's sensitivity is then no longer S. DP-FedAvg's estimator keeps the sensitivity at S by two rules,
both enforced here: each site's weight lies in [0, 1] and is fixed before any site trains (from facts the
round opens with, never from the round's uploads), and the denominator W is fixed too: the total weight of the
sites ASKED, whether or not they answer. With uniform weights (ω_i = 1) W = n, the sites asked, so a site can
move the model by at most S/n, and the mean's noise has std z_Δ·S/n. A site asked that does not answer counts
0 in the sum (the step shrinks, it is never re-normalised). `site_weights` turns the job's weighting into such
weights: `uniform` gives 1 each; `fedavg` gives each site its REGISTERED sample count over the largest one of
the round (fixed at the round's open; the count an upload claims is not used, so a site lying in its upload
changes nothing). A weighting that reads the round's data across sites (dwfed) is refused (`check_job`).

Adaptive clipping (Andrew et al.): b_i = 1[‖Δ_i‖ ≤ S] with S this round's clip, and

    b̄ = (Σ_i (b_i − ½) + N(0, σ_b²)) / n + ½,      S ← S · exp(−η_C (b̄ − γ))

Centred on ½, one site changes the count by at most ½; when every asked site answers b̄ = (Σ b_i + N(0, σ_b²))/n.
The count and the update are two Gaussian mechanisms whose RDP adds up; the update's multiplier is raised to
z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) so that the pair costs exactly what one Gaussian mechanism of multiplier z costs,
and the accounting (the coordinator's) uses z alone. σ_b = 0 in the job means derived: max(n/20, z·√10/2),
the paper's n/20 for large rounds, and for small ones the σ_b at which the count takes a tenth of the round's
RDP (z_Δ ≤ 1.054·z); an explicit σ_b with 2σ_b ≤ z leaves z_Δ undefined and is refused. z = 0 is clipping
without noise: no privacy is claimed (the coordinator's ε is infinite).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fedbroker.errors import ConfigError
from fedbroker.job.privacy import SiteDP

COUNT_SHARE = 0.1  # a derived σ_b never lets the clipped-count take more than this share of the round's RDP
WEIGHTINGS = ("uniform", "fedavg")  # weightings whose site weights can be fixed before the round (`site_weights`)


@dataclass(frozen=True)
class SiteReport:
    """One site's update as the round clipped it."""

    worker_id: str
    norm: float       # ‖Δ_i‖₂ as uploaded
    clipped: bool     # norm > clip: scaled down to the clip
    clip: float       # S used this round
    weight: float     # ω_i, its fixed weight in [0, 1]


@dataclass(frozen=True)
class SiteDPResult:
    """A round's noised mean update, the clip for the next round, and what happened to each site."""

    delta: np.ndarray             # to add to the global model (flat, float64)
    next_clip: float              # S for the next round (equal to `clip` with fixed clipping)
    reports: list[SiteReport]
    stats: dict[str, float]


def check_job(site: SiteDP, *, weighting: str, selection: str, robust: str, alignment: str) -> None:
    """Refuse a site-DP job whose other choices break the sensitivity argument (ConfigError naming the field):
    an alignment or a robust rule replaces the mean, a selection drops updates (the GA's by their contents), dwfed's weights depend on
    every site's data; and an explicit count noise that leaves z_Δ undefined."""
    if alignment != "none":
        raise ConfigError("aggregation.alignment", f"privacy.site needs the mean, not alignment {alignment!r}")
    if robust != "none":
        raise ConfigError("aggregation.robust", f"privacy.site clips every update itself; robust {robust!r} would "
                                                f"re-weigh them from their contents (use none)")
    if selection != "all":
        raise ConfigError("aggregation.selection", f"privacy.site sums every accepted update (selection all), "
                                                   f"got {selection!r}")
    if weighting not in WEIGHTINGS:
        raise ConfigError("aggregation.weighting", f"privacy.site needs weights fixed before the round "
                                                   f"({' or '.join(WEIGHTINGS)}), got {weighting!r}")
    if site.clipping == "adaptive" and site.count_noise_multiplier > 0:
        update_noise_multiplier(site.noise_multiplier, site.count_noise_multiplier)


def count_noise_multiplier(site: SiteDP, asked: int) -> float:
    """σ_b of the clipped count for a round of `asked` sites: the job's, or derived when it gives 0."""
    if site.count_noise_multiplier > 0:
        return float(site.count_noise_multiplier)
    if site.noise_multiplier == 0:
        return 0.0
    return max(asked / 20.0, site.noise_multiplier / (2.0 * math.sqrt(COUNT_SHARE)))


def update_noise_multiplier(z: float, sigma_b: float) -> float:
    """z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2): the update's multiplier that, beside a count with noise σ_b, spends z's
    privacy. ConfigError naming `privacy.site.count_noise_multiplier` where it is undefined (2σ_b ≤ z)."""
    if z == 0:
        return 0.0
    if not 2.0 * sigma_b > z:
        raise ConfigError("privacy.site.count_noise_multiplier",
                          f"must exceed noise_multiplier/2 = {z / 2:g} so that the update's noise multiplier "
                          f"(z^-2 - (2 sigma_b)^-2)^(-1/2) is defined, got {sigma_b:g}")
    return float((z ** -2 - (2.0 * sigma_b) ** -2) ** -0.5)


def site_weights(weighting: str, participants: Sequence[str], *, registered: Mapping[str, int]) -> dict[str, float]:
    """ω_i in [0, 1] for every site asked, fixed when the round opens (see the module docstring): 1 each for
    `uniform`; for `fedavg` the registered sample count over the round's largest (a site without one: 1)."""
    if weighting not in WEIGHTINGS:
        raise ConfigError("aggregation.weighting", f"privacy.site needs {' or '.join(WEIGHTINGS)}, got {weighting!r}")
    if weighting == "uniform":
        return {w: 1.0 for w in participants}
    counts = {w: registered.get(w) for w in participants}
    largest = max((c for c in counts.values() if c is not None and c > 0), default=0)
    return {w: 1.0 if c is None or largest == 0 else min(1.0, max(c, 0) / largest) for w, c in counts.items()}


def clip_rows(deltas: np.ndarray, clip: float) -> tuple[np.ndarray, np.ndarray]:
    """Each row scaled to L2 norm ≤ `clip` (a copy, float64), and the rows' norms before."""
    rows = np.asarray(deltas, dtype=np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows)) if rows.size else np.zeros(len(rows))
    scale = np.minimum(1.0, clip / np.maximum(norms, np.finfo(np.float64).tiny))
    return rows * scale[:, None], norms


def aggregate(deltas: np.ndarray, workers: Sequence[str], *, weights: Mapping[str, float], site: SiteDP,
              clip: float, rng: np.random.Generator) -> SiteDPResult:
    """One DP-FedAvg round over the accepted sites' updates `deltas` (rows, in `workers`' order). `weights`: ω of
    every site ASKED (its total is the fixed denominator W); `clip`: this round's S; `rng`: the noise."""
    deltas = np.asarray(deltas)
    if deltas.ndim != 2 or deltas.shape[0] != len(workers):
        raise ValueError(f"deltas must be one row per worker ({len(workers)}), got shape {deltas.shape}")
    if not (math.isfinite(clip) and clip > 0):
        raise ConfigError("privacy.site.clip_norm", f"the clip must be a finite number > 0, got {clip!r}")
    missing = [w for w in workers if w not in weights]
    if missing:
        raise ValueError(f"worker(s) {missing} were not asked this round (no fixed weight)")
    omega = np.array([float(weights[w]) for w in workers])
    if np.any((omega < 0) | (omega > 1)) or not all(0 <= v <= 1 for v in weights.values()):
        raise ValueError("site weights must lie in [0, 1] (the sensitivity argument needs them bounded)")
    asked, total = len(weights), float(sum(weights.values()))
    if total <= 0:
        raise ValueError("the sites asked have no weight: the mean's denominator W would be 0")
    z = float(site.noise_multiplier)
    adaptive = site.clipping == "adaptive"
    sigma_b = count_noise_multiplier(site, asked) if adaptive else 0.0
    z_update = update_noise_multiplier(z, sigma_b) if adaptive else z
    clipped, norms = clip_rows(deltas, clip)
    noise = rng.normal(0.0, z_update * clip, size=deltas.shape[1]) if z_update > 0 else np.zeros(deltas.shape[1])
    delta = (omega @ clipped + noise) / total
    next_clip, fraction = clip, float("nan")
    if adaptive:
        unclipped = norms <= clip
        count = float(np.sum(unclipped - 0.5)) + (float(rng.normal(0.0, sigma_b)) if sigma_b > 0 else 0.0)
        fraction = count / asked + 0.5
        next_clip = float(clip * math.exp(-site.clip_lr * (fraction - site.target_quantile)))
    reports = [SiteReport(w, float(n), bool(n > clip), float(clip), float(o))
               for w, n, o in zip(workers, norms, omega)]
    stats = {"site_dp_clip": float(clip), "site_dp_next_clip": next_clip, "site_dp_asked": float(asked),
             "site_dp_clipped": float(sum(r.clipped for r in reports)), "site_dp_weight_total": total,
             "site_dp_noise_std": z_update * clip / total, "site_dp_update_noise_multiplier": z_update,
             "site_dp_count_noise_multiplier": sigma_b}
    if adaptive:
        stats["site_dp_unclipped_fraction"] = fraction
    return SiteDPResult(delta, next_clip, reports, stats)


def noise_rng(seed: int | None, round_number: int) -> np.random.Generator:
    """The noise's generator: from the OS's entropy in production (`seed` None: nobody, the job's seed included,
    can predict it); from an injected seed and the round in tests."""
    if seed is None:
        return np.random.default_rng(int.from_bytes(os.urandom(32), "little"))
    return np.random.default_rng([seed, round_number])
