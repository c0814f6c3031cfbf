"""Timing, statistics, results and the Markdown table; nothing here imports the project.

A benchmark returns a `Section`: rows of parameters, measured statistics (min/median/max over repeats)
and ratios against a baseline measured in the same run, plus the goals it checks and notes that say
what was capped or skipped and why. `bench/averaging.py` also runs under the Flower environment
(`.venv-bench`), so this module needs nothing but the standard library and numpy.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Stat:
    """min / median / max of repeated measurements, in `unit`."""

    min: float
    median: float
    max: float
    unit: str
    n: int

    @classmethod
    def of(cls, values: Iterable[float], unit: str) -> Stat:
        vals = [float(v) for v in values]
        if not vals:
            raise ValueError("no measurement")
        return cls(min(vals), statistics.median(vals), max(vals), unit, len(vals))

    def scaled(self, factor: float, unit: str) -> Stat:
        """The same numbers times `factor` (a positive factor keeps min/max in place)."""
        return Stat(self.min * factor, self.median * factor, self.max * factor, unit, self.n)

    def inverse(self, numerator: float, unit: str) -> Stat:
        """numerator / value: seconds → throughput (the slowest run gives the min)."""
        return Stat(numerator / self.max, numerator / self.median, numerator / self.min, unit, self.n)

    def text(self) -> str:
        if self.n == 1 or self.min == self.max:
            return fmt(self.median)
        return f"{fmt(self.median)} ({fmt(self.min)}–{fmt(self.max)})"


@dataclass(frozen=True)
class Goal:
    name: str
    value: float | None
    target: str
    met: bool | None  # None: could not be evaluated (a baseline is missing)
    detail: str = ""


@dataclass
class Section:
    key: str
    title: str
    measures: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    goals: list[Goal] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "measures": self.measures,
            "rows": [{k: _jsonable(v) for k, v in row.items()} for row in self.rows],
            "goals": [_jsonable(asdict(g)) for g in self.goals],
            "notes": self.notes,
            "seconds": round(self.seconds, 2),
        }

    @classmethod
    def from_json(cls, key: str, data: dict[str, Any]) -> Section:
        rows = [{k: (Stat(**v) if isinstance(v, dict) and "median" in v else v) for k, v in row.items()}
                for row in data.get("rows", [])]
        goals = [Goal(**g) for g in data.get("goals", [])]
        return cls(key, data["title"], data["measures"], rows, goals, list(data.get("notes", [])),
                   float(data.get("seconds", 0.0)))


def fmt(x: Any) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        ax = abs(x)
        if ax == 0:
            return "0"
        if ax >= 100:
            return f"{x:,.0f}"
        if ax >= 10:
            return f"{x:.1f}"
        if ax >= 0.01:
            return f"{x:.3g}"
        return f"{x:.2e}"
    return str(x)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Stat):
        return asdict(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def repeat(fn: Callable[[], Any], *, repeats: int, warmup: int = 1, setup: Callable[[], Any] | None = None) -> list[float]:
    """Wall-clock seconds of `fn` over `repeats` runs after `warmup` unrecorded ones (gc off while timing)."""
    times = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
        finally:
            gc.enable()
        if i >= warmup:
            times.append(elapsed)
    return times


def loglog_slope(xs: Iterable[float], ys: Iterable[float]) -> float | None:
    """Least-squares slope of log y against log x: the fitted growth exponent."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0]
    if len({p[0] for p in pts}) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def rss_bytes() -> int:
    """Resident set size of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of a process; False where the kernel refuses."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes(pid: int | str = "self") -> int:
    """Peak RSS (VmHWM) since the process started or since `reset_peak_rss`."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc status")


def current_rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc status")


def machine() -> dict[str, Any]:
    """What the numbers were measured on (the lead copies this under the table)."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": model,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(mem / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    try:
        import numpy

        info["numpy"] = numpy.__version__
    except ImportError:  # pragma: no cover
        pass
    return info


def render_markdown(report: dict[str, Any], sections: list[Section]) -> str:
    m = report["machine"]
    lines = [
        "# fedbroker benchmarks",
        "",
        f"Produced by `{report['command']}` ({report['mode']} mode) on {report['finished']}, "
        f"in {report['seconds']:.0f} s.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['usable_cores']} usable), {m['memory_gib']} GiB, "
        f"Python {m['python']}, numpy {m.get('numpy', '?')}; load average {m['load_average_at_start']} at the "
        f"start and {m.get('load_average_at_end', '?')} at the end (other work on the machine skews the timings; "
        "the ratios compare numbers taken seconds apart in the same run).",
        "",
        "Each cell is the median of the repeats with (min–max); ratios use medians.",
        "",
        "## Goals",
        "",
        "| benchmark | goal | value | target | met |",
        "|---|---|---|---|---|",
    ]
    for s in sections:
        for g in s.goals:
            met = "–" if g.met is None else ("yes" if g.met else "**no**")
            detail = f" ({g.detail})" if g.detail else ""
            lines.append(f"| {s.title} | {g.name}{detail} | {fmt(g.value)} | {g.target} | {met} |")
    for s in sections:
        lines += ["", f"## {s.title}", "", s.measures, ""]
        if s.rows:
            columns: list[str] = []
            for row in s.rows:
                for k in row:
                    if k not in columns:
                        columns.append(k)
            lines.append("| " + " | ".join(columns) + " |")
            lines.append("|" + "---|" * len(columns))
            for row in s.rows:
                cells = []
                for c in columns:
                    v = row.get(c)
                    cells.append(v.text() if isinstance(v, Stat) else fmt(v))
                lines.append("| " + " | ".join(cells) + " |")
        for note in s.notes:
            lines.append("")
            lines.append(f"- {note}")
        lines.append("")
        lines.append(f"_({s.seconds:.0f} s)_")
    return "\n".join(lines) + "\n"


def write_results(path_json: str, path_md: str, report: dict[str, Any], sections: list[Section]) -> None:
    payload = dict(report)
    payload["benchmarks"] = {s.key: s.to_json() for s in sections}
    with open(path_json, "w") as f:
        json.dump(payload, f, indent=1, allow_nan=False)
        f.write("\n")
    with open(path_md, "w") as f:
        f.write(render_markdown(report, sections))


def finite_numbers(section: Section) -> list[float]:
    """Every finite measured number of a section (what the quick test checks exists)."""
    out = []
    for row in section.rows:
        for v in row.values():
            if isinstance(v, Stat):
                out += [x for x in (v.min, v.median, v.max) if math.isfinite(x)]
    return out
