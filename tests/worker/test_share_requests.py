"""A running worker answers a job's share request from its tasks queue with a ShareReply on the control bus:
exactly what was asked (a FedAvg-like request that asks for nothing gets nothing), noised, noted in its
ledger; a request past its deadline is acked unanswered; a malformed one, or one another broker user
published, is dead-lettered unanswered."""

from __future__ import annotations

import queue
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from fedbroker.bus import Delivery, InProcessBus, envelope
from fedbroker.config import DataSection, DPPolicy, WorkerConfig
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.worker.agent import WorkerAgent

HANG_GUARD_S = 30.0


class Site:
    """A started worker, the coordinator's bus (broker user `coordinator`), and the replies it receives."""

    def __init__(self, tmp_path: Path, *, standardize: str = "federated") -> None:
        namespace = f"share-{uuid.uuid4().hex[:8]}"
        self.config = WorkerConfig(id="site-a", ledger_path=str(tmp_path / "ledger.json"), device="cpu",
                                   heartbeat_s=3600, coordinator_broker_user="coordinator",
                                   data=DataSection(standardize=standardize),
                                   dp=DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-6, epsilon_budget=10))
        self.worker_bus = InProcessBus(namespace=namespace, user="site-a")
        self.coordinator = InProcessBus(namespace=namespace, user="coordinator")
        self.forger = InProcessBus(namespace=namespace, user="site-b")
        self.replies: queue.Queue[pb.ShareReply] = queue.Queue()
        self.epsilon_reported: list[float] = []  # by heartbeats, in order
        self.agent = WorkerAgent(self.config, self.worker_bus)
        self.coordinator.consume_control(self._on_control)
        self.agent.start()
        self.worker_bus.start()
        self.coordinator.start()

    def _on_control(self, delivery: Delivery) -> None:
        message = envelope.decode(delivery.body, expect=("registration", "heartbeat", "share_reply"))
        if message.HasField("share_reply"):
            self.replies.put(message.share_reply)
        if message.HasField("heartbeat"):
            self.epsilon_reported.append(message.heartbeat.epsilon_spent)
        delivery.ack()

    def ask(self, request: pb.ShareRequest) -> pb.ShareReply:
        """The reply to `request`, once the worker has also noted it in its ledger and acked it."""
        self.coordinator.publish_task("site-a", envelope.encode(share_request=request))
        reply = self.replies.get(timeout=HANG_GUARD_S)
        self.settled()
        return reply

    def settled(self) -> None:
        """Wait until the worker has handled every request published so far: one published after them is
        handled after them (one queue, prefetch 1, in order), so its reply is a fence."""
        self.coordinator.publish_task("site-a", envelope.encode(share_request=pb.ShareRequest(
            job_id="fence", category="digits")))
        assert self.replies.get(timeout=HANG_GUARD_S).job_id == "fence"

    def close(self) -> None:
        self.agent.stop()
        for bus in (self.worker_bus, self.coordinator, self.forger):
            bus.close()


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    s = Site(tmp_path)
    yield s
    s.close()


def test_a_request_that_asks_for_nothing_gets_nothing_and_spends_nothing(site: Site) -> None:
    reply = site.ask(pb.ShareRequest(job_id="fedavg-job", category="digits"))
    assert (reply.job_id, reply.worker_id, reply.refused) == ("fedavg-job", "site-a", False)
    assert not reply.label_histogram and not reply.feature_sum and not reply.feature_sq_sum and reply.count == 0
    assert site.agent.ledger.total_epsilon() == 0.0 and site.agent.ledger.shared() == []


def test_the_histogram_alone_when_only_it_is_asked(site: Site) -> None:
    reply = site.ask(pb.ShareRequest(job_id="dwfed-job", category="digits", histogram=True))
    assert not reply.refused and len(reply.label_histogram) == 10
    assert reply.histogram_noised and reply.histogram_epsilon == 1.0  # the default: noised at ε 1
    assert not reply.feature_sum and reply.count == 0 and not reply.statistics_noised
    assert [(s.job_id, s.what, s.epsilon) for s in site.agent.ledger.shared()] == [("dwfed-job", "histogram", 1.0)]
    assert site.agent.ledger.total_epsilon() == pytest.approx(1.0)
    assert site.epsilon_reported[-1] == pytest.approx(1.0)  # a heartbeat told the coordinator at once


