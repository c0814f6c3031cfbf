"""What the coordinator keeps of federated evaluation and what it accepts: a report is recorded only against the
task it answers, in time, once; a round settles when every site answered or its deadline passed; the control
queue's checks refuse scores that are not scores. The store's tests run on SQLite and on PostgreSQL."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest

from fedbroker.coordinator.control import InvalidControlMessage, check_control
from fedbroker.coordinator.store import StateStore
from fedbroker.coordinator.store_evaluation import EvaluationVerdict
from fedbroker.job.status import EvaluationStatus
from fedbroker.proto import fedbroker_pb2 as pb
from tests.coordinator.conftest import any_store, store_url  # noqa: F401  (the store on each engine)


@pytest.fixture
def store(any_store: StateStore) -> Iterator[StateStore]:  # noqa: F811
    yield any_store


def record(store: StateStore, worker: str, *, round_number: int = 1, version: int = 2, accuracy: float = 0.5,
           loss: float = 1.0, n: int = 10, refused: bool = False, reason: str = "", job: str = "j-1") -> EvaluationVerdict:
    return store.record_evaluation(job, round_number, worker, model_version=version, refused=refused, reason=reason,
                                   accuracy=accuracy, loss=loss, num_samples=n)


def test_reports_are_kept_only_against_their_task_once_and_the_last_one_settles_the_round(store: StateStore) -> None:
    store.ask_evaluation("j-1", 1, model_version=2, workers=["a", "b", "c"], deadline=time.time() + 600)
    assert record(store, "z") == EvaluationVerdict.NOT_ASKED                       # never sent the task
    assert record(store, "a", round_number=2) == EvaluationVerdict.NOT_ASKED      # another round
    assert record(store, "a", job="k-1") == EvaluationVerdict.NOT_ASKED           # another job
    assert record(store, "a", version=3) == EvaluationVerdict.WRONG_VERSION
    assert record(store, "a", accuracy=0.5, loss=1.0, n=10) == EvaluationVerdict.RECORDED
    assert record(store, "a", accuracy=0.5, loss=1.0, n=10) == EvaluationVerdict.DUPLICATE  # idempotent
    assert record(store, "a", accuracy=0.9, loss=1.0, n=10) == EvaluationVerdict.CONFLICT   # the first one stands
    (pending,) = store.evaluation_rounds("j-1")
    assert not pending.settled and pending.score is not None and pending.score.accuracy == 0.5
    assert record(store, "b", accuracy=1.0, loss=0.5, n=30) == EvaluationVerdict.RECORDED
    assert record(store, "c", refused=True, reason="policy") == EvaluationVerdict.RECORDED
    (done,) = store.evaluation_rounds("j-1")
    assert done.settled and (done.asked, done.answered) == (3, 3)
    assert done.score is not None and (done.score.num_samples, done.score.sites) == (40, 2)
    assert done.score.accuracy == pytest.approx((0.5 * 10 + 1.0 * 30) / 40)
    assert done.score.loss == pytest.approx((1.0 * 10 + 0.5 * 30) / 40)
    rows = {e.worker_id: e for e in store.evaluations("j-1")}
    assert rows["c"].status == EvaluationStatus.REFUSED and rows["c"].reason == "policy" and rows["c"].accuracy is None
    kinds = [(e.kind, e.worker_id) for e in store.events("j-1")]
    assert kinds == [("evaluation_asked", ""), ("evaluated", "a"), ("evaluated", "b"), ("evaluation_refused", "c"),
                     ("federated_score", "")]
    assert "0.8750" in store.events("j-1")[-1].message and "2 of 3 site(s)" in store.events("j-1")[-1].message


def test_a_round_past_its_deadline_settles_with_the_silent_sites_missed_and_refuses_late_reports(
        store: StateStore) -> None:
    store.ask_evaluation("j-1", 1, model_version=2, workers=["a", "b"], deadline=time.time() + 600)
    assert record(store, "a") == EvaluationVerdict.RECORDED
    store.ask_evaluation("j-1", 2, model_version=3, workers=["a", "b"], deadline=time.time() - 1)
    assert [e.status for e in store.evaluations("j-1") if e.round == 2] == ["missed", "missed"]  # as read
    assert record(store, "a", round_number=2, version=3) == EvaluationVerdict.LATE
    assert store.settle_evaluations("j-1") == [2]  # round 1 still has time
    assert store.settle_evaluations("j-1") == []
    (one, two) = store.evaluation_rounds("j-1")
    assert not one.settled and two.settled and two.score is None
    assert store.evaluation_rounds("j-1", 2) == [two] and [e.round for e in store.evaluations("j-1", 1)] == [1, 1]
    assert record(store, "b", round_number=2, version=3) == EvaluationVerdict.LATE
    assert store.events("j-1")[-1].message == "no score: none of 2 site(s) evaluated"
    store.evaluation_undelivered("j-1", 1, ["b"])  # its task never went out: nothing will come
    assert {e.worker_id: e.status for e in store.evaluations("j-1") if e.round == 1} == {"a": "evaluated", "b": "missed"}


def test_asking_a_round_again_keeps_what_was_reported(store: StateStore) -> None:
    store.ask_evaluation("j-1", 1, model_version=2, workers=["a"], deadline=time.time() + 600)
    assert record(store, "a") == EvaluationVerdict.RECORDED
    store.ask_evaluation("j-1", 1, model_version=2, workers=["a"], deadline=time.time() + 900)
    assert [e.status for e in store.evaluations("j-1")] == ["evaluated"]


def good(**changes: object) -> pb.Envelope:
    values = {"job_id": "j-1", "round": 1, "model_version": 2, "worker_id": "w0", "accuracy": 0.5, "loss": 0.7,
              "num_samples": 10, **changes}
    return pb.Envelope(evaluation_report=pb.EvaluationReport(**values))


@pytest.mark.parametrize("changes, problem", [
    ({"accuracy": math.nan}, "accuracy"), ({"accuracy": 1.5}, "accuracy"), ({"accuracy": -0.1}, "accuracy"),
    ({"loss": math.inf}, "loss"), ({"loss": -1.0}, "loss"), ({"loss": math.nan}, "loss"),
    ({"num_samples": 0}, "num_samples"), ({"num_samples": 10**12}, "num_samples"),
    ({"round": 0}, "round"), ({"model_version": 0}, "model_version"), ({"job_id": "../etc"}, "job_id"),
    ({"worker_id": "a b"}, "worker_id"),
])
def test_a_report_that_is_not_a_score_is_refused_naming_the_field(changes: dict[str, object], problem: str) -> None:
    with pytest.raises(InvalidControlMessage, match=problem) as info:
        check_control(good(**changes))
    assert info.value.reason == "invalid_evaluation_report"


def test_a_refusal_carries_no_score_to_check() -> None:
    check_control(good())
    check_control(good(refused=True, reason="deny", accuracy=0.0, loss=0.0, num_samples=0))
