"""NAFI − PFNM in the paper-scale alignment table, set against seed noise.

Per run (cell × seed) the difference d = NAFI (λ chosen on validation) − PFNM, test accuracy in points. Two
paired tests of "NAFI and PFNM score the same": the Wilcoxon signed-rank test over every (cell, seed) pair
(two-sided; zero differences dropped, Wilcoxon's rule), and a t-test over the cells' mean differences (one
value per cell, so the seeds of a cell are not counted as independent evidence). Runs of one seed share their
train/test split across cells, so neither test is exact; both are reported with that caveat. The seed noise
is the pooled within-cell standard deviation of d (and of PFNM's accuracy) over the seeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np


def _nafi_by_validation(row: Mapping[str, Any]) -> str:
    nafi = [m for m in row["methods"] if m.startswith("NAFI")]
    return max(nafi, key=lambda m: (row["methods"][m]["val"], -nafi.index(m)))


def nafi_minus_pfnm(result: Mapping[str, Any]) -> dict[str, Any]:
    """The differences per run and per cell, their spread over seeds, and the two paired tests."""
    from scipy import stats

    cells: dict[tuple[int, int], list[float]] = {}
    pfnm: dict[tuple[int, int], list[float]] = {}
    for row in result["runs"]:
        key = (int(row["depth"]), int(row["S"]))
        nafi = row["methods"][_nafi_by_validation(row)]["test"]
        cells.setdefault(key, []).append(100 * (nafi - row["methods"]["PFNM"]["test"]))
        pfnm.setdefault(key, []).append(100 * row["methods"]["PFNM"]["test"])
    diffs = np.array([d for values in cells.values() for d in values])
    means = np.array([np.mean(v) for v in cells.values()])
    multi = [v for v in cells.values() if len(v) > 1]
    out: dict[str, Any] = {
        "runs": len(diffs), "cells": len(cells),
        "mean": float(diffs.mean()), "sd": float(diffs.std(ddof=1)) if len(diffs) > 1 else 0.0,
        "wins": int((diffs > 0).sum()), "losses": int((diffs < 0).sum()), "ties": int((diffs == 0).sum()),
        "per_cell": {f"{d}x{s}": {"mean": float(np.mean(v)), "sd": float(np.std(v, ddof=1)) if len(v) > 1 else 0.0}
                     for (d, s), v in cells.items()},
        "seed_sd_of_difference": float(np.sqrt(np.mean([np.var(v, ddof=1) for v in multi]))) if multi else None,
        "seed_sd_of_pfnm": float(np.sqrt(np.mean([np.var(v, ddof=1) for v in pfnm.values() if len(v) > 1])))
        if multi else None,
    }
    if np.any(diffs != 0):
        out["wilcoxon_p"] = float(stats.wilcoxon(diffs).pvalue)
    if len(means) > 1:
        t = stats.ttest_1samp(means, 0.0)
        half = float(stats.t.ppf(0.975, len(means) - 1) * means.std(ddof=1) / np.sqrt(len(means)))
        out |= {"cell_t_p": float(t.pvalue), "cell_mean_ci95": [float(means.mean() - half), float(means.mean() + half)]}
    return out


def summary(result: Mapping[str, Any]) -> str:
    """The paragraph under the table."""
    s = nafi_minus_pfnm(result)
    text = (f"**NAFI − PFNM (λ by validation)** over {s['runs']} runs ({s['cells']} cells × seeds): "
            f"{s['mean']:+.2f} ± {s['sd']:.2f} points (mean ± sample SD; the table's ± is the SD over seeds with ddof 0); NAFI ahead in {s['wins']}, behind in "
            f"{s['losses']}, level in {s['ties']}.")
    if s["seed_sd_of_difference"] is not None:
        text += (f" Seed noise: the SD of the difference between seeds of one cell is {s['seed_sd_of_difference']:.2f} "
                 f"points (of PFNM's accuracy itself {s['seed_sd_of_pfnm']:.2f}).")
    if "wilcoxon_p" in s:
        text += f" Paired Wilcoxon signed-rank over the runs: p = {s['wilcoxon_p']:.3f}."
    if "cell_t_p" in s:
        lo, hi = s["cell_mean_ci95"]
        text += (f" t-test over the {s['cells']} cell means: p = {s['cell_t_p']:.3f}, 95 % CI of the mean "
                 f"difference [{lo:+.2f}, {hi:+.2f}].")
    return text + (" Runs of one seed share their data split across cells, so the tests are approximate.")
