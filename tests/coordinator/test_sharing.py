"""The coordinator's share phase before round 1 (coordinator/sharing.py), driven by hand-made sites on the in-process
bus against a real aggregation service: who is asked for what, what a job goes on with, which replies are refused,
and that what a site shared never raises the ε the coordinator records for it above the site's own ledger. The
tests of the share tables themselves run on SQLite and on PostgreSQL."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedbroker.aggregators.round_book import RoundBook
from fedbroker.aggregators.service import serve
from fedbroker.bus import InProcessBus, envelope
from fedbroker.config import DPPolicy
from fedbroker.coordinator.checkpoints import load_checkpoint
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.sharing import MIN_STD_FRACTION, receive_reply, standardized
from fedbroker.coordinator.store import StateStore
from fedbroker.coordinator.store_shares import ShareAnswer, SharePhaseRecord, ShareRecord, ShareStatus
from fedbroker.job.spec import parse_job, parse_model
from fedbroker.job.status import JobStatus
from fedbroker.label_stats import reported_ish
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient
from fedbroker.statistics_release import statistics_sigma
from fedbroker.worker.job_settings import JobSettingsCache

pytestmark = pytest.mark.timeout(120)

MODEL = {"input_shape": [4], "layers": [{"type": "Linear", "in_features": 4, "out_features": 3}]}
DP = DPPolicy(enabled=True, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=50.0)
Reply = Callable[["Site", pb.ShareRequest], "pb.ShareReply | None"]


def job(name: str, weighting: str = "dwfed", **schedule: Any) -> dict[str, Any]:
    return {"name": name, "category": "c", "model": MODEL, "training": {"rounds": 2},
            "aggregation": {"weighting": weighting},
            "evaluation": {"every": 0},  # these sites score nothing: no job waits for their reports
            "schedule": {"min_workers": 2, "wait_for_workers_s": 30, "round_timeout_s": 30, **schedule}}


def wait_for(predicate: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


class Site:
    """A hand-made worker: registers (with a label histogram, which the coordinator must not keep), answers share
    requests with `reply`, and trains a round task by sending the global model back (with the ISH its shared
    histogram gives against the task's population)."""

    def __init__(self, namespace: str, worker_id: str, histogram: list[int], reply: Reply, *,
                 epsilon: float = 1.0, features: int = 4) -> None:
        self.worker_id, self.histogram, self.reply_with, self.epsilon = worker_id, histogram, reply, epsilon
        self.features = features
        self.settings = JobSettingsCache(kept=8)  # each job's settings, as a worker keeps them
        self.bus = InProcessBus(namespace=namespace, user=worker_id)
        self.requests: list[pb.ShareRequest] = []
        self.tasks: list[pb.RoundTask] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        self.bus.declare_worker(self.worker_id)
        self.bus.consume_tasks(self.worker_id, self.on_task)
        self.bus.start()
        self.bus.publish_control(envelope.encode(registration=pb.Registration(
            worker_id=self.worker_id, categories=["c"], label_histogram=self.histogram, dp_enabled=True,
            dp_policy=pb.DPPolicy(noise_multiplier=DP.noise_multiplier, max_grad_norm=DP.max_grad_norm,
                                  delta=DP.delta, epsilon_budget=DP.epsilon_budget),
            epsilon_spent=self.epsilon, device="cpu", num_samples=sum(self.histogram), input_shape=[self.features],
            num_classes=len(self.histogram))))
        self.beat()

    def beat(self, epsilon: float | None = None) -> None:
        self.bus.publish_control(envelope.encode(heartbeat=pb.Heartbeat(
            worker_id=self.worker_id, epsilon_spent=self.epsilon if epsilon is None else epsilon, state="idle")))

    def on_task(self, delivery: Any) -> None:
        env = envelope.decode(delivery.body, expect=("round_task", "share_request"))
        if env.WhichOneof("message") == "share_request":
            with self._lock:
                self.requests.append(env.share_request)
            answer = self.reply_with(self, env.share_request)
            if answer is not None:
                self.bus.publish_control(envelope.encode(share_reply=answer))
            delivery.ack()
            return
        task = env.round_task
        with self._lock:
            self.tasks.append(task)
        with AggregatorClient(task.aggregator_target) as client:
            start = client.start_task(task.job_id, task.round, self.worker_id, task.model_version)
            if start.model is not None:
                ish = reported_ish(self.histogram, task.population_distribution, participants=task.participants,
                                   settings=self.settings.for_task(task, fetch=lambda digest: client.job_settings(
                                       task.job_id, self.worker_id, digest)).algorithms) \
                    if task.population_distribution else None
                client.upload(job_id=task.job_id, round=task.round, worker_id=self.worker_id,
                              num_samples=sum(self.histogram), tensors=start.model[2], ish=ish, epsilon=0.1)
        delivery.ack()


def shares_histogram(site: Site, request: pb.ShareRequest) -> pb.ShareReply:
    """A noised histogram at ε 1, the same draw for every job (as a site's ledger keeps it)."""
    return pb.ShareReply(job_id=request.job_id, worker_id=site.worker_id, label_histogram=site.histogram,
                         histogram_noised=True, histogram_epsilon=1.0)


def refuses(site: Site, request: pb.ShareRequest) -> pb.ShareReply:
    return pb.ShareReply(job_id=request.job_id, worker_id=site.worker_id, refused=True,
                         reason="worker.share: histograms go to no job here")


@dataclasses.dataclass
class Deployment:
    coordinator: Coordinator
    store: StateStore
    namespace: str
    sites: dict[str, Site]

    def add(self, worker_id: str, histogram: list[int], reply: Reply, **kwargs: Any) -> Site:
        site = Site(self.namespace, worker_id, histogram, reply, **kwargs)
        site.start()
        self.sites[worker_id] = site
        wait_for(lambda: any(w.worker_id == worker_id for w in self.store.workers()))
        return site


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    namespace = f"share-{uuid.uuid4().hex[:6]}"
    server, port = serve(RoundBook())
    target = f"127.0.0.1:{port}"
    bus = InProcessBus(namespace=namespace, user="coordinator")
    store = StateStore(str(tmp_path / "c.sqlite"))
    coordinator = Coordinator(bus=bus, store=store, aggregator=AggregatorClient(target), aggregator_target=target,
                              checkpoint_dir=str(tmp_path / "ck"), poll_interval_s=0.05, safety_poll_s=0.2,
                              worker_broker_users={s: [s] for s in ("a", "b", "c", "d")})
    coordinator.start()
    bus.start()
    d = Deployment(coordinator, store, namespace, {})
    try:
        yield d
    finally:
        coordinator.stop()
        for site in d.sites.values():
            site.bus.close()
        bus.close()
        server.stop(grace=0)
        store.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_dwfed_job_asks_for_histograms_goes_on_with_the_sites_that_shared_and_computes_p_from_them(
        deployment: Deployment, mode: str) -> None:
    a = deployment.add("a", [30, 10, 0], shares_histogram)
    b = deployment.add("b", [0, 10, 30], shares_histogram)
    c = deployment.add("c", [20, 20, 20], refuses)
    job_id = deployment.coordinator.submit(parse_job(job("dwfed-1", mode=mode)))
    assert deployment.coordinator.wait(job_id, 60) == JobStatus.COMPLETED, deployment.store.job(job_id)
    store = deployment.store
    for site in (a, b, c):
        (request,) = site.requests
        assert (request.job_id, request.histogram, request.feature_statistics) == (job_id, True, False)
    # the site that refused is never selected; P comes from what a and b shared, never from registrations
    assert not c.tasks and a.tasks and b.tasks
    assert len(a.tasks) == len(b.tasks) == 2 or mode == "async"
    np.testing.assert_allclose(a.tasks[0].population_distribution, [30 / 80, 20 / 80, 30 / 80])
    assert all(w.histogram == () for w in store.workers())  # the histograms the registrations carried: not kept
    shares = {s.worker_id: s for s in store.shares(job_id)}
    assert {w: s.status for w, s in shares.items()} == {"a": "shared", "b": "shared", "c": "refused"}
    assert shares["a"].histogram == (30, 10, 0) and shares["a"].charged_epsilon == 1.0
    events = [(e.kind, e.worker_id, e.message) for e in store.events(job_id)]
    assert ("not_shared", "c", "refused (worker.share: histograms go to no job here): not selected for this job") in events
    assert any(kind == "histograms_shared" and "a noised, ε 1" in message for kind, _, message in events)


def test_a_fedavg_job_asks_nothing_and_a_histogram_re_sent_to_a_second_job_is_charged_once(
        deployment: Deployment) -> None:
    a = deployment.add("a", [30, 10, 0], shares_histogram)
    b = deployment.add("b", [0, 10, 30], shares_histogram)
    fedavg = deployment.coordinator.submit(parse_job(job("fedavg", weighting="fedavg")))
    assert deployment.coordinator.wait(fedavg, 60) == JobStatus.COMPLETED
    assert not a.requests and not b.requests and not deployment.store.shares(fedavg)
    assert deployment.store.share_phase(fedavg) is None
    first = deployment.coordinator.submit(parse_job(job("dwfed-1")))
    assert deployment.coordinator.wait(first, 60) == JobStatus.COMPLETED
    second = deployment.coordinator.submit(parse_job(job("dwfed-2")))
    assert deployment.coordinator.wait(second, 60) == JobStatus.COMPLETED
    charged = {(s.job_id, s.worker_id): s.charged_epsilon for s in deployment.store.shares()}
    assert charged == {(first, "a"): 1.0, (first, "b"): 1.0, (second, "a"): 0.0, (second, "b"): 0.0}
    # the ε recorded for each site is what the coordinator priced: its three jobs' trainings (their uploads' ε),
    # never what its replies stated nor its heartbeats' total (1.0 with the histogram's draw): the tasks of every
    # job carry it, and a worker refuses to train below it
    priced = {w: sum(max(p.epsilon or 0.0 for p in deployment.store.participants(j) if p.worker_id == w)
                     for j in (fedavg, first, second)) for w in ("a", "b")}
    assert 0 < priced["a"] < 1.0
    assert {w.worker_id: w.epsilon_spent for w in deployment.store.workers()} == pytest.approx(priced)
    assert max(t.recorded_epsilon_spent for t in a.tasks) <= priced["a"] + 1e-12  # what was priced before it


def test_too_few_sites_sharing_fail_the_job_naming_each_one_and_nobody_trains(deployment: Deployment) -> None:
    a = deployment.add("a", [30, 10, 0], shares_histogram)
    b = deployment.add("b", [0, 10, 30], refuses)
    c = deployment.add("c", [5, 5, 5], lambda site, request: None)  # never answers
    job_id = deployment.coordinator.submit(parse_job(job("dwfed", min_workers=2, wait_for_workers_s=0)))
    assert deployment.coordinator.wait(job_id, 60) == JobStatus.FAILED
    error = deployment.store.job(job_id).error
    assert error.startswith("only 1 site(s) shared what the job needs before round 1, schedule.min_workers is 2")
    assert "b: refused (worker.share: histograms go to no job here)" in error
    assert "c: no reply within 5s" in error  # wait_for_workers_s 0: the phase waits its least, 5 s
    assert not a.tasks and not b.tasks and not c.tasks


# ----- replies, one by one, through the control queue's handler -----

class Delivery:
    def __init__(self, body: bytes, sender: str) -> None:
        self.body, self.sender, self.published_at = body, sender, None
        self.outcome = ""

    def ack(self) -> None:
        self.outcome = "ack"

    def nack(self, requeue: bool = True) -> None:
        self.outcome = "requeue" if requeue else "dead"


def running_phase(store: StateStore, tmp_path: Path) -> Coordinator:
    """A running job in its share phase, asking sites a and b (not c) for feature statistics over 3 features."""
    for worker_id in ("a", "b", "c"):
        store.upsert_worker(worker_id=worker_id, categories=["c"], histogram=(), dp=DP, epsilon_spent=1.0,
                            device="cpu", num_samples=100, input_shape=[3], num_classes=2)
    store.add_job("j-1", "j", "{}", 2, "{}")
    assert store.set_job_status("j-1", JobStatus.RUNNING)
    store.open_share_phase("j-1", histogram=False, statistics=True, lower=[0.0] * 3, upper=[1.0] * 3, features=3,
                           classes=2, deadline=time.time() + 600, asked=["a", "b"], not_asked={"c": "its budget"})
    return Coordinator(bus=InProcessBus(namespace=f"r-{uuid.uuid4().hex[:6]}"), store=store,
                       aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                       checkpoint_dir=str(tmp_path / "ck"), worker_broker_users={"a": ["a"], "b": ["b"], "c": ["c"]})


@pytest.fixture
def phase(tmp_path: Path) -> Iterator[tuple[Coordinator, StateStore]]:
    """`running_phase` on a SQLite store."""
    store = StateStore(str(tmp_path / "c.sqlite"))
    yield running_phase(store, tmp_path), store
    store.close()


@pytest.fixture
def any_phase(any_store: StateStore, tmp_path: Path) -> tuple[Coordinator, StateStore]:
    """`running_phase` on each engine the store runs on (SQLite, PostgreSQL)."""
    return running_phase(any_store, tmp_path), any_store


def statistics(worker_id: str, **fields: Any) -> pb.ShareReply:
    reply = pb.ShareReply(job_id="j-1", worker_id=worker_id, feature_sum=[10.0, 20.0, 30.0],
                          feature_sq_sum=[5.0, 10.0, 15.0], count=50, statistics_noised=True, statistics_epsilon=0.5,
                          statistics_delta=1e-5)
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(reply, name)[:] = value
        else:
            setattr(reply, name, value)
    return reply


def send(coordinator: Coordinator, reply: pb.ShareReply, sender: str | None = None) -> str:
    delivery = Delivery(envelope.encode(share_reply=reply), sender if sender is not None else reply.worker_id)
    coordinator.control.on_control(delivery)  # type: ignore[arg-type]
    return delivery.outcome


@pytest.mark.parametrize(("reply", "sender", "why"), [
    (statistics("b"), "a", "broker user 'a' may not speak for it"),                   # a speaks for b
    (statistics("c"), "c", "was not asked"),
    (statistics("a", job_id="nope-1"), "a", "is unknown"),
    (statistics("a", label_histogram=[3, 4], histogram_noised=True, histogram_epsilon=1.0), "a",
     "the job did not ask for it"),
    (statistics("a", feature_sum=[1.0, 2.0], feature_sq_sum=[1.0, 1.0]), "a", "2 values, the job's model takes 3"),
    (statistics("a", count=101), "a", "above the 100 samples the site registered"),
    (statistics("a", feature_sum=[1.0, float("nan"), 2.0]), "a", "finite"),
    (statistics("a", statistics_noised=False), "a", "statistics_noised: is False but statistics_epsilon is 0.5"),
    (statistics("a", refused=True, reason="no"), "a", "a refusal shares nothing"),
    (pb.ShareReply(job_id="j-1", worker_id="a"), "a", "missing: the job asked for them"),
])
def test_a_forged_or_mismatched_reply_is_refused_and_changes_nothing(
        phase: tuple[Coordinator, StateStore], reply: pb.ShareReply, sender: str, why: str,
        caplog: pytest.LogCaptureFixture) -> None:
    coordinator, store = phase
    before = (store.shares("j-1"), store.events("j-1"), store.recorded_epsilon("a"))
    assert send(coordinator, reply, sender) == "dead"
    assert why in caplog.text
    assert (store.shares("j-1"), store.events("j-1"), store.recorded_epsilon("a")) == before


def sigma() -> float:
    """The σ of the fixture's noised statistics (3 features at ε 0.5, δ 1e-5)."""
    return statistics_sigma(features=3, epsilon=0.5, delta=1e-5)


@pytest.mark.parametrize(("fields", "why"), [
    ({"feature_sum": [1e15, -1e15, 1e15], "feature_sq_sum": [1e15, 1e15, -1e15]},      # the attack: every bound
     "feature_sum: 3 value(s) ([0] 1e+15, [1] -1e+15, [2] 1e+15) outside [0, 50]"),
    ({"feature_sum": [10.0, 50 + 6.01 * sigma(), 30.0]}, "feature_sum: 1 value(s) ([1] "),   # just past count + 6σ
    ({"feature_sq_sum": [5.0, -6.01 * sigma(), 15.0]}, "feature_sq_sum: 1 value(s) ([1] "),   # just below -6σ
    ({"feature_sum": [0.0, 20.0, 30.0], "feature_sq_sum": [8.6 * sigma(), 10.0, 15.0]},     # Q - S > 6·sqrt(2)·σ
     "feature_sq_sum: 1 value(s) ([0] "),
    ({"statistics_epsilon": 0.09, "feature_sum": [10.0, 20.0, 30.0]}, "below the least this coordinator takes"),
    ({"statistics_delta": 1e-11}, "below the least this coordinator takes"),
    ({"statistics_noised": False, "statistics_epsilon": 0.0, "statistics_delta": 0.0,   # exact: a square above its value
      "feature_sq_sum": [11.0, 10.0, 15.0]}, "above its feature's sum"),
    ({"statistics_noised": False, "statistics_epsilon": 0.0, "statistics_delta": 0.0,   # exact: a sum above its count
      "feature_sum": [10.0, 50.01, 30.0], "feature_sq_sum": [5.0, 10.0, 15.0]}, "outside [0, 50]"),
])
def test_statistics_no_rows_could_give_are_excluded_and_named_and_the_site_not_selected(
        phase: tuple[Coordinator, StateStore], fields: dict[str, Any], why: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Break 9 of "Hardening, fourth pass": a site's ±1e15 noised sums (within the control queue's cap) set every
    feature's agreed mean to its bound. A reply whose statistics cannot be true is kept as `excluded`, named in
    the job's events, the site's history and the log, and the site is not selected; a plausible one is kept."""
    coordinator, store = phase
    assert send(coordinator, statistics("a", **fields)) == "ack"
    assert send(coordinator, statistics("b", feature_sum=[10.0, 50 + 5.9 * sigma(), -5.9 * sigma()])) == "ack"
    a, b, _ = store.shares("j-1")
    assert (a.status, b.status) == (ShareStatus.EXCLUDED, ShareStatus.SHARED)
    assert why in a.reason
    (event,) = [e for e in store.events("j-1") if e.kind == "statistics_excluded"]
    assert event.worker_id == "a" and why in event.message and "not selected for this job" in event.message
    assert why in caplog.text and "worker a's feature statistics for job j-1 are excluded" in caplog.text
    assert any(e.kind == "statistics_excluded" and why in e.message for e in store.site_events("a"))
    assert store.recorded_epsilon("a") == 1.0  # what it stated never reaches the record
    store.close_share_phase("j-1", model_spec_json="", events=[])
    unselectable = coordinator.context.why_unaffordable("j-1", parse_job(job("j")))
    assert "did not share what this job needs before round 1 (excluded: " in unselectable["a"]
    assert not unselectable["b"]


def test_a_reply_is_taken_once_and_not_after_the_deadline(any_phase: tuple[Coordinator, StateStore],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    coordinator, store = any_phase
    assert send(coordinator, statistics("a")) == "ack"
    (a,) = [s for s in store.shares("j-1") if s.worker_id == "a"]
    assert (a.status, a.count, a.feature_sum, a.charged_epsilon) == (ShareStatus.SHARED, 50, (10.0, 20.0, 30.0), 0.5)
    assert send(coordinator, statistics("a", count=40)) == "dead"
    assert "already answered" in caplog.text
    store.move_share_deadline("j-1", time.time() - 1)
    assert send(coordinator, statistics("b")) == "dead"
    assert "late: the share phase of job 'j-1' ended" in caplog.text
    assert [s.status for s in store.shares("j-1")] == [ShareStatus.SHARED, ShareStatus.ASKED, ShareStatus.NOT_ASKED]


def test_a_release_never_raises_the_sites_record_nor_does_its_heartbeat(
        any_phase: tuple[Coordinator, StateStore]) -> None:
    coordinator, store = any_phase
    assert send(coordinator, statistics("a")) == "ack"  # ε 0.5, drawn for this job
    assert store.recorded_epsilon("a") == 1.0  # not 1.5: the record is what the coordinator priced
    for claim in (1.5, 9.0):  # the ledger's total with the release, then a forged one: advisory, never stored
        heartbeat = pb.Heartbeat(worker_id="a", epsilon_spent=claim, state="idle")
        coordinator.control.on_control(Delivery(envelope.encode(heartbeat=heartbeat), "a"))  # type: ignore[arg-type]
        assert store.recorded_epsilon("a") == 1.0


def test_receive_reply_is_the_one_door(any_phase: tuple[Coordinator, StateStore]) -> None:
    _, store = any_phase
    receive_reply(store, statistics("b", statistics_noised=False, statistics_epsilon=0.0, statistics_delta=0.0,
                                    feature_sq_sum=[5.0, 10.0, 15.0], feature_sum=[10.0, 20.0, 30.0]))
    (b,) = [s for s in store.shares("j-1") if s.worker_id == "b"]
    assert (b.statistics_noised, b.charged_epsilon) == (False, 0.0)


def histogram_answer(counts: list[int], epsilon: float = 1.0) -> ShareAnswer:
    return ShareAnswer(refused=False, reason="", histogram=counts, histogram_noised=True, histogram_epsilon=epsilon,
                       feature_sum=(), feature_sq_sum=(), count=0, statistics_noised=False, statistics_epsilon=0.0,
                       statistics_delta=0.0)


def test_a_release_re_sent_to_a_second_job_is_charged_once_and_a_late_site_is_noted_once(
        any_store: StateStore) -> None:
    """The share tables by themselves, on each engine: the ε a reply newly costs, a phase opened again starting
    afresh, its close (silent sites, the agreed model), and a site met after it noted once."""
    store = any_store
    for worker_id in ("a", "b", "c"):
        store.upsert_worker(worker_id=worker_id, categories=["c"], histogram=(), dp=DP, epsilon_spent=0.0,
                            device="cpu", num_samples=100, input_shape=[3], num_classes=2)
    for job_id in ("j-1", "j-2"):
        store.add_job(job_id, job_id, "{}", 2, "{}")
        assert store.set_job_status(job_id, JobStatus.RUNNING)
        store.open_share_phase(job_id, histogram=True, statistics=False, lower=[], upper=[], features=3, classes=2,
                               deadline=time.time() + 600, asked=["a", "b"], not_asked={})
    assert store.record_share("j-1", "a", histogram_answer([3, 4]), lambda phase: []) == []
    store.close_share_phase("j-1", model_spec_json='{"agreed": 1}', events=[("standardised", "", "by a")])
    assert store.job("j-1").model_spec_json == '{"agreed": 1}'  # type: ignore[union-attr]
    assert [(r.worker_id, r.status) for r in store.shares("j-1")] == [("a", "shared"), ("b", "silent")]
    assert store.record_share("j-1", "b", histogram_answer([1, 1]), lambda phase: []) == [
        "job 'j-1' is not in its share phase"]
    assert store.record_share("j-2", "a", histogram_answer([3, 4]), lambda phase: []) == []  # the same release
    assert store.record_share("j-2", "b", histogram_answer([5, 6], 0.5), lambda phase: []) == []
    assert {(r.job_id, r.worker_id): r.charged_epsilon for r in store.shares(worker_id="a")} == {
        ("j-1", "a"): 1.0, ("j-2", "a"): 0.0}
    assert [r.charged_epsilon for r in store.shares("j-2", worker_id="b")] == [0.5]
    store.open_share_phase("j-1", histogram=True, statistics=False, lower=[], upper=[], features=3, classes=2,
                           deadline=time.time() + 600, asked=["b"], not_asked={"a": "answered"})  # asked again
    reopened = store.share_phase("j-1")
    assert reopened is not None and reopened.open and reopened.finished is None and reopened.model_spec_json == ""
    assert [(r.worker_id, r.status) for r in store.shares("j-1")] == [("a", "not_asked"), ("b", "asked")]
    store.note_not_shared("j-2", ["c"], "registered after the share phase")
    store.note_not_shared("j-2", ["c", "a"], "registered after the share phase")  # c again, a had answered
    assert [(r.worker_id, r.status) for r in store.shares("j-2")] == [("a", "shared"), ("b", "shared"),
                                                                      ("c", "not_asked")]
    assert [e.worker_id for e in store.events("j-2") if e.kind == "not_shared"] == ["c"]


def test_a_coordinator_stopped_in_the_share_phase_resumes_it_asking_again_who_did_not_answer(
        deployment: Deployment, tmp_path: Path) -> None:
    a = deployment.add("a", [30, 10, 0], shares_histogram)
    b = deployment.add("b", [0, 10, 30], lambda site, request: shares_histogram(site, request) if len(site.requests) > 1
                       else None)  # answers only when asked again
    job_id = deployment.coordinator.submit(parse_job(job("dwfed", wait_for_workers_s=600)))
    wait_for(lambda: [s.status for s in deployment.store.shares(job_id)] == ["shared", "asked"])
    deployment.coordinator.stop()
    assert deployment.store.job(job_id).status == JobStatus.RUNNING and deployment.store.share_phase(job_id).open
    bus = InProcessBus(namespace=deployment.namespace, user="coordinator")
    aggregator = deployment.coordinator.aggregator
    again = Coordinator(bus=bus, store=deployment.store, aggregator=aggregator,
                        aggregator_target=deployment.coordinator.context.aggregator_target,
                        checkpoint_dir=str(tmp_path / "ck"), poll_interval_s=0.05, safety_poll_s=0.2)
    again.start()
    bus.start()
    try:
        assert again.wait(job_id, 60) == JobStatus.COMPLETED
    finally:
        again.stop()
        bus.close()
    assert len(a.requests) == 1 and len(b.requests) == 2  # a had answered: not asked again
    assert [s.status for s in deployment.store.shares(job_id)] == ["shared", "shared"]
    assert len(a.tasks) == len(b.tasks) == 2


# ----- federated standardisation -----

BOUNDS = [[0.0, 10.0], [-5.0, 5.0], [0.0, 1.0]]


def exact_statistics(x: np.ndarray, lower: list[float], upper: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """A site's exact release: per feature, the sums of its values clipped to the bounds and rescaled to [0, 1]."""
    lo, hi = np.asarray(lower), np.asarray(upper)
    unit = (np.clip(x, lo, hi) - lo) / (hi - lo)
    return unit.sum(axis=0), (unit**2).sum(axis=0)


def site_data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {worker_id: np.column_stack([rng.normal(loc, 3.0, size=n), rng.uniform(-8, 8, size=n), np.full(n, 0.5)])
            for worker_id, loc, n in (("a", 2.0, 40), ("b", 6.0, 90), ("c", 4.0, 25))}


def test_the_agreed_mean_and_std_are_the_pooled_ones_of_the_clipped_values_and_a_dead_variance_is_floored() -> None:
    data = site_data()
    lower, upper = [lo for lo, _ in BOUNDS], [hi for _, hi in BOUNDS]
    phase = SharePhaseRecord(job_id="j", open=False, histogram=False, statistics=True, lower=tuple(lower),
                             upper=tuple(upper), features=3, classes=2, started=0.0, deadline=1.0, finished=None,
                             model_spec_json="")
    shared = []
    for worker_id, x in data.items():
        sums, squares = exact_statistics(x, lower, upper)
        shared.append(ShareRecord(job_id="j", worker_id=worker_id, status=ShareStatus.SHARED, reason="", time=0.0,
                                  histogram=(), histogram_noised=False, histogram_epsilon=0.0,
                                  feature_sum=tuple(sums), feature_sq_sum=tuple(squares), count=len(x),
                                  statistics_noised=False, statistics_epsilon=0.0, statistics_delta=0.0,
                                  charged_epsilon=0.0))
    model = parse_model({"input_shape": [3], "layers": [{"type": "Linear", "in_features": 3, "out_features": 2}]})
    spec, summary = standardized(model, phase, shared)
    pooled = np.clip(np.concatenate(list(data.values())), lower, upper)
    layer = spec.layers[0]
    assert layer.type == "standardize" and spec.layers[1:] == model.layers
    np.testing.assert_allclose(layer.params["mean"], pooled.mean(axis=0), rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(layer.params["std"][:2], pooled.std(axis=0)[:2], rtol=1e-6)
    assert layer.params["std"][2] == pytest.approx(MIN_STD_FRACTION * 1.0)  # a constant feature: floored
    assert summary.startswith("mean and std of 3 feature(s) from 3 site(s), 155 row(s): a exact, b exact, c exact")
    assert "1 feature(s) with a variance below" in summary and "[2]" in summary


def statistics_of(data: dict[str, np.ndarray]) -> Reply:
    def reply(site: Site, request: pb.ShareRequest) -> pb.ShareReply:
        lower = list(request.lower) * 3 if len(request.lower) == 1 else list(request.lower)
        upper = list(request.upper) * 3 if len(request.upper) == 1 else list(request.upper)
        sums, squares = exact_statistics(data[site.worker_id], lower, upper)
        return pb.ShareReply(job_id=request.job_id, worker_id=site.worker_id, feature_sum=sums.tolist(),
                             feature_sq_sum=squares.tolist(), count=len(data[site.worker_id]))
    return reply


def test_a_federated_job_starts_from_its_model_with_the_agreed_standardisation_in_front(
        deployment: Deployment) -> None:
    data = site_data()
    reply = statistics_of(data)
    sites = [deployment.add(w, [len(x) // 2, len(x) - len(x) // 2], reply, features=3) for w, x in data.items()]
    raw = job("std", weighting="fedavg")
    raw["model"] = {"input_shape": [3], "layers": [{"type": "Linear", "in_features": 3, "out_features": 2}]}
    raw["data"] = {"standardize": "federated", "bounds": BOUNDS}
    job_id = deployment.coordinator.submit(parse_job(raw))
    assert deployment.coordinator.wait(job_id, 60) == JobStatus.COMPLETED, deployment.store.job(job_id).error
    (request, *_) = sites[0].requests
    assert (request.histogram, request.feature_statistics) == (False, True)
    assert (list(request.lower), list(request.upper)) == ([0.0, -5.0, 0.0], [10.0, 5.0, 1.0])
    phase = deployment.store.share_phase(job_id)
    pooled = np.clip(np.concatenate(list(data.values())), [lo for lo, _ in BOUNDS], [hi for _, hi in BOUNDS])
    agreed = parse_model(json.loads(phase.model_spec_json))
    np.testing.assert_allclose(agreed.layers[0].params["mean"], pooled.mean(axis=0), rtol=1e-7, atol=1e-9)
    # every round trained the model with the layer in front, and the job's model spec says so
    assert deployment.store.job(job_id).model_spec_json.startswith('{"input_shape": [3], "layers": [{"mean"')
    for round_row in deployment.store.rounds(job_id):
        _, spec_json = load_checkpoint(round_row.checkpoint)
        assert parse_model(json.loads(spec_json)).layers[0] == agreed.layers[0]
    kinds = [e.kind for e in deployment.store.events(job_id)]
    assert "statistics_agreed" in kinds and "histograms_shared" not in kinds
