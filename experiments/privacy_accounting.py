"""The privacy experiment's noise calibration: the smallest noise multiplier that gives each cell its ε.

Central: the sampled-Gaussian RDP accountant the workers use (`fedbroker.privacy.project_epsilon`), T steps at
rate q. Distributed and local: the Skellam accounting of `fedbroker.secagg.skellam` (the module the secure rounds
use), which also picks the quantiser's scale γ and the ring. Calibrated once per (task, N, ε, mode) in the
parent process and stored with the results, so every seed of a cell runs the same noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from experiments.privacy_sim import Noise
from fedbroker.secagg import skellam

Z_LOW, Z_HIGH = 0.05, 500.0
DIAGNOSTIC = "distributed_cz"


def smallest_z(epsilon_of: Callable[[float], float], target: float, *, rel_tol: float = 1e-3) -> float:
    """The smallest z with epsilon_of(z) ≤ target, by bisection (ε falls as z grows)."""
    low, high = Z_LOW, Z_HIGH
    if epsilon_of(high) > target:
        raise ValueError(f"even z = {high} does not reach ε = {target}")
    while high - low > rel_tol * high:
        mid = math.sqrt(low * high)
        if epsilon_of(mid) <= target:
            high = mid
        else:
            low = mid
    return high


def central_z(*, epsilon: float, sample_rate: float, rounds: int, delta: float) -> float:
    from fedbroker.privacy import project_epsilon

    return smallest_z(lambda z: project_epsilon([], noise_multiplier=z, sample_rate=sample_rate, steps=rounds,
                                                delta=delta), epsilon)


def skellam_round(*, z: float, clip: float, sites: int, dim: int, sample_rate: float,
                  records: int) -> skellam.DDPRound:
    """γ and the ring for one cell, by the module's own rule; the quorum is every site (none drops out here), and
    the ring holds every site adding the full dose, so local mode's sums fit it too."""
    return skellam.choose(clip=clip, noise_multiplier=z, quorum=sites, n_max=sites, dim=dim,
                          sample_rate=sample_rate, max_records=records)


def skellam_z(*, epsilon: float, clip: float, sites: int, dim: int, sample_rate: float, records: int,
              rounds: int, delta: float) -> float:
    """The smallest z whose Skellam sum (variance (γzC)² in all) gives ε after T rounds: `distributed_epsilon`.
    A local-mode site's own share is that same dose, so its ε (`local_floor_epsilon`) is the same number."""
    def eps(z: float) -> float:
        r = skellam_round(z=z, clip=clip, sites=sites, dim=dim, sample_rate=sample_rate, records=records)
        return skellam.distributed_epsilon(round=r, total_variance=r.full_variance, rounds=rounds, delta=delta)

    return smallest_z(eps, epsilon)


def calibrate(protocol: Any, *, dims: Mapping[str, int], records: Mapping[str, int]) -> dict[str, Any]:
    """Every cell's noise, keyed "task|N|mode|ε", with the figures that say what it buys."""
    from fedbroker.privacy import project_epsilon

    out: dict[str, Any] = {}
    q, T, delta = protocol.sample_rate, protocol.rounds, protocol.delta
    for eps in protocol.epsilons:
        zc = central_z(epsilon=eps, sample_rate=q, rounds=T, delta=delta)
        central = {"z": zc, "gamma": 1.0, "bits": 64,
                   "epsilon": project_epsilon([], noise_multiplier=zc, sample_rate=q, steps=T, delta=delta)}
        for name in protocol.datasets:
            for n in protocol.sites:
                if "central" in protocol.modes:
                    out[key(name, sites=n, mode="central", epsilon=eps)] = dict(central)
                cell = {"sites": n, "dim": dims[name], "records": records[name], "protocol": protocol}
                for mode in ("distributed", "local"):
                    if mode in protocol.modes:
                        out[key(name, sites=n, mode=mode, epsilon=eps)] = skellam_cell(mode, epsilon=eps, **cell)
                if getattr(protocol, "diagnostic", False):
                    out[key(name, sites=n, mode=DIAGNOSTIC, epsilon=eps)] = at_central_z(zc, **cell)
    return out


