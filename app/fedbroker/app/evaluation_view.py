"""Federated evaluation in the CLI: each site's scores (`jobs show`), the best round (`jobs download --best`),
and the warnings `submit` prints."""

from __future__ import annotations

from typing import Any

from fedbroker.app.replies import evaluation_status, round_status
from fedbroker.app.status import DASH, evaluated_jobs, table
from fedbroker.errors import NotFound
from fedbroker.federated_evaluation import Scored, best_round
from fedbroker.job.status import EvaluationStatus, RoundStatus


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
    lower = any(r.federated_metric == "mae" for r in status.rounds if r.job_id == job_id)  # an error: lower is better
    found = best_round(rounds, higher_is_better=not lower)
    if found is None:
        raise NotFound(f"job {job_id!r} has no scored round to call best (no site evaluated a round and the job names "
                       f"no evaluation.dataset); give --round instead")
    return found

