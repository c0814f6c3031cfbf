"""A job's settings installed once, over the real RabbitMQ and real gRPC: parsed and checked once per process per
job across a 5-round job; an old-style task (its settings as JSON) still runs on the new worker; a worker that
lacks the settings a task names fetches them from the aggregation service."""

from __future__ import annotations

import collections
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from fedbroker.aggregators.installed_jobs import InstalledJobs
from fedbroker.aggregators.round_book import RoundBook
from fedbroker.algorithms.catalogue import Catalogue
from fedbroker.bus import envelope
from fedbroker.job.settings import sections_settings, settings_digest
from fedbroker.job.spec import TrainingConfig, parse_job
from fedbroker.model import initial_weights
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.proto import fedbroker_pb2_grpc as pb_grpc
from fedbroker.worker.agent import WorkerAgent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOB = {
    "name": "once", "category": "digits", "seed": 1,
    "model": {"input_shape": [1, 8, 8], "layers": [
        {"type": "Flatten"}, {"type": "Linear", "in_features": 64, "out_features": 10}]},
    "training": {"rounds": 5, "local_epochs": 1, "batch_size": 32, "lr": 0.2},
    "aggregation": {"robust": "trimmed_mean", "robust_params": {"beta": 0.2}},
    "schedule": {"min_workers": 3, "wait_for_workers_s": 30, "round_timeout_s": 600},
}


def _owner() -> str | None:
    """Which process part a parse runs in: a worker (by its id), the aggregation service or the coordinator."""
    frame = sys._getframe(2)
    while frame is not None:
        me = frame.f_locals.get("self")
        if isinstance(me, WorkerAgent):
            return f"worker:{me.config.id}"
        if isinstance(me, (RoundBook, InstalledJobs)):
            return "aggregator"
        if frame.f_globals.get("__name__", "").startswith("fedbroker.coordinator."):
            return "coordinator"
        frame = frame.f_back
    return None  # the test's own parse of the job it submits (a client's)


def _counting(monkeypatch: pytest.MonkeyPatch, cls: type, name: str, counts: collections.Counter[str]) -> None:
    real: Callable[..., Any] = getattr(cls, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        owner = _owner()
        if owner is not None:
            counts[owner] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(cls, name, counted)


def test_a_jobs_settings_are_parsed_once_per_process_across_five_rounds(federation, monkeypatch) -> None:
    for i in range(3):
        federation.add_worker(f"w{i}", index=i, count=3)
    algorithms: collections.Counter[str] = collections.Counter()  # the typed parse of the aggregation section
    trainings: collections.Counter[str] = collections.Counter()   # the training section's check
    _counting(monkeypatch, Catalogue, "choose", algorithms)          # once per kind: 4 per parse
    _counting(monkeypatch, TrainingConfig, "__post_init__", trainings)
    job_id = federation.coordinator.submit(parse_job(JOB))
    status = federation.coordinator.wait(job_id, timeout=280)
    assert status == "completed", federation.store.job(job_id).error
    assert len(federation.store.rounds(job_id)) == 5
    parts = ["coordinator", "aggregator", "worker:w0", "worker:w1", "worker:w2"]
    assert {p: algorithms[p] for p in parts} == {p: 4 for p in parts}, algorithms  # one parse each
    assert {p: trainings[p] for p in parts[1:]} == {p: 1 for p in parts[1:]}, trainings  # the whole settings, once
    assert trainings["coordinator"] == 0, trainings  # it runs the job as submitted (parsed there, by the client)
    assert federation.book.table.jobs[job_id].round is None or federation.book.table.jobs[job_id].round.closed
    assert federation.book.installed.get(job_id).settings.robust.params.beta == 0.2


def _wait_accepted(book: RoundBook, job_id: str, worker_id: str) -> None:
    deadline = time.time() + 120
    while time.time() < deadline:
        if worker_id in book.status(job_id, 1)[0]:
            return
        time.sleep(0.1)
    raise AssertionError(f"{worker_id}'s update for {job_id} was not accepted")


def test_an_old_style_task_runs_against_the_new_worker_and_a_missing_settings_digest_is_fetched(federation) -> None:
    agent = federation.add_worker("w0", index=0, count=1)
    job = parse_job(JOB)
    weights = initial_weights(job.model, seed=0)
    stub = pb_grpc.AggregationStub(grpc.insecure_channel(federation.target))
    client = federation.coordinator.aggregator
    # An older coordinator: no InstallJob; the aggregation section rides in OpenRound and the task, as JSON.
    client.put_global("old", 1, job.model.to_json(), weights)
    stub.OpenRound(pb.OpenRoundRequest(job_id="old", round=1, participants=["w0"], deadline_unix=time.time() + 300,
                                       aggregation_json=json.dumps({"robust": "none"}), seed=1), timeout=10)
    old = pb.RoundTask(job_id="old", round=1, category="digits", model_version=1, aggregator_target=federation.target,
                       deadline_unix=time.time() + 300, participants=1, seed=1,
                       training_json=json.dumps({"rounds": 1, "lr": 0.2}), aggregation_json=json.dumps({}))
    federation.bus.publish_tasks([("w0", envelope.encode(round_task=old))])
    _wait_accepted(federation.book, "old", "w0")
    assert agent.job_settings.held("old").training.lr == 0.2
    # A new coordinator whose task names only the settings' digest: this worker never had them (a restart).
    settings = sections_settings("new", training={"rounds": 1}, aggregation={"robust": "none"})
    client.install_job(settings)
    client.put_global("new", 1, job.model.to_json(), weights)
    client.open_round("new", 1, ["w0"], time.time() + 300, seed=1)
    new = pb.RoundTask(job_id="new", round=1, category="digits", model_version=1, aggregator_target=federation.target,
                       deadline_unix=time.time() + 300, participants=1, seed=1,
                       settings_digest=settings_digest(settings))
    federation.bus.publish_tasks([("w0", envelope.encode(round_task=new))])
    _wait_accepted(federation.book, "new", "w0")
    assert agent.job_settings.held("new").digest == settings_digest(settings)
