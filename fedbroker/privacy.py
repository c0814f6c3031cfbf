"""A job's ε arithmetic: Opacus's sampling rule, planned steps, ε projection and history. In the kernel
because two services price a round alike: the worker checks it against its owner's budget, and the
coordinator prices a round for a worker it has not heard from yet (`job_epsilon_after_round`).

The ε of a job composes across rounds: the job's accountant history (noise multiplier, sample rate,
steps) is restored into a fresh RDP accountant before each round's training, so ε after round t is the
RDP composition of all rounds. Pure arithmetic over that history; Opacus's RDP accountant computes ε
and is imported only when it does (importing Opacus imports torch and takes seconds).

With Poisson sampling Opacus samples at q = 1/ceil(N/B) and takes int(1/q) steps per epoch, which is
one step short of ceil(N/B) for some N/B (93, 99, 105, ...); its accountant then records
1/(steps per epoch), slightly above the true rate (conservative), and its optimizer averages by
int(N·that rate). `dp_sample_rate` and `planned_steps` copy those rules, and training asks Opacus's
own loader for them before any step and refuses if they differ, so a task admitted on a projected ε
spends exactly that ε. The accountant records each step through Opacus's optimizer hook; when its
history is the planned one (always, unless a rule changed), the projection is the round's ε instead
of a second 20 ms RDP computation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from fedbroker.errors import ConfigError
from fedbroker.job.spec import TrainingConfig

HistoryEntry = tuple[float, float, int]


def dp_sample_rate(num_samples: int, config: TrainingConfig) -> float:
    """Sample rate Opacus's RDP accountant records for a loader of `config.batch_size`.

    That is 1/(steps per epoch): 1/ceil(N/B) except where float rounding makes Opacus take one step
    fewer, then a hair above the rate it samples at. Pass it to `project_epsilon`.
    """
    return 1.0 / steps_per_epoch(num_samples, config)


def planned_steps(num_samples: int, config: TrainingConfig) -> int:
    """Optimizer steps `train_local` takes, with or without DP: local_epochs · int(1/(1/ceil(N/B)))."""
    return config.local_epochs * steps_per_epoch(num_samples, config)


def steps_per_epoch(num_samples: int, config: TrainingConfig) -> int:
    """Steps of one epoch over `num_samples`, by Opacus's DPDataLoader rule (also the non-DP loop's count)."""
    check_int("num_samples", num_samples, low=1)
    return int(1.0 / (1.0 / math.ceil(num_samples / config.batch_size)))


def project_epsilon(
    history: Sequence[Sequence[float]], *, noise_multiplier: float, sample_rate: float, steps: int, delta: float
) -> float:
    """ε a job would have spent after `steps` more DP-SGD steps; used to refuse a task *before* training.

    The new steps are merged into the history exactly as Opacus's RDP accountant merges them, so
    the projection equals the ε the accountant reports after training those steps.
    """
    _check_positive("noise_multiplier", noise_multiplier)
    if not (isinstance(sample_rate, (int, float)) and 0.0 < sample_rate <= 1.0):
        raise ConfigError("sample_rate", f"must lie in (0, 1], got {sample_rate!r}")
    check_int("steps", steps, low=0)
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ConfigError("delta", f"must lie strictly between 0 and 1, got {delta!r}")
    planned = merge_steps(normalise_history(history), noise_multiplier=noise_multiplier, sample_rate=sample_rate,
                          steps=steps)
    return epsilon_of(planned, delta=delta)


def merge_steps(
    entries: list[HistoryEntry], *, noise_multiplier: float, sample_rate: float, steps: int
) -> list[HistoryEntry]:
    """`entries` plus `steps` DP-SGD steps, merged as Opacus's RDP accountant merges its step records."""
    out = list(entries)
    if steps:
        if out and out[-1][0] == noise_multiplier and out[-1][1] == sample_rate:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + steps)
        else:
            out.append((float(noise_multiplier), float(sample_rate), int(steps)))
    return out


def epsilon_of(history: list[HistoryEntry], *, delta: float) -> float:
    """ε of `history`, bit for bit what a fresh Opacus RDP accountant holding it reports.

    The accountant sums, per entry, Opacus's RDP of one step times the entry's steps, then converts at its
    default orders. The RDP of one step depends only on (σ, q), and for fractional orders it is a series
    that costs milliseconds: it is computed once per (σ, q) here (`_step_rdp`), where the accountant
    recomputed it for every projection (each heartbeat, each budget check), most of a worker's CPU on a
    small model."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import get_privacy_spent

    if not history:
        return 0.0
    rdp = sum([_step_rdp(noise_multiplier, sample_rate) * steps for noise_multiplier, sample_rate, steps in history])
    epsilon, _ = get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    return float(epsilon)


@functools.lru_cache(maxsize=1024)
def _step_rdp(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """Opacus's RDP of one DP-SGD step at each of its accountant's default orders (read-only)."""
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    rdp = np.asarray(compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=1,
                                 orders=RDPAccountant.DEFAULT_ALPHAS))
    rdp.setflags(write=False)
    return rdp


def normalise_history(history: Sequence[Sequence[float]]) -> list[HistoryEntry]:
    """Entries as (noise_multiplier, sample_rate, steps) tuples; accepts the lists JSON gives back."""
    out: list[HistoryEntry] = []
    for i, entry in enumerate(history):
        if len(entry) != 3:
            raise ConfigError(f"history[{i}]", f"must be (noise_multiplier, sample_rate, steps), got {entry!r}")
        nm, q, steps = entry
        try:
            valid = float(nm) > 0 and 0 < float(q) <= 1 and int(steps) == steps and int(steps) >= 0
        except (TypeError, ValueError):
            valid = False
        if not valid:
            raise ConfigError(f"history[{i}]", f"invalid accountant entry {entry!r}")
        out.append((float(nm), float(q), int(steps)))
    return out


def check_int(field: str, value: object, *, low: int) -> None:
    """Refuse anything but an integer (numpy's included, bool not) of at least `low`."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(field, f"must be an integer >= {low}, got {value!r}")


def _check_positive(field: str, value: object) -> None:
    """Refuse anything but a number > 0 (bool not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(field, f"must be a number > 0, got {value!r}")


def job_epsilon_after_round(history: Sequence[Sequence[float]], *, num_samples: int, config: TrainingConfig,
                            noise_multiplier: float, delta: float) -> float:
    """A job's ε after one more round of `config` on `num_samples` samples: what a worker checks against its
    budget before training, and what it (or, for a job it never trained, the coordinator from its registered
    policy) reports so that a round opens only with workers that can afford it."""
    return project_epsilon(history, noise_multiplier=noise_multiplier,
                           sample_rate=dp_sample_rate(num_samples, config),
                           steps=planned_steps(num_samples, config), delta=delta)
