"""One dishonest site in a federated standardisation (issue 30, "Hardening, fourth pass", item 9): every part a
real process or client over a RabbitMQ node of the test's own, each participant logging in as the broker user
`fedbroker provision` gives it (the coordinator binds each site's control messages to that user).

Two hospitals run `fedbroker worker` on their own CSV files; a third participant, a provisioned site, registers
and answers the share request with ±1e15 sums (the control queue's cap), which once set every feature's agreed
mean to its bound and std to the floor or cap. Its statistics are excluded and named (`jobs show`, its own site
history), it is not selected, the job completes with the two honest sites, and the agreed standardisation is
exactly the one their own releases (kept in their ledgers) give without the liar.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fedbroker.app.provision import parse_project
from fedbroker.app.provision.configs import broker_definitions, broker_user
from fedbroker.bus import Bus, Delivery, envelope, open_bus
from fedbroker.config import DataSection, WorkerConfig
from fedbroker.coordinator.sharing import MIN_STD_FRACTION
from fedbroker.datasets import load_worker_data, train_test_split
from fedbroker.proto import fedbroker_pb2 as pb
from tests.integration.processes import Deployment
from tests.integration.test_consortium_study import BOUNDS, FEATURES, JOB, SITES, site_settings, write_site_csv
from tests.rabbitmq_node import PrivateRabbitMQ

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

HONEST = tuple(SITES)[:2]
LIAR = "liar"


class Consortium:
    """A Deployment on the private node whose participants log in as their provisioned broker users."""

    def __init__(self, node: PrivateRabbitMQ, tmp: Path) -> None:
        self.node = node
        self.deployment = Deployment(node.url, tmp, name="std", worker_ids=[*HONEST, LIAR])
        self.project = parse_project({"name": f"std{uuid.uuid4().hex[:6]}", "server": {
            "host": "localhost", "namespace": self.deployment.namespace}, "sites": [{"name": s} for s in (*HONEST, LIAR)]})
        self.passwords = {who: secrets.token_hex(12) for who in ("coordinator", *HONEST, LIAR)}
        definitions = tmp / "definitions.json"
        definitions.write_text(json.dumps(broker_definitions(self.project, self.passwords)))
        node.ctl("import_definitions", str(definitions))

    def url(self, who: str) -> str:
        return f"amqp://{broker_user(self.project, who)}:{self.passwords[who]}@127.0.0.1:{self.node.amqp_port}/%2F"

    def close(self) -> None:
        self.deployment.close()
        for who in self.passwords:   # the node is the session's: leave it with the users it started with
            self.node.ctl("delete_user", broker_user(self.project, who))


@pytest.fixture
def consortium(private_rabbitmq: PrivateRabbitMQ, tmp_path: Path) -> Iterator[Consortium]:
    c = Consortium(private_rabbitmq, tmp_path)
    try:
        yield c
    finally:
        c.close()


def wait_for(predicate: Any, what: str, d: Deployment, timeout: float = 600.0) -> Any:
    """A hang guard, not a deadline the test relies on: the predicate is a state, not a timing."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        d.alive()
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}\n{d.logs()}")


class Liar:
    """A provisioned site's client: registers with 200 rows of the study's shape and answers a share request with
    sums no rows could give (the control queue still takes them: within ±1e15)."""

    def __init__(self, url: str, namespace: str) -> None:
        self.tasks: list[str] = []
        self.bus: Bus = open_bus(url, namespace=namespace)
        self.bus.consume_tasks(LIAR, self.on_task)
        self.bus.start()
        self.bus.publish_control(envelope.encode(registration=pb.Registration(
            worker_id=LIAR, categories=[JOB["category"]], device="cpu", num_samples=200, input_shape=[len(FEATURES)],
            num_classes=2, evaluation_samples=50)))

    def on_task(self, delivery: Delivery) -> None:
        env = envelope.decode(delivery.body, expect=("share_request", "round_task", "evaluation_task"))
        kind = env.WhichOneof("message")
        self.tasks.append(kind)
        if kind == "share_request":
            d = len(FEATURES)
            self.bus.publish_control(envelope.encode(share_reply=pb.ShareReply(
                job_id=env.share_request.job_id, worker_id=LIAR, feature_sum=[1e15, -1e15, 1e15, -1e15, 1e15][:d],
                feature_sq_sum=[1e15] * d, count=200, statistics_noised=True, statistics_epsilon=1.0,
                statistics_delta=1e-5)))
        delivery.ack()


def released(ledger: Path) -> np.ndarray:
    """The noised (Σu, Σu²) a site released, as its own ledger keeps the draw."""
    (release,) = [r for name, r in json.loads(ledger.read_text())["releases"].items()
                  if name.startswith("feature_statistics")]
    return np.asarray(release["value"], dtype=np.float64)


def training_rows(d: Deployment, site: str) -> int:
    data = load_worker_data(WorkerConfig(id=site, dataset="csv", data=DataSection(
        path=str(d.tmp / f"{site}.csv"), label_column="diagnosis", feature_columns=FEATURES,
        classes=("healthy", "disease"))))
    return len(train_test_split(data, test_fraction=0.2, seed=0)[0].y)


