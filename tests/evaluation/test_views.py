"""How the CLI shows federated evaluation: a `site acc` column beside the central one (a dash where no site
scored), each site's row, and which round `jobs download --best` picks."""

from __future__ import annotations

import json

import pytest

from fedbroker.app.evaluation_view import best, site_table
from fedbroker.app.status import render
from fedbroker.errors import NotFound
from fedbroker.proto import fedbroker_pb2 as pb


def status(*, central: bool) -> pb.StatusReply:
    spec = json.dumps({"evaluation": {"dataset": "digits" if central else ""}})
    return pb.StatusReply(
        jobs=[pb.JobRow(job_id="a", status="running", spec_json=spec)],
        rounds=[pb.RoundRow(job_id="a", round=1, status="closed", accuracy=0.9, loss=0.3, mean_train_loss=0.5,
                            federated_accuracy=0.6, federated_loss=0.8, federated_samples=50, evaluated_sites=2),
                pb.RoundRow(job_id="a", round=2, status="closed", accuracy=0.7, loss=0.4, mean_train_loss=0.4,
                            federated_accuracy=0.75, federated_loss=0.6, federated_samples=50, evaluated_sites=2),
                pb.RoundRow(job_id="a", round=3, status="closed", accuracy=0.95, loss=0.2, mean_train_loss=0.3),
                pb.RoundRow(job_id="a", round=4, status="open")],
        evaluations=[pb.EvaluationRow(job_id="a", round=2, worker_id="w0", status="evaluated", accuracy=0.8, loss=0.5,
                                      num_samples=20, model_version=3),
                     pb.EvaluationRow(job_id="a", round=2, worker_id="w1", status="refused",
                                      reason="the site's policy refuses evaluation", model_version=3)])


def test_rounds_show_the_sites_score_beside_the_central_one_and_a_dash_where_none_scored() -> None:
    text = render(status(central=True))
    head = text.split("ROUNDS")[1].splitlines()[1].split()
    assert head[5:12] == ["accuracy", "loss", "train", "loss", "site", "acc", "sites"]
    rows = {line.split()[1]: line.split() for line in text.split("ROUNDS")[1].split("WORKERS")[0].splitlines()[3:]
            if line.strip()}
    assert rows["1"][5:10] == ["0.9000", "0.3000", "0.5000", "0.6000", "2"]
    assert rows["3"][8:10] == ["-", "-"] and rows["4"][8:10] == ["-", "-"]
    sites = site_table(status(central=True)).splitlines()
    assert sites[2].split()[:7] == ["2", "3", "w0", "evaluated", "0.8000", "0.5000", "20"]
    assert sites[3].split()[:7] == ["2", "3", "w1", "refused", "-", "-", "-"] and "policy" in sites[3]


def test_the_best_round_is_by_the_sites_score_else_the_central_one() -> None:
    assert best(status(central=True), "a") == (2, 0.75, "federated")
    reply = status(central=True)
    for r in reply.rounds:
        r.federated_samples = 0
    assert best(reply, "a") == (3, 0.95, "central")
    reply = status(central=False)
    for r in reply.rounds:
        r.federated_samples = 0
    with pytest.raises(NotFound, match="no scored round"):
        best(reply, "a")