def test_both_releases_when_both_are_asked_in_rescaled_units(site: Site) -> None:
    reply = site.ask(pb.ShareRequest(job_id="fed-job", category="digits", histogram=True, feature_statistics=True,
                                     lower=[0.0], upper=[1.0]))
    n = len(site.agent.y)
    assert not reply.refused and reply.count == n and len(reply.feature_sum) == len(reply.feature_sq_sum) == 64
    assert reply.statistics_noised and (reply.statistics_epsilon, reply.statistics_delta) == (1.0, 1e-6)
    exact = site.agent.x.reshape(n, -1).clip(0, 1).sum(axis=0)  # digits are scaled to [0, 1] already
    noise = np.asarray(reply.feature_sum) - exact
    assert np.any(noise != 0) and np.all(np.abs(noise) < 200)  # noised, σ ≈ 3.5·sqrt(128) ≈ 40
    assert [s.what for s in site.agent.ledger.shared()] == ["histogram", "statistics"]
    assert site.agent.ledger.total_epsilon() == pytest.approx(2.0)
    again = site.ask(pb.ShareRequest(job_id="fed-job-2", category="digits", feature_statistics=True,
                                     lower=[0.0], upper=[1.0]))
    assert list(again.feature_sum) == list(reply.feature_sum) and site.agent.ledger.total_epsilon() == 2.0


def test_a_request_past_its_deadline_is_acked_unanswered(site: Site) -> None:
    site.coordinator.publish_task("site-a", envelope.encode(share_request=pb.ShareRequest(
        job_id="late", category="digits", histogram=True, deadline_unix=1.0)))
    site.settled()
    assert site.replies.empty() and site.worker_bus.dead == []
    assert site.agent.ledger.total_epsilon() == 0.0


def test_a_forged_or_malformed_request_is_dead_lettered_unanswered(site: Site) -> None:
    site.forger.publish_task("site-a", envelope.encode(share_request=pb.ShareRequest(
        job_id="forged", category="digits", histogram=True)))
    site.coordinator.publish_task("site-a", b"\xff\x00 not an envelope")
    site.settled()
    assert site.replies.empty() and len(site.worker_bus.dead) == 2
    assert site.agent.ledger.total_epsilon() == 0.0 and site.agent.ledger.shared() == []


def test_a_site_policy_refuses_statistics_on_the_wire(tmp_path: Path) -> None:
    s = Site(tmp_path, standardize="site")
    try:
        reply = s.ask(pb.ShareRequest(job_id="fed-job", category="digits", histogram=True, feature_statistics=True,
                                      lower=[0.0], upper=[1.0]))
        assert reply.refused and "worker.data.standardize is 'site'" in reply.reason
        assert not reply.label_histogram and not reply.feature_sum and s.agent.ledger.shared() == []
    finally:
        s.close()


PLAIN = {"input_shape": [1, 8, 8], "layers": [{"type": "Flatten"}, {"type": "Linear", "in_features": 64,
                                                                      "out_features": 10}]}
STANDARDISED = {"input_shape": [1, 8, 8], "layers": [{"type": "standardize", "mean": 0.3, "std": 0.4},
                                                     *PLAIN["layers"]]}


@pytest.mark.parametrize("standardize, model, refusal", [
    ("federated", PLAIN, "'federated': this site's data is raw .* starts with Flatten"),
    ("site", STANDARDISED, "'site': .* standardises its input again"),
])
def test_a_training_task_whose_preprocessing_contradicts_the_policy_is_refused_before_training(
        tmp_path: Path, standardize: str, model: dict, refusal: str) -> None:
    from fedbroker.errors import TaskRefused
    from fedbroker.job.spec import TrainingConfig, parameter_shapes, parse_model
    from fedbroker.model import initial_weights

    agent = WorkerAgent(WorkerConfig(id="site-a", ledger_path=str(tmp_path / "ledger.json"), device="cpu",
                                     data=DataSection(standardize=standardize), dp=DPPolicy(enabled=False)),
                        InProcessBus(namespace=f"policy-{uuid.uuid4().hex[:8]}"))
    task = pb.RoundTask(job_id="j", round=1, category="digits")
    spec = parse_model(model)
    with pytest.raises(TaskRefused, match=refusal):
        agent._train(task, TrainingConfig(), (1, spec.to_json(), initial_weights(spec, seed=0)))
    other = parse_model(STANDARDISED if model is PLAIN else PLAIN)  # the model its data fits trains
    result = agent._train(task, TrainingConfig(), (1, other.to_json(), initial_weights(other, seed=0)))
    assert result.epsilon is None and set(result.state) == set(parameter_shapes(other))


def test_at_start_the_worker_logs_in_one_line_what_it_will_share(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="fedbroker.worker.agent"):
        s = Site(tmp_path)
    try:
        (line,) = [r.getMessage() for r in caplog.records if "shares on a job's request only" in r.getMessage()]
        n = len(s.agent.y)
        assert line == (f"worker site-a registers {n} training samples of shape [1, 8, 8], 10 classes; shares on a "
                        f"job's request only: label histogram noised (Laplace, ε 1), feature statistics noised "
                        f"(Gaussian, ε 1, δ 1e-06); data.standardize federated; DP-SGD noise 1, clip 1, δ 1e-06, "
                        f"ε budget 10 (0 spent)")
    finally:
        s.close()
