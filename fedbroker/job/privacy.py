"""A job's `privacy` section: the DP the round itself carries, beside each site's own record-level policy.

Two options, never together (docs/privacy.md compares them):

- `distributed`: distributed DP inside secure aggregation. Each round is one federated DP-SGD step: every site
  draws a Poisson sample of its records (rate `sample_rate`), clips each record's gradient to L2 `clip`, sums
  them, and adds its share of Skellam noise in the ring, sized so that the secure sum of `quorum` survivors
  carries noise of standard deviation `noise_multiplier`·`clip` per coordinate. The server sees only the sum.
  Needs `aggregation.secure`. A site whose own policy says `mode: local` adds the whole dose itself.
- `site`: site-level DP-FedAvg (Andrew et al. 2021) for consortia that trust the aggregation service: the
  service clips each site's whole update to `clip_norm` (fixed, or adapted towards the `target_quantile` of the
  update norms) and adds Gaussian noise of std `noise_multiplier`·clip to the sum. The unit protected is a whole
  site. Not with `aggregation.secure` (the service must see each update to clip it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from fedbroker.errors import ConfigError

CLIPPING = ("fixed", "adaptive")


def _number_problems(section: str, obj: Any, limits: Mapping[str, tuple[float, float]]) -> list[ConfigError]:
    out = []
    for name, (lo, hi) in limits.items():
        value = getattr(obj, name)
        integral = isinstance(getattr(type(obj), name, None), int) and not isinstance(getattr(type(obj), name), bool)
        ok_type = (isinstance(value, int) if integral else isinstance(value, (int, float))) and not isinstance(value, bool)
        if not ok_type or not (math.isfinite(value) and lo <= value <= hi):
            out.append(ConfigError(f"privacy.{section}.{name}", f"must be {'an integer' if integral else 'a number'} "
                                                                f"in [{lo}, {hi}], got {value!r}"))
    return out


@dataclass(frozen=True)
class DistributedDP:
    """privacy.distributed (see the module docstring)."""

    enabled: bool = False
    noise_multiplier: float = 1.0   # z: the quorum's sum carries Skellam noise of std z·clip per coordinate
    clip: float = 1.0               # C: each record's gradient is clipped to this L2 norm
    sample_rate: float = 0.05       # q: each record joins a round's step with this probability (Poisson)
    quorum: int = 2                 # n_min: the fewest survivors a round closes with; shares are sized for it

    LIMITS: ClassVar[Mapping[str, tuple[float, float]]] = {"noise_multiplier": (0.05, 1000.0), "clip": (1e-6, 1e6), "sample_rate": (1e-6, 1.0),
              "quorum": (2, 100_000)}

    def problems(self) -> list[ConfigError]:
        """Every problem of the section at once (nothing is checked while it is disabled)."""
        if not isinstance(self.enabled, bool):
            return [ConfigError("privacy.distributed.enabled", f"must be true or false, got {self.enabled!r}")]
        return _number_problems("distributed", self, self.LIMITS) if self.enabled else []


@dataclass(frozen=True)
class SiteDP:
    """privacy.site (see the module docstring)."""

    enabled: bool = False
    clipping: str = "fixed"          # fixed | adaptive (the clip follows target_quantile of the update norms)
    noise_multiplier: float = 1.0    # z: the sum's Gaussian noise has std z·clip
    clip_norm: float = 1.0           # S: a site's whole update is clipped to this L2 norm (adaptive: the start)
    target_quantile: float = 0.5     # adaptive: the share of updates the clip should leave unclipped
    clip_lr: float = 0.2             # adaptive: η_C of the geometric update S ← S·exp(−η_C (b̄ − γ))
    count_noise_multiplier: float = 0.0  # adaptive: σ_b of the clipped-count's noise (0: derived, Andrew et al.)

    LIMITS: ClassVar[Mapping[str, tuple[float, float]]] = {"noise_multiplier": (0.0, 1000.0), "clip_norm": (1e-9, 1e9), "target_quantile": (0.0, 1.0),
              "clip_lr": (0.0, 10.0), "count_noise_multiplier": (0.0, 1000.0)}

    def problems(self) -> list[ConfigError]:
        """Every problem of the section at once (nothing is checked while it is disabled)."""
        if not isinstance(self.enabled, bool):
            return [ConfigError("privacy.site.enabled", f"must be true or false, got {self.enabled!r}")]
        if not self.enabled:
            return []
        out = _number_problems("site", self, self.LIMITS)
        if self.clipping not in CLIPPING:
            out.append(ConfigError("privacy.site.clipping", f"must be 'fixed' or 'adaptive', got {self.clipping!r}"))
        return out


@dataclass(frozen=True)
class PrivacyConfig:
    """The job's `privacy` section: at most one of its options enabled."""

    distributed: DistributedDP = field(default_factory=DistributedDP)
    site: SiteDP = field(default_factory=SiteDP)

    def problems(self, *, secure: bool, mode: str, group_size: int = 0) -> list[ConfigError]:
        """Each option's own problems, then what it needs of the rest of the job."""
        out = self.distributed.problems() + self.site.problems()
        if out:
            return out
        if self.distributed.enabled and self.site.enabled:
            out.append(ConfigError("privacy", "distributed and site DP are alternatives: enable one"))
        if self.distributed.enabled and not secure:
            out.append(ConfigError("privacy.distributed", "needs aggregation.secure: true (the noise is split among "
                                                          "sites only because the server sees nothing but the sum)"))
        if self.distributed.enabled and mode != "sync":
            out.append(ConfigError("privacy.distributed", f"needs schedule.mode sync, got {mode!r}"))
        if self.site.enabled and mode == "async":
            out.append(ConfigError("privacy.site", "needs schedule.mode sync (an asynchronous buffer is not clipped "
                                                   "or noised)"))
        if self.distributed.enabled and group_size:
            out.append(ConfigError("privacy.distributed", "cannot run with aggregation.secure_group_size: each group's "
                                                          "sum would carry only its members' shares of the noise"))
        if self.site.enabled and secure:
            out.append(ConfigError("privacy.site", "cannot run with aggregation.secure: the service must see each "
                                                   "site's update to clip it (use privacy.distributed)"))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The section as a job writes it (only the enabled option, or nothing)."""
        out: dict[str, Any] = {}
        for name in ("distributed", "site"):
            option = getattr(self, name)
            if option.enabled:
                out[name] = {f.name: getattr(option, f.name) for f in fields(option)}
        return out


def parse_privacy(raw: Any, errors: list[ConfigError]) -> PrivacyConfig:
    """The section from parsed YAML; problems are appended to `errors` (each naming its field)."""
    if raw is None:
        return PrivacyConfig()
    if not isinstance(raw, Mapping):
        errors.append(ConfigError("privacy", f"must be a mapping, got {type(raw).__name__}"))
        return PrivacyConfig()
    options: dict[str, Any] = {}
    for key in sorted(set(raw) - {"distributed", "site"}):
        errors.append(ConfigError(f"privacy.{key}", "unknown field; known: distributed, site"))
    for name, cls in (("distributed", DistributedDP), ("site", SiteDP)):
        given = raw.get(name)
        if given is None:
            continue
        if not isinstance(given, Mapping):
            errors.append(ConfigError(f"privacy.{name}", f"must be a mapping, got {type(given).__name__}"))
            continue
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(given) - known)
        for key in unknown:
            errors.append(ConfigError(f"privacy.{name}.{key}", f"unknown field; known: {', '.join(sorted(known))}"))
        if unknown:
            continue
        option = cls(**{"enabled": True, **given})
        problems = option.problems()
        errors.extend(problems)
        if not problems:
            options[name] = option
    return PrivacyConfig(**options)
