"""A distributed-DP round's record: the facts its privacy claim rests on, as the aggregation service closed it.

The service writes it into the close's numeric `stats` (`to_stats`: the one map the close already carries to the
coordinator, no new message), the coordinator keeps it as the round's `ddp` event (`to_json`), and the face puts it
in words (`fedbroker.app.round_notes`). Anyone holding it can recompute the round's ε with the job's accountant
(`fedbroker.secagg.skellam`): the noise the sum carried is `total_variance` levels² per coordinate, at least
`quorum_variance` (the whole dose the job promised), and each survivor's share is named.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

PREFIX = "ddp_"
VARIANCE_PREFIX = "ddp_variance:"   # one stats key per survivor: its declared noise variance
_NUMBERS = ("bits", "scale", "wrap_bound", "quorum", "noise_multiplier", "clip", "sample_rate", "lr", "dim",
            "records", "share_variance", "total_variance", "quorum_variance")
_WHOLE = ("bits", "quorum", "dim", "records")


@dataclass(frozen=True)
class DDPRecord:
    """One closed round of a job with `privacy.distributed` (every variance in ring levels², per coordinate)."""

    bits: int                 # the signed sum lived mod 2^bits
    scale: float              # γ: levels per unit of a summed gradient
    wrap_bound: float         # the bound on the probability that any coordinate of the sum wrapped the ring
    quorum: int               # n_min: the survivors the noise shares were sized for
    noise_multiplier: float   # z: the quorum's noise has std z·clip (in gradient units)
    clip: float               # C: each record's gradient L2 clip
    sample_rate: float        # q: each record's Poisson sampling probability
    lr: float                 # the step the service applied: x ← x − lr·sum/(q·records)
    dim: int                  # d: coordinates of the sum (its rounding enters the sensitivity)
    records: int              # Σ n_j over the survivors (their declared sample counts)
    share_variance: float     # (γ·z·C)²/quorum: the least a survivor could declare
    total_variance: float     # Σ over the survivors of their declared variances: the noise the sum carried
    quorum_variance: float    # (γ·z·C)²: the whole dose a quorum carries, what the job's ε assumes
    variances: dict[str, float] = field(default_factory=dict)  # survivor → its declared noise variance

    @property
    def survivors(self) -> list[str]:
        """The survivors whose noise the sum carried, by name."""
        return sorted(self.variances)

    @property
    def conservative(self) -> bool:
        """Whether the sum carried at least the noise the job's ε is computed for."""
        return self.total_variance >= self.quorum_variance * (1 - 1e-12)

    def to_stats(self) -> dict[str, float]:
        """The record as numeric close stats (`CloseRoundReply.stats`)."""
        out = {PREFIX + name: float(getattr(self, name)) for name in _NUMBERS}
        out.update({VARIANCE_PREFIX + w: float(v) for w, v in self.variances.items()})
        return out

    def to_json(self) -> str:
        """The record as the coordinator keeps it in a job's `ddp` event."""
        return json.dumps(asdict(self), sort_keys=True)


def has_record(stats: Mapping[str, float]) -> bool:
    """Whether a close's stats hold a distributed-DP record."""
    return PREFIX + "bits" in stats


def from_stats(stats: Mapping[str, float]) -> DDPRecord:
    """The record back from a close's stats; a ValueError when they hold none (or a part is missing)."""
    try:
        numbers = {name: stats[PREFIX + name] for name in _NUMBERS}
    except KeyError as exc:
        raise ValueError(f"the close's stats hold no complete distributed-DP record ({exc.args[0]} missing)") from None
    variances = {k[len(VARIANCE_PREFIX):]: float(v) for k, v in stats.items() if k.startswith(VARIANCE_PREFIX)}
    return _build(numbers, variances)


def from_json(text: str) -> DDPRecord:
    """The record back from `to_json`'s text; a ValueError when it is not one."""
    raw = json.loads(text)
    if not isinstance(raw, dict) or not isinstance(raw.get("variances"), dict):
        raise ValueError("not a distributed-DP round record")
    try:
        return _build({name: raw[name] for name in _NUMBERS}, raw["variances"])
    except KeyError as exc:
        raise ValueError(f"not a distributed-DP round record ({exc.args[0]} missing)") from None


def _build(numbers: Mapping[str, object], variances: Mapping[str, object]) -> DDPRecord:
    values = {k: float(v) for k, v in numbers.items() if isinstance(v, (int, float))}
    if len(values) != len(numbers) or not all(math.isfinite(v) for v in values.values()):
        raise ValueError("a distributed-DP round record holds a value that is not a finite number")
    whole = {k: int(values[k]) for k in _WHOLE}
    return DDPRecord(bits=whole["bits"], scale=values["scale"], wrap_bound=values["wrap_bound"], quorum=whole["quorum"],
                     noise_multiplier=values["noise_multiplier"], clip=values["clip"],
                     sample_rate=values["sample_rate"], lr=values["lr"], dim=whole["dim"], records=whole["records"],
                     share_variance=values["share_variance"], total_variance=values["total_variance"],
                     quorum_variance=values["quorum_variance"],
                     variances={str(w): float(v) for w, v in variances.items() if isinstance(v, (int, float))})


def words(record: DDPRecord) -> str:
    """The record as the operator reads it (`jobs show`, `jobs logs`)."""
    shares = ", ".join(f"{w} {v:.4g}" for w, v in sorted(record.variances.items()))
    return (f"distributed DP: {len(record.variances)} survivor(s), quorum {record.quorum}; the sum carried noise "
            f"variance {record.total_variance:.4g} levels² per coordinate (the quorum's dose: "
            f"{record.quorum_variance:.4g}; declared: {shares}); ring 2^{record.bits}, γ {record.scale:.4g}, "
            f"wrap probability ≤ {record.wrap_bound:.2g}; step lr {record.lr:g} over q·{record.records} records "
            f"(q {record.sample_rate:g}, z {record.noise_multiplier:g}, C {record.clip:g})")
