"""A site's side of federated evaluation, task by task: it scores only the version the task names on its own
held-out split and reports; it refuses with the reason (its policy, a model it cannot fetch or use), skips a task
past its deadline, dead-letters one it cannot read or that another broker user than the coordinator published."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedbroker.bus import Delivery, InProcessBus, envelope
from fedbroker.config import DPPolicy, PartitionSection, WorkerConfig
from fedbroker.datasets import load_dataset, train_test_split
from fedbroker.errors import Rejection
from fedbroker.evaluation import evaluate
from fedbroker.job.spec import parse_model
from fedbroker.model import build_model, initial_weights, load_numpy_state
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.plumbing import RemoteError
from fedbroker.worker.agent import WorkerAgent
from fedbroker.worker.evaluation import SiteEvaluation
from fedbroker.worker.ledger import PrivacyLedger

MODEL = parse_model({"input_shape": [1, 8, 8], "layers": [{"type": "Flatten"},
                                                          {"type": "Linear", "in_features": 64, "out_features": 10}]})
WEIGHTS = initial_weights(MODEL, seed=1)


class Service:
    """The aggregation service as the site sees it: the versions it keeps (and what it answers for one)."""

    def __init__(self, versions: dict[int, tuple[int, str, dict[str, np.ndarray]]]) -> None:
        self.versions = versions
        self.asked: list[tuple[str, int]] = []

    def until(self, deadline: float | None) -> Service:
        return self

    def download(self, job_id: str, version: int = 0) -> tuple[int, str, dict[str, np.ndarray]]:
        self.asked.append((job_id, version))
        if version not in self.versions:
            raise RemoteError(Rejection.UNKNOWN_JOB, f"job {job_id!r} has no global model version {version}")
        return self.versions[version]


class Sent:
    def __init__(self) -> None:
        self.reports: list[pb.EvaluationReport] = []

    def publish_control(self, body: bytes) -> None:
        self.reports.append(envelope.decode(body, expect=("evaluation_report",)).evaluation_report)


def delivery(task: pb.EvaluationTask, settled: list[str], *, sender: str | None = None) -> Delivery:
    return Delivery(body=envelope.encode(evaluation_task=task), routing_key="w0", redelivered=False, attempts=1,
                    message_id=None, settle=settled.append, sender=sender)


def task(**changes: Any) -> pb.EvaluationTask:
    values = {"job_id": "j-1", "round": 2, "model_version": 3, "aggregator_target": "127.0.0.1:1",
              "category": "digits", "deadline_unix": time.time() + 600, **changes}
    return pb.EvaluationTask(**values)


def site(tmp_path: Path, service: Service, **settings: Any) -> tuple[SiteEvaluation, Sent, PrivacyLedger]:
    config = WorkerConfig(id="w0", partition=PartitionSection(num_clients=2, client_index=1), device="cpu",
                          ledger_path=str(tmp_path / "ledger.json"), **settings)
    test = train_test_split(load_dataset("digits"), test_fraction=0.2, seed=0)[1]
    sent, ledger = Sent(), PrivacyLedger(config.ledger_path, worker_id="w0")
    return SiteEvaluation(config, bus=sent, ledger=ledger, test=test, device="cpu",  # type: ignore[arg-type]
                          aggregator=lambda target: service, stopping=lambda: False), sent, ledger  # type: ignore[arg-type,return-value]


def test_it_scores_the_named_version_on_its_slice_and_reports_at_no_epsilon(tmp_path: Path) -> None:
    service = Service({3: (3, MODEL.to_json(), WEIGHTS), 4: (4, MODEL.to_json(), initial_weights(MODEL, seed=9))})
    evaluation, sent, ledger = site(tmp_path, service)
    settled: list[str] = []
    evaluation.handle(delivery(task(), settled), task())
    assert settled == ["ack"] and service.asked == [("j-1", 3)]
    (report,) = sent.reports
    model = build_model(MODEL)
    load_numpy_state(model, WEIGHTS)
    assert (report.accuracy, report.loss) == pytest.approx(evaluate(model, evaluation.x, evaluation.y))
    assert (report.job_id, report.round, report.model_version, report.worker_id, report.refused) == (
        "j-1", 2, 3, "w0", False)
    assert report.num_samples == len(evaluation.y) == 179  # its half of the 359 held-out samples (180 + 179)
    assert [(s.job_id, s.what, s.epsilon) for s in ledger.shared()] == [("j-1", "evaluation", 0.0)]
    assert ledger.total_epsilon() == 0.0


@pytest.mark.parametrize("settings, versions, named, reason", [
    ({"evaluation": "deny"}, {3: (3, MODEL.to_json(), WEIGHTS)}, 3, "worker.evaluation: deny"),
    ({}, {}, 3, "could not be fetched"),
    ({}, {3: (4, MODEL.to_json(), WEIGHTS)}, 3, "the service sent 4"),
    ({}, {3: (3, parse_model({"input_shape": [64], "layers": [{"type": "Linear", "in_features": 64,
                                                                 "out_features": 10}]}).to_json(),
              {"0.weight": np.zeros((10, 64), np.float32), "0.bias": np.zeros(10, np.float32)})}, 3,
     "does not fit this site's data"),
    ({"categories": ("wine",)}, {3: (3, MODEL.to_json(), WEIGHTS)}, 3, "is not one this worker serves"),
])
def test_it_refuses_with_the_reason_and_shares_no_score(tmp_path: Path, settings: dict[str, Any],
                                                        versions: dict[int, Any], named: int, reason: str) -> None:
    evaluation, sent, ledger = site(tmp_path, Service(versions), **settings)
    settled: list[str] = []
    evaluation.handle(delivery(task(model_version=named), settled), task(model_version=named))
    assert settled == ["ack"]
    (report,) = sent.reports
    assert report.refused and reason in report.reason and report.num_samples == 0 and report.accuracy == 0.0
    assert ledger.shared() == []


def test_a_task_past_its_deadline_is_acked_unreported_and_one_it_cannot_read_is_dead_lettered(tmp_path: Path) -> None:
    service = Service({3: (3, MODEL.to_json(), WEIGHTS)})
    evaluation, sent, _ = site(tmp_path, service)
    late, settled = task(deadline_unix=time.time() - 1), []
    evaluation.handle(delivery(late, settled), late)
    assert settled == ["ack"] and not sent.reports and not service.asked
    for bad in (task(model_version=0), task(round=0), task(job_id=""), task(aggregator_target="")):
        settled = []
        evaluation.handle(delivery(bad, settled), bad)
        assert settled == ["dead"] and not sent.reports and not service.asked


def test_the_agent_dead_letters_an_evaluation_task_from_another_broker_user(tmp_path: Path) -> None:
    bus = InProcessBus(namespace=f"site-{tmp_path.name}"[:60])
    agent = WorkerAgent(WorkerConfig(id="w0", dp=DPPolicy(enabled=False), device="cpu", coordinator_broker_user="coord",
                                     ledger_path=str(tmp_path / "ledger.json")), bus)
    calls: list[Any] = []
    agent.evaluation.handle = lambda d, t: calls.append(t)  # type: ignore[method-assign]
    settled: list[str] = []
    agent.on_task(delivery(task(), settled, sender="site-b"))
    assert settled == ["dead"] and calls == []
    agent.on_task(delivery(task(), settled, sender="coord"))
    assert len(calls) == 1  # from the coordinator's user it reaches the site's evaluation
    bus.close()


def test_a_site_that_never_trained_the_job_prepares_its_samples_by_the_pipeline_the_task_carries(
        tmp_path: Path) -> None:
    """Federated evaluation may ask sites that hold no settings of the job (evaluation.sites: category): they must
    score the model on samples prepared as the sites that trained it prepared theirs, not on raw samples."""
    from fedbroker.job.pipeline import parse_pipeline

    pipeline = parse_pipeline({"preprocess": [{"normalize": {"mean": [0.25], "std": [0.5]}}]})
    service = Service({3: (3, MODEL.to_json(), WEIGHTS)})
    evaluation, sent, _ = site(tmp_path, service)
    carried = task(pipeline_json=pipeline.to_json())
    evaluation.handle(delivery(carried, []), carried)
    (report,) = sent.reports
    model = build_model(MODEL)
    load_numpy_state(model, WEIGHTS)
    prepared = (evaluation.x - np.float32(0.25)) / np.float32(0.5)
    assert not report.refused
    assert (report.accuracy, report.loss) == pytest.approx(evaluate(model, prepared, evaluation.y), rel=1e-5)
    assert (report.accuracy, report.loss) != pytest.approx(evaluate(model, evaluation.x, evaluation.y), rel=1e-5)


@pytest.mark.parametrize("pipeline_json, reason", [
    ("{not json", "data pipeline is not valid"),
    ('{"preprocess": [{"exec": "rm -rf /"}]}', "data pipeline is not valid"),
    ('{"preprocess": [{"resize": [60000, 60000]}]}', "data pipeline is not valid"),
])
def test_a_task_carrying_a_hostile_pipeline_is_refused_before_the_model_is_scored(
        tmp_path: Path, pipeline_json: str, reason: str) -> None:
    service = Service({3: (3, MODEL.to_json(), WEIGHTS)})
    evaluation, sent, ledger = site(tmp_path, service)
    hostile = task(pipeline_json=pipeline_json)
    evaluation.handle(delivery(hostile, []), hostile)
    (report,) = sent.reports
    assert report.refused and reason in report.reason and report.num_samples == 0
    assert ledger.shared() == []
