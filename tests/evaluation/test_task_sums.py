"""A site's evaluation sums, as the coordinator takes them: sums that contradict themselves (more hits than
predictions, counts that do not add up to the report's samples, names the task has no use for) are refused as
`implausible_sums` and change nothing; the round's score is made from the sums the honest sites sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from fedbroker.coordinator.service import status_reply
from tests.evaluation.harness import Federation, job, report, wait_for

pytestmark = pytest.mark.timeout(600)


def refused(reason: str) -> float:
    return REGISTRY.get_sample_value("fedbroker_coordinator_evaluation_reports_refused_total",
                                     {"reason": reason}) or 0.0


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[Federation]:
    federation = Federation(tmp_path)
    try:
        yield federation
    finally:
        federation.close()


def test_a_site_reporting_sums_that_contradict_themselves_is_refused_and_changes_nothing(fed: Federation) -> None:
    for i in range(3):
        fed.add_worker(i, 3)
    job_id = fed.run(job(training={"rounds": 1}))
    before = status_reply(fed.coordinator, job_id)
    (row,) = before.rounds
    w0 = next(e for e in fed.store.evaluations(job_id) if e.worker_id == "w0")
    assert w0.sums and w0.sums["n"] == w0.num_samples   # an honest site's sums: one count per sample
    assert row.federated_metric == "accuracy" and row.federated_scores["accuracy"] == pytest.approx(
        row.federated_accuracy)
    start = refused("implausible_sums")
    n = w0.num_samples
    forged = [
        {**w0.sums, "tp/0": w0.sums.get("pred/0", 0.0) + 1},     # more hits than predictions of class 0
        {**w0.sums, "n": float(n + 5)},                          # n is not the report's count
        {**w0.sums, "secret/0": 1.0},                            # a name no classification sum has
    ]
    for sums in forged:
        fed.publish_as("site-0", evaluation_report=report(job_id, 1, row.model_version, "w0", accuracy=1.0,
                                                          loss=0.0, num_samples=n, sums=sums))
    wait_for(lambda: refused("implausible_sums") == start + len(forged), "the forged sums to be refused")
    after = status_reply(fed.coordinator, job_id)
    assert (after.rounds[0].federated_accuracy, dict(after.rounds[0].federated_scores)) == (
        row.federated_accuracy, dict(row.federated_scores))
