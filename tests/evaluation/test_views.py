"""How the CLI shows federated evaluation: a `site acc` column beside the central one (a dash where no site
scored), each site's row, and which round `jobs download --best` picks."""

from __future__ import annotations

import json

import pytest

from fedbroker.app.evaluation_view import best, score_table, site_table
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


def test_jobs_show_lists_the_latest_scored_rounds_scores_per_finding_with_their_bounds() -> None:
    reply = status(central=False)
    reply.rounds[1].federated_metric = "auroc"
    reply.rounds[1].federated_scores.update({
        "auroc": 0.8125, "auroc_bound": 0.0004, "ap": 0.7, "ap_bound": 0.001, "sensitivity": 0.6, "loss": 0.4,
        "auroc/0": 0.9, "auroc_bound/0": 0.0003, "ap/0": 0.8, "ap_bound/0": 0.0009, "sens/0": 0.7, "spec/0": 0.75,
        "f1/0": 0.65, "auroc/1": 0.725, "auroc_bound/1": 0.0005, "ap/1": 0.6, "ap_bound/1": 0.0011, "f1/1": 0.5})
    text = score_table(reply, "a")
    lines = text.splitlines()
    assert "headline auroc" in lines[0] and "auroc 0.8125 (±0.0004 binning)" in lines[0] and "loss 0.4000" in lines[0]
    assert lines[1].split() == ["class", "auroc", "±auroc", "ap", "±ap", "sens", "spec", "f1"]
    assert lines[3].split() == ["0", "0.9000", "0.0003", "0.8000", "0.0009", "0.7000", "0.7500", "0.6500"]
    assert lines[4].split() == ["1", "0.7250", "0.0005", "0.6000", "0.0011", "-", "-", "0.5000"]
    reply.rounds[0].federated_metric = reply.rounds[1].federated_metric = "rmse"   # an error: lower is better
    assert best(reply, "a")[0] == 1
    assert score_table(status(central=False), "a") == ""