def skellam_cell(mode: str, *, epsilon: float, sites: int, dim: int, records: int, protocol: Any) -> dict[str, Any]:
    """A distributed or local cell: z calibrated by the Skellam accounting, and what a site's own share gives."""
    from fedbroker.privacy import project_epsilon

    q, T, delta, clip = protocol.sample_rate, protocol.rounds, protocol.delta, protocol.clip
    z = skellam_z(epsilon=epsilon, clip=clip, sites=sites, dim=dim, sample_rate=q, records=records, rounds=T,
                  delta=delta)
    r = skellam_round(z=z, clip=clip, sites=sites, dim=dim, sample_rate=q, records=records)
    share = r.full_variance / sites if mode == "distributed" else r.full_variance
    return {"z": z, "gamma": r.scale, "bits": r.bits, "wrap_probability": r.wrap_probability,
            "epsilon": skellam.distributed_epsilon(round=r, total_variance=r.full_variance, rounds=T, delta=delta),
            "gaussian_epsilon_same_z": project_epsilon([], noise_multiplier=z, sample_rate=q, steps=T, delta=delta),
            "share_variance": share,
            "own_share_epsilon": skellam.local_floor_epsilon(round=r, share_variance=share, rounds=T, delta=delta)}


def at_central_z(z: float, *, sites: int, dim: int, records: int, protocol: Any) -> dict[str, Any]:
    """The diagnostic cell: the distributed mechanism with central's z; 'epsilon' is what the Skellam accounting
    then gives (above the target wherever it is looser than the Gaussian accountant)."""
    q, T, delta = protocol.sample_rate, protocol.rounds, protocol.delta
    r = skellam_round(z=z, clip=protocol.clip, sites=sites, dim=dim, sample_rate=q, records=records)
    return {"z": z, "gamma": r.scale, "bits": r.bits, "wrap_probability": r.wrap_probability,
            "epsilon": skellam.distributed_epsilon(round=r, total_variance=r.full_variance, rounds=T, delta=delta),
            "share_variance": r.full_variance / sites,
            "own_share_epsilon": skellam.local_floor_epsilon(round=r, share_variance=r.full_variance / sites,
                                                             rounds=T, delta=delta)}


def key(name: str, *, sites: int, mode: str, epsilon: float) -> str:
    """A cell's calibration key, "task|N|mode|ε" (JSON keys are strings)."""
    return f"{name}|{sites}|{mode}|{epsilon:g}"


def noise_for(calibration: Mapping[str, Any], *, name: str, sites: int, mode: str, epsilon: float) -> Noise:
    c = calibration[key(name, sites=sites, mode=mode, epsilon=epsilon)]
    return Noise("distributed" if mode == DIAGNOSTIC else mode, z=float(c["z"]), gamma=float(c["gamma"]),
                 bits=int(c["bits"]))


def _maybe(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def calibration_table(calibration: Mapping[str, Any]) -> str:
    """z, γ, ring and ε per cell; 'own share ε': a site's ε if every other site colluded with the server; the last
    column: what the workers' sampled-Gaussian accountant would give at the same z (the accountants' gap)."""
    lines = ["| task | N | mode | target ε | z | γ | ring bits | P(wrap) ≤ | ε (accounted) | own share ε | "
             "Gaussian accountant's ε at this z |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for k, c in calibration.items():
        name, n, mode, eps = k.split("|")
        own = c.get("own_share_epsilon")
        wrap = c.get("wrap_probability")
        lines.append(f"| {name} | {n} | {mode} | {eps} | {c['z']:.3f} | {c['gamma']:.4g} | {c['bits']} | "
                     f"{'—' if wrap is None else f'{wrap:.1e}'} | {c['epsilon']:.3f} | "
                     f"{'—' if own is None else f'{own:.2f}'} | {_maybe(c.get('gaussian_epsilon_same_z'))} |")
    return "\n".join(lines)
