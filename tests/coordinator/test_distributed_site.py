"""The coordinator's side of a site in distributed DP: the site's dp.mode and local floor kept from its registration
and shown in its row, a bad mode refused, and the local-floor ε a site reports kept beside its ε (a column older
state files gain on first use)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from fedbroker.coordinator.control_handler import ControlHandler
from fedbroker.coordinator.site_views import list_sites_reply
from fedbroker.coordinator.store import StateStore
from fedbroker.proto import fedbroker_pb2 as pb
from tests.coordinator.control_fakes import control_handler
from tests.coordinator.control_fakes import send as send_control


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = StateStore(str(tmp_path / "coordinator.sqlite"))
    yield s
    s.close()


def handler(store: StateStore) -> ControlHandler:
    return control_handler(store, {"site-a": ["a"]}, namespace="ddp-site-test")


def send(h: ControlHandler, **message: Any) -> str:
    return send_control(h, "site-a", **message).settled_as


def registration(**policy: Any) -> pb.Registration:
    return pb.Registration(worker_id="a", categories=["digits"], num_samples=100, device="cpu", input_shape=[4],
                           num_classes=2, software_version="0.1.0", started_unix=50.0, dp_enabled=True,
                           dp_policy=pb.DPPolicy(noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5,
                                                 epsilon_budget=8.0, **policy))


def test_a_sites_mode_and_floor_are_kept_and_shown(store: StateStore) -> None:
    h = handler(store)
    assert send(h, registration=registration(mode="distributed", local_floor_epsilon=2.5)) == "ack"
    (worker,) = store.workers()
    assert (worker.dp.mode, worker.dp.local_floor_epsilon) == ("distributed", 2.5)
    (row,) = list_sites_reply(store, heartbeat_timeout_s=60.0).sites
    assert (row.dp_policy.mode, row.dp_policy.local_floor_epsilon) == ("distributed", 2.5)
    # a site from before dp.mode sends none: it adds the whole dose itself
    assert send(h, registration=registration()) == "ack"
    assert store.workers()[0].dp.mode == "local"


def test_a_registration_with_an_unknown_mode_is_refused(store: StateStore) -> None:
    assert send(handler(store), registration=registration(mode="half")) == "dead"
    assert store.workers() == []


def test_a_reported_local_floor_is_kept_beside_the_epsilon(store: StateStore) -> None:
    h = handler(store)
    send(h, registration=registration(mode="distributed"))
    store._run("ask a for round 1", text("INSERT INTO participants (job_id, round, worker_id, status)"
                                         " VALUES ('job-d', 1, 'a', 'published')"))
    failed = pb.TaskOutcome(job_id="job-d", round=1, worker_id="a", status=pb.TaskOutcome.FAILED, reason="lost",
                            epsilon=0.4, epsilon_local_floor=3.0)
    assert send(h, task_outcome=failed) == "ack"
    assert store.local_floors("a") == {"job-d": 3.0}
    assert send(h, task_outcome=pb.TaskOutcome(job_id="job-d", round=1, worker_id="a", status=pb.TaskOutcome.FAILED,
                                               epsilon_local_floor=float("nan"))) == "dead"
    assert store.local_floors("a") == {"job-d": 3.0}


def test_a_state_file_from_before_the_floor_column_gains_it(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE participants (job_id TEXT NOT NULL, round INTEGER NOT NULL, worker_id TEXT NOT NULL,"
                   " status TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', epsilon REAL, train_loss REAL,"
                   " num_samples INTEGER, PRIMARY KEY (job_id, round, worker_id))")
        db.execute("INSERT INTO participants (job_id, round, worker_id, status, epsilon) VALUES"
                    " ('job-old', 1, 'a', 'aggregated', 1.5)")
    store = StateStore(str(path))
    try:
        assert store.local_floors("a") == {}
        assert store.record_local_floor("job-old", 1, "a", 2.0)
        assert not store.record_local_floor("job-old", 2, "a", 2.0)   # never asked for round 2
        assert store.local_floors("a") == {"job-old": 2.0}
        assert [p.epsilon for p in store.participants("job-old")] == [1.5]
    finally:
        store.close()
