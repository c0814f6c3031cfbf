"""The operator's view of the sites, without a network: each site's bounded history and forwarded logs in the state
store, the control handler writing them (a forged log is filed under its real sender), the rate limit, the silent
sites, and the gRPC replies. The store's own tests run on SQLite and on PostgreSQL."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from fedbroker.bus import Delivery, InProcessBus
from fedbroker.config import DPPolicy
from fedbroker.coordinator import metrics, tables
from fedbroker.coordinator.control import SenderBinding
from fedbroker.coordinator.control_handler import ControlHandler
from fedbroker.coordinator.site_views import list_sites_reply, site_detail_reply, site_logs_reply
from fedbroker.coordinator.sites import SiteWatch, TokenBuckets, note_revoked
from fedbroker.coordinator.store import StateStore
from fedbroker.coordinator.store_sites import KEEP_EVENTS, KEEP_LOGS, MAX_LOG_CHARS
from fedbroker.errors import NotFound
from fedbroker.proto import fedbroker_pb2 as pb
from tests.coordinator.control_fakes import FakeDelivery, control_handler, send

DP = DPPolicy(enabled=True, noise_multiplier=1.1, max_grad_norm=1.0, delta=1e-5, epsilon_budget=8.0)


@pytest.fixture
def store(tmp_path: Path) -> Any:
    s = StateStore(str(tmp_path / "coordinator.sqlite"))
    yield s
    s.close()


def register(store: StateStore, worker_id: str, *, last_seen_ago: float = 0.0) -> None:
    store.upsert_worker(worker_id=worker_id, categories=["digits"], histogram=(), dp=DP, epsilon_spent=0.5,
                        device="cpu", num_samples=100, input_shape=[1, 8, 8], num_classes=10)
    if last_seen_ago:
        workers = tables.workers
        store._run("age it", update(workers).where(workers.c.worker_id == worker_id).values(
            last_seen=workers.c.last_seen - last_seen_ago))


def kinds(store: StateStore, worker_id: str) -> list[str]:
    return [e.kind for e in store.site_events(worker_id)]


# ----- the store (on SQLite and on PostgreSQL: `any_store`) -------------------------------------------------------

def test_a_sites_registrations_are_one_event_each_only_when_something_changed(any_store: StateStore) -> None:
    store = any_store
    register(store, "a")
    store.note_registration("a", software_version="0.1.0", started=100.0, broker_user="site-a", summary="holds x")
    store.note_registration("a", software_version="0.1.0", started=100.0, broker_user="site-a", summary="holds x")
    assert kinds(store, "a") == ["registered"]  # the periodic re-registration of the same process says nothing
    store.note_registration("a", software_version="0.2.0", started=100.0, broker_user="site-a", summary="holds x")
    store.note_registration("a", software_version="0.2.0", started=200.0, broker_user="site-a", summary="holds x")
    events = store.site_events("a")
    assert [e.kind for e in events] == ["registered", "re-registered", "restarted"]
    assert "fedbroker 0.1.0 → 0.2.0" in events[1].message
    info = store.site_infos()["a"]
    assert (info.software_version, info.restarts, info.broker_user) == ("0.2.0", 1, "site-a")


def test_a_silent_site_expires_once_and_returns_when_heard(any_store: StateStore) -> None:
    store = any_store
    register(store, "quiet", last_seen_ago=300.0)
    register(store, "loud")
    store.note_registration("quiet", software_version="", started=1.0, broker_user="", summary="s")
    assert store.mark_silent(timeout_s=60.0) == ["quiet"]
    assert store.mark_silent(timeout_s=60.0) == []  # once, until it is heard again
    assert store.site_infos()["quiet"].silent
    assert store.note_heard("loud") is False and kinds(store, "loud") == []  # nothing written for a beating site
    store.touch_worker("quiet", state="idle")  # type: ignore[arg-type]
    assert store.note_heard("quiet") is True
    assert kinds(store, "quiet") == ["registered", "expired", "returned"]
    expired, returned = store.site_events("quiet")[1:]
    assert "no heartbeat for 300s" in expired.message
    assert re.search(r"heartbeats again after 30\ds of silence", returned.message), returned.message


def test_a_sites_history_is_bounded_and_repeats_are_counted_not_stored_again(any_store: StateStore) -> None:
    store = any_store
    register(store, "a")
    for _ in range(50):
        assert store.note_site_event("a", "refused", "round 1 of job j: over budget")
    (event,) = store.site_events("a")
    assert event.count == 50
    for i in range(KEEP_EVENTS + 30):
        store.note_site_event("a", "refused", f"round {i} of job j")
    events = store.site_events("a")
    assert len(events) == KEEP_EVENTS and events[-1].message == f"round {KEEP_EVENTS + 29} of job j"


def test_nothing_is_written_for_a_site_that_never_registered(any_store: StateStore) -> None:
    store = any_store
    assert store.note_site_event("ghost", "refused", "x") is False
    assert store.add_site_log("ghost", sender="u", claimed="", site_time=0, level="ERROR", logger="l",
                              message="m", dropped_before=0) is None
    assert store.site_events("ghost") == [] and store.site_logs("ghost") == [] and store.site_infos() == {}


def test_a_sites_logs_are_bounded_cut_and_stripped_of_control_characters(any_store: StateStore) -> None:
    store = any_store
    register(store, "a")
    for i in range(KEEP_LOGS + 20):
        store.add_site_log("a", sender="site-a", claimed="", site_time=1.0, level="WARNING", logger="x",
                           message=f"line {i}", dropped_before=0)
    store.add_site_log("a", sender="site-a", claimed="", site_time=1.0, level="ERROR", logger="evil\x1b]0;t\x07",
                       message="\x1b[2J\x1b[31mred\u202e" + "y" * 5000, dropped_before=3)
    kept = store.site_logs("a", limit=1000)
    assert len(kept) == KEEP_LOGS and kept[0].message == "line 21"
    last = kept[-1]
    assert "\x1b" not in last.message + last.logger and "\u202e" not in last.message and "\x07" not in last.logger
    assert len(last.message) == MAX_LOG_CHARS and last.dropped_before == 3
    info = store.site_infos()["a"]
    assert info.log_records == KEEP_LOGS + 21 and info.last_error.startswith("evil")  # an ERROR is its last error
    assert [r.message for r in store.site_logs("a", after=kept[-3].seq)] == [kept[-2].message, last.message]


# ----- the control handler ----------------------------------------------------------------------------------------

def handler(store: StateStore, users: dict[str, list[str]]) -> ControlHandler:
    return control_handler(store, users, namespace="sites-test")


def registration(worker_id: str, **fields: Any) -> pb.Registration:
    return pb.Registration(**{"worker_id": worker_id, "categories": ["digits"], "num_samples": 100, "device": "cpu",
                              "input_shape": [1, 8, 8], "num_classes": 10, "software_version": "0.1.0",
                              "started_unix": 50.0, **fields})


def site_log(worker_id: str, message: str, level: str = "WARNING") -> pb.SiteLog:
    return pb.SiteLog(worker_id=worker_id, time_unix=1.0, level=level, logger="fedbroker.worker", message=message)


def outcome(name: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("fedbroker_coordinator_site_log_records_total", {"outcome": name}) or 0.0


def test_a_forged_log_naming_another_site_is_filed_under_its_real_sender(store: StateStore) -> None:
    h = handler(store, {"site-a": ["a"], "site-b": ["b"]})
    assert send(h, "site-a", registration=registration("a")).settled_as == "ack"
    assert send(h, "site-b", registration=registration("b")).settled_as == "ack"
    misattributed = outcome("misattributed")
    assert send(h, "site-a", site_log=site_log("b", "I am b, honest")).settled_as == "ack"
    assert store.site_logs("b") == []
    (record,) = store.site_logs("a")
    assert (record.message, record.sender, record.claimed) == ("I am b, honest", "site-a", "b")
    assert "misnamed_log" in kinds(store, "a") and outcome("misattributed") == misattributed + 1
    # a registration forged for b is refused as ever, and b's own history says so
    assert send(h, "site-a", registration=registration("b")).settled_as == "dead"
    assert kinds(store, "b")[-1] == "refused_sender"
    # a user that speaks for no site files nothing anywhere
    assert send(h, "stranger", site_log=site_log("a", "hello")).settled_as == "ack"
    assert len(store.site_logs("a")) == 1


def test_a_flood_of_logs_from_one_site_is_cut_by_the_coordinators_own_rate_limit(store: StateStore) -> None:
    clock = [0.0]
    h = handler(store, {"site-a": ["a"]})
    h.site_logs.buckets = TokenBuckets(burst=5, per_s=1.0, clock=lambda: clock[0])
    send(h, "site-a", registration=registration("a"))
    for i in range(40):
        send(h, "site-a", site_log=site_log("a", f"flood {i}"))
    assert [r.message for r in store.site_logs("a")] == [f"flood {i}" for i in range(5)]
    clock[0] += 2.0  # two more tokens: the next record kept says how many were dropped before it
    send(h, "site-a", site_log=site_log("a", "after"))
    assert (store.site_logs("a")[-1].message, store.site_logs("a")[-1].dropped_before) == ("after", 35)


def test_the_handler_writes_registrations_refusals_failures_and_evaluation_refusals(store: StateStore) -> None:
    h = handler(store, {})
    send(h, None, registration=registration("a"))
    send(h, None, registration=registration("a", dp_enabled=True, dp_policy=pb.DPPolicy(
        noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=5.0)))
    send(h, None, registration=registration("a", started_unix=99.0))
    store.add_job("j-1", "j", "{}", 1, "{}")
    store.open_round("j-1", 1, ["a"])
    send(h, None, task_outcome=pb.TaskOutcome(job_id="j-1", round=1, worker_id="a", status=pb.TaskOutcome.REFUSED,
                                              reason="privacy budget exceeded"))
    send(h, None, task_outcome=pb.TaskOutcome(job_id="j-1", round=1, worker_id="a", status=pb.TaskOutcome.FAILED,
                                              reason="update refused: wrong shape"))
    send(h, None, evaluation_report=pb.EvaluationReport(job_id="j-1", round=1, model_version=2, worker_id="a",
                                                        refused=False, accuracy=0.5, loss=1.0, num_samples=10))
    events = store.site_events("a")
    assert [e.kind for e in events] == ["registered", "re-registered", "restarted", "refused", "failed",
                                        "evaluation_report_rejected"]
    assert "DP False → True" in events[1].message and "privacy budget exceeded" in events[3].message
    assert store.site_infos()["a"].last_error == "failed: round 1 of job j-1: update refused: wrong shape"


def test_a_site_removed_from_the_broker_users_is_noted_revoked_at_start(store: StateStore) -> None:
    register(store, "a")
    register(store, "b")
    assert note_revoked(store, SenderBinding({"site-a": ["a"]})) == ["b"]
    assert kinds(store, "b") == ["revoked"] and kinds(store, "a") == []
    assert note_revoked(store, SenderBinding({})) == []  # unchecked senders: nothing is revoked


def test_the_site_watch_marks_a_silent_site_on_its_look(store: StateStore) -> None:
    register(store, "a", last_seen_ago=120.0)
    assert SiteWatch(store, heartbeat_timeout_s=60.0).look() == ["a"]


# ----- the replies ------------------------------------------------------------------------------------------------

def test_the_replies_name_every_site_with_its_heartbeat_epsilon_and_jobs(store: StateStore) -> None:
    register(store, "a")
    register(store, "b", last_seen_ago=500.0)
    store.note_registration("a", software_version="0.1.0", started=1.0, broker_user="site-a", summary="s")
    store.add_job("j-1", "j", "{}", 1, "{}")
    store.open_round("j-1", 1, ["a"])
    listed = list_sites_reply(store, heartbeat_timeout_s=60.0)
    assert [(s.worker_id, s.active, s.epsilon_recorded) for s in listed.sites] == [("a", True, 0.5),
                                                                                   ("b", False, 0.5)]
    a = listed.sites[0]
    assert (a.software_version, a.current_jobs, a.past_jobs, a.dp_policy.epsilon_budget) == ("0.1.0", 1, 0, 8.0)
    assert list(a.input_shape) == [1, 8, 8] and a.last_seen_seconds_ago < 60
    detail = site_detail_reply(store, "a", heartbeat_timeout_s=60.0)
    assert [j.job_id for j in detail.jobs] == ["j-1"] and [e.kind for e in detail.events] == ["registered"]
    with pytest.raises(NotFound, match="sites: a, b"):
        site_detail_reply(store, "ghost", heartbeat_timeout_s=60.0)
    with pytest.raises(NotFound):
        site_logs_reply(store, pb.SiteLogsRequest(worker_id="ghost"))


def test_per_site_metrics_are_exported_only_for_the_provisioned_sites(store: StateStore) -> None:
    register(store, "a")
    register(store, "intruder")

    class Bound:
        def __init__(self, provisioned: frozenset[str]) -> None:
            self.store, self.heartbeat_timeout_s, self.provisioned_sites = store, 60.0, provisioned
            self.bus = InProcessBus(namespace="sites-metrics")

    def ages(provisioned: frozenset[str]) -> set[str]:
        families = metrics.RegistryCollector._families(Bound(provisioned))  # type: ignore[arg-type]
        return {s.labels["worker_id"] for f in families for s in f.samples
                if s.name == "fedbroker_coordinator_site_heartbeat_age_seconds"}

    assert ages(frozenset({"a"})) == {"a"}
    assert ages(frozenset()) == {"a", "intruder"}  # unbound: every registered site, up to MAX_SITE_SERIES


def test_delivery_is_what_the_handler_is_given() -> None:
    """FakeDelivery stands in for the bus's Delivery: the attributes the handler reads exist on the real one."""
    read = {"body", "sender", "published_at"}
    assert read <= set(Delivery.__slots__) and read <= set(vars(FakeDelivery(b"", None)))
