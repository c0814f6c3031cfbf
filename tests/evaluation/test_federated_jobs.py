"""Federated evaluation in whole jobs, on the in-process bus with the real coordinator, aggregation service and
worker agents: every round's federated score is the count-weighted mean of the sites' rows (and, where the sites'
splits together are the coordinator's evaluation split, equals the central score), a site whose policy denies is
refused and left out, forged reports change nothing, patience ends a job early, an async job is scored every k
versions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from fedbroker.coordinator.checkpoints import load_checkpoint
from fedbroker.coordinator.service import status_reply
from fedbroker.datasets import load_dataset, train_test_split
from fedbroker.evaluation import evaluate
from fedbroker.job.spec import parse_job, parse_model
from fedbroker.model import build_model, load_numpy_state
from fedbroker.worker.partition import partition
from tests.evaluation.harness import Federation, job, report, wait_for, weighted

pytestmark = pytest.mark.timeout(600)


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[Federation]:
    federation = Federation(tmp_path)
    try:
        yield federation
    finally:
        federation.close()


def answered(fed: Federation, job_id: str) -> None:
    """Wait until every site asked to score has answered: the job's end waits only for the last evaluated
    round's sites that trained in it (federated.await_last), so on a loaded machine the others' reports (a
    category site's, an async version's makers' that did not make the last) may come after it."""
    wait_for(lambda: not [e for e in fed.store.evaluations(job_id) if e.status == "asked"], "every site's report")


def site_slice(index: int, count: int) -> tuple[object, object]:
    """Site `index`'s held-out samples, cut here as a worker's config says (split seed 0, fraction 0.2, iid seed 0)."""
    test = train_test_split(load_dataset("digits"), test_fraction=0.2, seed=0)[1]
    part = partition(test.y, scheme="iid", num_clients=count, seed=0)[index]
    return test.x[part], test.y[part]


def test_every_round_has_the_count_weighted_score_of_its_sites_which_is_the_central_score_on_the_same_split(
        fed: Federation) -> None:
    for i in range(3):
        fed.add_worker(i, 3)
    job_id = fed.run(job(evaluation={"dataset": "digits", "every": 1}))
    status = status_reply(fed.coordinator, job_id)
    central_split = len(train_test_split(load_dataset("digits"), test_fraction=0.2, seed=0)[1])
    assert [r.round for r in status.rounds] == [1, 2, 3]
    for r in status.rounds:
        rows = [e for e in status.evaluations if e.round == r.round]
        assert sorted(e.worker_id for e in rows) == ["w0", "w1", "w2"] and {e.status for e in rows} == {"evaluated"}
        assert {e.model_version for e in rows} == {r.model_version}
        accuracy, loss, samples = weighted(rows)
        assert r.evaluated_sites == 3 and r.federated_samples == samples == central_split
        assert r.federated_accuracy == pytest.approx(accuracy, abs=1e-12)
        assert r.federated_loss == pytest.approx(loss, rel=1e-12)
        # the three slices are the coordinator's split, scored by the same model: the same numbers
        assert r.federated_accuracy == pytest.approx(r.accuracy, abs=1e-9)
        assert r.federated_loss == pytest.approx(r.loss, rel=1e-5)
    # one site's score, recomputed here from its checkpoint and its slice: the version the task named, its data
    last = fed.store.last_checkpoint(job_id)
    tensors, spec_json = load_checkpoint(last.checkpoint)
    model = build_model(parse_model(json.loads(spec_json)))
    load_numpy_state(model, tensors)
    x, y = site_slice(1, 3)
    mine = next(e for e in status.evaluations if e.round == 3 and e.worker_id == "w1")
    assert (mine.accuracy, mine.loss) == pytest.approx(evaluate(model, x, y), rel=1e-6)
    assert mine.num_samples == len(y)
    # the job's history: a per-site `evaluated` event, one aggregate per round, before the job's completion
    kinds = [(e.kind, e.round) for e in fed.store.events(job_id)]
    assert [k for k in kinds if k[0] == "federated_score"] == [("federated_score", 1), ("federated_score", 2),
                                                             ("federated_score", 3)]
    assert sum(k[0] == "evaluated" for k in kinds) == 9 and kinds[-1] == ("completed", 0)
    assert metric("fedbroker_coordinator_federated_accuracy", job_id=job_id) == pytest.approx(
        status.rounds[-1].federated_accuracy)


def test_a_site_whose_policy_denies_refuses_with_the_reason_and_is_left_out_of_the_aggregate(
        fed: Federation) -> None:
    agents = [fed.add_worker(i, 3, evaluation="deny" if i == 2 else "allow") for i in range(3)]
    before = metric("fedbroker_coordinator_evaluation_reports_total", worker_id="w2", status="refused")
    job_id = fed.run(job(training={"rounds": 2}))  # no evaluation set: the sites' scores are the only ones
    status = status_reply(fed.coordinator, job_id)
    for r in status.rounds:
        rows = {e.worker_id: e for e in status.evaluations if e.round == r.round}
        assert rows["w2"].status == "refused" and "worker.evaluation: deny" in rows["w2"].reason
        assert rows["w2"].num_samples == 0
        scored = [rows["w0"], rows["w1"]]
        accuracy, loss, samples = weighted(scored)
        assert (r.evaluated_sites, r.federated_samples) == (2, samples)
        assert r.federated_accuracy == pytest.approx(accuracy, abs=1e-12)
        assert r.federated_loss == pytest.approx(loss, rel=1e-12)
        assert r.accuracy == 0.0  # no central score to mistake it for
    assert metric("fedbroker_coordinator_evaluation_reports_total", worker_id="w2", status="refused") == before + 2
    # a score costs no ε and is logged as shared; a refusal shares nothing
    assert [(s.job_id, s.epsilon) for s in agents[0].ledger.shared() if s.what == "evaluation"] == [(job_id, 0.0)] * 2
    assert not [s for s in agents[2].ledger.shared() if s.what == "evaluation"]
    assert agents[2].ledger.epsilon(job_id) == 0.0  # DP off: nothing was ever charged, evaluation included


def test_forged_late_and_conflicting_reports_are_refused_and_change_nothing(fed: Federation) -> None:
    for i in range(3):
        fed.add_worker(i, 3)
    job_id = fed.run(job(training={"rounds": 1}))
    status = status_reply(fed.coordinator, job_id)
    before = [(e.worker_id, e.status, e.accuracy, e.loss, e.num_samples) for e in status.evaluations]
    (round_row,) = status.rounds
    version = round_row.model_version
    w0 = next(e for e in status.evaluations if e.worker_id == "w0")
    counts = {reason: metric("fedbroker_coordinator_evaluation_reports_refused_total", reason=reason)
              for reason in ("not_asked", "wrong_version", "conflict", "implausible_count")}
    rejected = {reason: metric("fedbroker_coordinator_control_messages_rejected_total", reason=reason)
                for reason in ("foreign_sender", "invalid_evaluation_report")}
    perfect = {"accuracy": 1.0, "loss": 0.0, "num_samples": 20}  # within every site's held-out split
    fed.publish_as("site-0", evaluation_report=report(job_id, 1, version, "w1", **perfect))  # w0's user for w1
    fed.publish_as("site-0", evaluation_report=report(job_id, 2, version, "w0", **perfect))  # a round never asked
    fed.publish_as("site-0", evaluation_report=report("other-0000", 1, version, "w0", **perfect))  # another job
    fed.publish_as("site-0", evaluation_report=report(job_id, 1, version + 1, "w0", **perfect))  # another version
    fed.publish_as("site-0", evaluation_report=report(job_id, 1, version, "w0", accuracy=1.0, loss=0.0,
                                                      num_samples=w0.num_samples))  # a second, different report
    w0_sums = next(e.sums for e in fed.store.evaluations(job_id) if e.worker_id == "w0")
    fed.publish_as("site-0", evaluation_report=report(job_id, 1, version, "w0", accuracy=w0.accuracy, loss=w0.loss,
                                                      num_samples=w0.num_samples, sums=w0_sums))  # an exact copy: idempotent
    fed.publish_as("site-0", evaluation_report=report(job_id, 1, version, "w0", accuracy=float("nan"), loss=0.0,
                                                      num_samples=10))  # not a score
    fed.publish_as("site-0", evaluation_report=report(job_id, 1, version, "w0", accuracy=0.5, loss=0.1,
                                                      num_samples=10**8))  # a count that outweighs everyone
    wanted = {"not_asked": 2, "wrong_version": 1, "conflict": 1, "implausible_count": 1}
    wait_for(lambda: all(metric("fedbroker_coordinator_evaluation_reports_refused_total", reason=r) == counts[r] + n
                         for r, n in wanted.items()), "the forged reports to be refused")
    wait_for(lambda: metric("fedbroker_coordinator_control_messages_rejected_total", reason="foreign_sender")
             == rejected["foreign_sender"] + 1 and metric("fedbroker_coordinator_control_messages_rejected_total",
                                                          reason="invalid_evaluation_report")
             == rejected["invalid_evaluation_report"] + 1, "the foreign and the invalid report to be dead-lettered")
    after = status_reply(fed.coordinator, job_id)
    assert [(e.worker_id, e.status, e.accuracy, e.loss, e.num_samples) for e in after.evaluations] == before
    assert (after.rounds[0].federated_accuracy, after.rounds[0].federated_samples) == (
        round_row.federated_accuracy, round_row.federated_samples)
    assert sum(e.kind == "evaluated" for e in fed.store.events(job_id)) == 3  # nothing new in the history
    assert len(fed.bus.dead) == 2  # the foreign and the invalid one; the rest were acked and logged


def test_patience_ends_a_job_whose_score_stops_improving(fed: Federation) -> None:
    """lr at its floor: the model hardly moves, so no round scores higher than the first (the earliest best)."""
    for i in range(3):
        fed.add_worker(i, 3)
    job_id = fed.run(job(training={"rounds": 12, "lr": 1e-8}, evaluation={"every": 1, "patience": 2}))
    row = fed.store.job(job_id)
    assert row.status == "completed" and row.rounds_done < 12 and not row.error
    (stop,) = [e for e in fed.store.events(job_id) if e.kind == "stopped_early"]
    assert "evaluation.patience" in stop.message and "federated accuracy" in stop.message
    scores = [(e.round, e.score.accuracy) for e in fed.store.evaluation_rounds(job_id) if e.settled and e.score]
    best = max(scores, key=lambda s: (s[1], -s[0]))
    assert f"after round {best[0]} " in stop.message
    assert sum(r > best[0] for r, _ in scores) >= 2  # the rule held when it stopped
    assert all(e.settled for e in fed.store.evaluation_rounds(job_id))  # the last one waited for, too


def test_an_async_job_is_scored_every_k_versions_by_the_sites_that_made_them(fed: Federation) -> None:
    for i in range(2):
        fed.add_worker(i, 2)
    job_id = fed.run(job(training={"rounds": 5}, evaluation={"every": 2},
                         schedule={"mode": "async", "buffer_size": 2, "min_workers": 2}))
    answered(fed, job_id)
    status = status_reply(fed.coordinator, job_id)
    scored = {r.round: r for r in status.rounds if r.federated_samples}
    assert sorted(scored) == [2, 4, 5]  # every 2nd version, and the last
    for number, r in scored.items():
        rows = [e for e in status.evaluations if e.round == number]
        makers = {p.worker_id for p in status.participants if p.round == number}
        assert {e.worker_id for e in rows} == makers and {e.model_version for e in rows} == {r.model_version}
        assert r.federated_accuracy == pytest.approx(weighted(rows)[0], abs=1e-12)


def test_sites_category_asks_every_active_site_and_every_0_asks_none(fed: Federation) -> None:
    for i in range(3):
        fed.add_worker(i, 3)
    first = fed.run(job(training={"rounds": 1}, schedule={"clients_per_round": 1},
                        evaluation={"sites": "category"}))
    answered(fed, first)  # the two sites that did not train are not waited for by the job's end
    (r,) = status_reply(fed.coordinator, first).rounds
    assert r.participants == 1 and r.evaluated_sites == 3
    second = fed.run(job(training={"rounds": 1}, evaluation={"every": 0, "dataset": "digits"}))
    assert not status_reply(fed.coordinator, second).evaluations
    assert not any(e.kind == "evaluation_asked" for e in fed.store.events(second))


def test_a_job_on_own_data_without_any_evaluation_is_accepted_with_a_warning_event(fed: Federation) -> None:
    for i in range(3):
        fed.add_worker(i, 3)
    job_id = fed.run(job(training={"rounds": 1}, evaluation={"every": 0}))
    (warning,) = [e for e in fed.store.events(job_id) if e.kind == "warning"]
    assert "evaluation.every is 0" in warning.message and "evaluation.dataset" in warning.message
    (r,) = status_reply(fed.coordinator, job_id).rounds
    assert (r.federated_samples, r.evaluated_sites) == (0, 0)


class Inflating:
    """A site's bus that sends its evaluation reports with a count of nine times its registered training samples
    (issue 30: such a report was accepted and held 92 % of the federated score's weight)."""

    def __init__(self, bus: object, count: int) -> None:
        self.bus, self.count = bus, count

    def publish_control(self, body: bytes) -> None:
        from fedbroker.bus import envelope

        message = envelope.decode(body, expect=("evaluation_report",))
        message.evaluation_report.num_samples = self.count
        self.bus.publish_control(message.SerializeToString())  # type: ignore[attr-defined]


def test_a_count_above_the_held_out_split_a_site_registered_is_refused(fed: Federation) -> None:
    agents = [fed.add_worker(i, 3) for i in range(3)]
    liar = agents[2]
    wait_for(lambda: len(fed.store.workers()) == 3, "the three sites to register")
    held_out = {w.worker_id: w.evaluation_samples for w in fed.store.workers()}
    assert held_out == {a.config.id: a.evaluation.num_samples for a in agents} and min(held_out.values()) > 0
    liar.evaluation.bus = Inflating(liar.evaluation.bus, 9 * len(liar.y))  # type: ignore[assignment]
    before = metric("fedbroker_coordinator_evaluation_reports_refused_total", reason="implausible_count")
    job_id = fed.coordinator.submit(parse_job(job(training={"rounds": 2})))  # its end waits for the liar's deadline
    wait_for(lambda: metric("fedbroker_coordinator_evaluation_reports_refused_total", reason="implausible_count")
             == before + 2, "the liar's two reports to be refused")
    wait_for(lambda: [r.evaluated_sites for r in status_reply(fed.coordinator, job_id).rounds] == [2, 2],
             "the honest sites' scores of both rounds")
    status = status_reply(fed.coordinator, job_id)
    assert not [e for e in status.evaluations if e.worker_id == "w2" and e.status == "evaluated"]
    for r in status.rounds:  # the score is the honest sites', weighted by their own held-out counts
        rows = [e for e in status.evaluations if e.round == r.round and e.worker_id in ("w0", "w1")]
        assert r.evaluated_sites == 2 and r.federated_samples == held_out["w0"] + held_out["w1"]
        assert r.federated_accuracy == pytest.approx(weighted(rows)[0], abs=1e-12)
