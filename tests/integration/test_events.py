"""The event-driven control plane: the aggregation service tells the coordinator the moment a round's
quorum is in, and a lost event never stalls a round (the safety poll and the deadline catch it)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.job.spec import parse_job
from fedbroker.rpc.aggregation_client import AggregatorClient
from tests.aggregators.test_rounds import SPEC, stream, weights
from tests.integration.conftest import Federation

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

JOB = {
    "name": "events", "category": "digits", "seed": 3,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 10}]},
    "training": {"rounds": 3, "local_epochs": 1, "batch_size": 64, "lr": 0.1},
    "schedule": {"min_workers": 2, "wait_for_workers_s": 30, "round_timeout_s": 1200},  # far beyond the test's timeout
}


def coordinator_with(fed: Federation, **options: object) -> Coordinator:
    """The federation's coordinator replaced by one with other options (same bus, store and service)."""
    fed.coordinator.stop()
    fed.coordinator = Coordinator(bus=fed.bus, store=fed.store, aggregator=AggregatorClient(fed.target),
                                  aggregator_target=fed.target, checkpoint_dir=str(fed.tmp / "checkpoints"),
                                  poll_interval_s=0.1, **options)
    fed.coordinator.start()
    return fed.coordinator


def run(fed: Federation, job: dict) -> str:
    job_id = fed.coordinator.submit(parse_job(job))
    assert fed.coordinator.wait(job_id, timeout=170) == "completed", fed.store.job(job_id).error
    return job_id


def test_rounds_close_on_the_services_events_not_on_a_poll(tmp_path):
    fed = Federation("", tmp_path)
    try:
        # a safety poll and deadlines far beyond the test's timeout: only the events can close these rounds
        coordinator_with(fed, safety_poll_s=3600.0)
        for i in range(2):
            fed.add_worker(f"w{i}", index=i, count=2)
        job_id = run(fed, JOB)
        assert [r.aggregated for r in fed.store.rounds(job_id)] == [2, 2, 2]
    finally:
        fed.close()


def test_a_lost_event_never_stalls_a_round(tmp_path, monkeypatch):
    fed = Federation("", tmp_path)
    try:
        coordinator = coordinator_with(fed, safety_poll_s=0.2)
        monkeypatch.setattr(coordinator.events, "wait", lambda job_id, timeout: False)  # every event lost
        for i in range(2):
            fed.add_worker(f"w{i}", index=i, count=2)
        job = copy.deepcopy(JOB)
        job["training"]["rounds"] = 2
        job_id = run(fed, job)
        assert [r.aggregated for r in fed.store.rounds(job_id)] == [2, 2]
    finally:
        fed.close()


def test_watch_reports_every_job_first_then_each_change():
    book = RoundBook(max_update_bytes=10_000)
    book.put_global("j", 1, SPEC.to_json(), weights(0.0))
    book.open_round("j", 1, ["w1", "w2"], deadline=5e9, aggregation={}, seed=0)
    generation, first = book.watch(0, timeout=0.0)
    assert [(s.job_id, s.round, s.accepted, s.open) for s in first] == [("j", 1, 0, True)]
    assert book.watch(generation, timeout=0.01) == (generation, [])  # nothing new: a keepalive
    book.receive_update(stream(weights(1.0), worker="w1"))
    generation, changed = book.watch(generation, timeout=0.0)
    assert [(s.accepted, s.open) for s in changed] == [(1, True)]
    book.close("j", 1)
    _, changed = book.watch(generation, timeout=0.0)
    assert [(s.open, s.version) for s in changed] == [(False, 2)]
    assert np.isfinite(book.global_model("j")[2]["0.weight"]).all()
