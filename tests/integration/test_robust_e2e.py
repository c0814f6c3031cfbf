"""A robust rule end to end over the real RabbitMQ and gRPC on loopback: Multi-Krum (f = 1) averages n − f of
the round's updates, and the coordinator records which site it discarded on the round's participants and as a
`robust` event, from the verdicts the aggregation service's close returned (the face words it)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from fedbroker.app.round_notes import event_words
from fedbroker.job.spec import parse_job
from tests.integration.test_weighting_selection import JOB as GA_JOB

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WORKERS = 4
ROUNDS = 2
JOB: dict[str, Any] = {
    **copy.deepcopy(GA_JOB), "name": "krum",
    "training": {"rounds": ROUNDS, "local_epochs": 1, "batch_size": 32, "lr": 0.2},
    "aggregation": {"robust": "multi_krum", "robust_params": {"f": 1}},
}


def test_multi_krum_discards_one_update_a_round_and_the_coordinator_names_it(federation):
    for i in range(WORKERS):
        federation.add_worker(f"w{i}", index=i, count=WORKERS)
    job_id = federation.coordinator.submit(parse_job(copy.deepcopy(JOB)))
    status = federation.coordinator.wait(job_id, timeout=100)
    assert status == "completed", federation.store.job(job_id).error
    events = federation.store.events(job_id)
    for r in federation.store.rounds(job_id):
        stats = r.stats
        assert r.uploaded == WORKERS and r.aggregated == WORKERS - 1 == stats["aggregated"], stats
        assert stats["robust_discarded"] == 1.0 and stats["selected"] == WORKERS, stats
        participants = federation.store.participants(job_id, r.round)
        (dropped,) = [p for p in participants if p.status == "uploaded"]
        assert dropped.reason == "multi_krum discarded its update (0% of its share)"
        assert all(p.reason == "" for p in participants if p.status == "aggregated")
        (note,) = [event_words(e.kind, e.round, e.message) for e in events if e.kind == "robust" and e.round == r.round]
        assert note == f"multi_krum discarded {dropped.worker_id} (0% of its share)"
        assert not [e for e in events if e.kind == "selection" and e.round == r.round]  # `all` chose every update