def test_a_site_with_impossible_statistics_is_excluded_named_and_the_others_standardisation_is_untouched(
        consortium: Consortium) -> None:
    c, d = consortium, consortium.deployment
    users = {broker_user(c.project, who): [who] for who in (*HONEST, LIAR)}
    d.spawn("aggregator", "aggregator", {"aggregator.listen": d.aggregator, "aggregator.spool_dir": d.tmp / "spool"})
    d.spawn("coordinator", "coordinator", {"broker.url": c.url("coordinator"), "coordinator.listen": d.coordinator,
                                           "coordinator.state_dir": d.tmp / "state",
                                           "coordinator.worker_broker_users": json.dumps(users)})
    for i, site in enumerate(HONEST):
        write_site_csv(d.tmp / f"{site}.csv", SITES[site], seed=40 + i)
        d.spawn(site, "worker", {**site_settings(d, site), "broker.url": c.url(site),
                                 "worker.coordinator_broker_user": broker_user(c.project, "coordinator")})

    def registered() -> bool:
        try:
            return d.registered(len(HONEST)) and len(json.loads(d.cli("status", "--json"))["workers"]) == len(HONEST)
        except AssertionError:  # the coordinator is still starting
            return False

    wait_for(registered, "the two hospitals to register", d)
    liar = Liar(c.url(LIAR), d.namespace)
    try:
        wait_for(lambda: d.registered(3) and len(json.loads(d.cli("status", "--json"))["workers"]) == 3,
                 "the liar to register", d)  # the coordinator's own Status first: no CLI process per poll
        job = {**JOB, "training": {**JOB["training"], "rounds": 1}, "evaluation": {"every": 0},
               "schedule": {**JOB["schedule"], "min_workers": 2}}
        (d.tmp / "job.json").write_text(json.dumps(job))
        job_id = json.loads(d.cli("submit", str(d.tmp / "job.json"), "--json"))["job_id"]

        def show() -> dict[str, Any]:
            doc: dict[str, Any] = json.loads(d.cli("jobs", "show", job_id, "--json"))
            return doc

        # the share phase's end first: what was agreed, and with whom, before anyone trains on it
        agreed = wait_for(lambda: [e for e in show()["sharing"] if e["kind"] == "statistics_agreed"],
                          "the sites' statistics to be agreed", d)[0]
        assert agreed["message"].startswith("mean and std of 5 feature(s) from 2 site(s)"), agreed
        assert LIAR not in agreed["message"]
        (excluded,) = [e for e in show()["sharing"] if e["kind"] == "statistics_excluded"]
        assert excluded["worker_id"] == LIAR
        assert "feature_sum: 5 value(s) ([0] 1e+15, [1] -1e+15" in excluded["message"]
        assert "not selected for this job" in excluded["message"]
        doc = wait_for(lambda: (x := show())["status"] in ("completed", "failed", "cancelled") and x, "the job to end", d)
    finally:
        liar.bus.close()
    assert doc["status"] == "completed", doc.get("error")
    assert liar.tasks == ["share_request"]   # never selected: no round task reached it
    assert {p["worker_id"] for p in doc["participants"] if p["status"] == "aggregated"} == set(HONEST)
    history = json.loads(d.cli("sites", "show", LIAR, "--json"))
    assert any(e["kind"] == "statistics_excluded" for e in history["events"]), history
    assert "are excluded (not selected for it)" in (d.tmp / "coordinator.log").read_text()

    # What the two honest releases give, pooled, without the liar: the agreed layer, to float32 precision.
    rows = sum(training_rows(d, site) for site in HONEST)
    total = sum(released(d.tmp / f"{site}-ledger.json") for site in HONEST)
    lower, upper = np.asarray(BOUNDS, dtype=np.float64).T
    mean01 = np.clip(total[:5] / rows, 0.0, 1.0)
    var01 = np.clip(total[5:] / rows - mean01**2, MIN_STD_FRACTION**2, 0.25)
    with sqlite3.connect(d.tmp / "state" / "coordinator.sqlite") as db:
        (spec,), = db.execute("select model_spec_json from share_phases where job_id = ?", (job_id,)).fetchall()
        shares = dict(db.execute("select worker_id, status from shares where job_id = ?", (job_id,)).fetchall())
    assert shares == {HONEST[0]: "shared", HONEST[1]: "shared", LIAR: "excluded"}
    layer = json.loads(spec)["layers"][0]
    assert layer["type"] == "standardize"
    np.testing.assert_allclose(layer["mean"], lower + (upper - lower) * mean01, rtol=1e-8)
    np.testing.assert_allclose(layer["std"], (upper - lower) * np.sqrt(var01), rtol=1e-8)
    # and the mean is a real one, not a bound: the liar's sums would have clipped every feature to one
    assert np.all((mean01 > 0.05) & (mean01 < 0.95))
