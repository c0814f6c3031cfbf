"""Federated evaluation in the CLI: each site's scores (`jobs show`), the latest scored round's scores per class
or finding (AUROC and AP with their binning bounds, sensitivity, specificity, F1, Dice, IoU: `score_table`), the
best round (`jobs download --best`), and the warnings `submit` prints."""

from __future__ import annotations

import math
from typing import Any

from fedbroker.app.replies import evaluation_status, round_status
from fedbroker.app.status import DASH, evaluated_jobs, table
from fedbroker.errors import NotFound
from fedbroker.federated_evaluation import Scored, best_round
from fedbroker.job.status import EvaluationStatus, RoundStatus
from fedbroker.tasks.scores import DIRECTIONS

# Per-class scores as `jobs show` lists them: (score name in the sums' scores, column head).
PER_CLASS = (("auroc", "auroc"), ("auroc_bound", "±auroc"), ("ap", "ap"), ("ap_bound", "±ap"), ("sens", "sens"),
             ("spec", "spec"), ("f1", "f1"), ("dice", "dice"), ("iou", "iou"))
HEADLINES = ("accuracy", "macro_f1", "auroc", "ap", "sensitivity", "specificity", "dice", "iou", "mae", "rmse", "loss")


def site_table(status: Any) -> str:
    """One row per site asked to score a round: its status, its score and count, or its reason."""
    return table(["round", "version", "site", "status", "accuracy", "loss", "samples", "reason"],
                 [[e.round, e.model_version, e.worker_id, e.status,
                   *([f"{e.accuracy:.4f}", f"{e.loss:.4f}", e.num_samples] if evaluation_status(e) is EvaluationStatus.EVALUATED else
                     [DASH, DASH, DASH]), e.reason[:80]]
                  for e in status.evaluations])


def best(status: Any, job_id: str) -> tuple[int, float, str]:
    """(round, accuracy, "federated" | "central") of the job's best closed round: by the sites' federated
    accuracy when any round has one, else by the coordinator's evaluation set; NotFound when neither scored it."""
    central = job_id in evaluated_jobs(status)
    rounds = [Scored(round=r.round, federated=r.federated_accuracy if r.federated_samples else None,
                     central=r.accuracy if central else None)
              for r in status.rounds if r.job_id == job_id and round_status(r) is RoundStatus.CLOSED]
    lower = any(not DIRECTIONS.get(r.federated_metric, True) for r in status.rounds if r.job_id == job_id)
    found = best_round(rounds, higher_is_better=not lower)  # an error or the loss: lower is better
    if found is None:
        raise NotFound(f"job {job_id!r} has no scored round to call best (no site evaluated a round and the job names "
                       f"no evaluation.dataset); give --round instead")
    return found



def score_table(status: Any, job_id: str) -> str:
    """The latest round the sites scored: its headline scores on one line each, then one row per class or finding
    with the per-class scores the task has ("" when no round has federated scores)."""
    scored = [r for r in status.rounds if r.job_id == job_id and r.federated_samples and r.federated_scores]
    if not scored:
        return ""
    row = max(scored, key=lambda r: r.round)
    values = dict(row.federated_scores)
    heads = [f"{name} {values[name]:.4f}" + (f" (±{values[name + '_bound']:.4f} binning)" if name + "_bound" in values
                                              else "") for name in HEADLINES if name in values]
    columns = [(key, head) for key, head in PER_CLASS if any(k.startswith(key + "/") for k in values)]
    classes = sorted({int(k.split("/")[1]) for k in values if "/" in k and k.split("/")[1].isdigit()})
    lines = [f"round {row.round}, {row.federated_samples} held-out samples of {row.evaluated_sites} site(s); "
             f"headline {row.federated_metric or 'accuracy'}: " + ", ".join(heads)]
    if columns and classes:
        lines.append(table(["class", *[head for _, head in columns]],
                           [[c, *[_cell(values.get(f"{key}/{c}")) for key, _ in columns]] for c in classes]))
    return "\n".join(lines)


def _cell(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"
