"""The control queue's checks that need no broker: who may speak for a worker (`SenderBinding`, on the in-process
bus whose buses stand for broker users), the ε a task outcome may claim for a job (`EpsilonBounds`, kept in the
state store across restarts), the recorded ε (what the coordinator priced: its participant rows), the audit trail of
ε corrections, and the configs that carry the binding."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import yaml

from fedbroker.app.provision import parse_project, provision
from fedbroker.bus import InProcessBus, envelope
from fedbroker.config import DPPolicy, load_config
from fedbroker.coordinator.control import ForeignSender, SenderBinding
from fedbroker.coordinator.participants import EpsilonBounds
from fedbroker.coordinator.scheduler import Coordinator
from fedbroker.coordinator.store import StateStore
from fedbroker.errors import ConfigError
from fedbroker.job.spec import TrainingConfig
from fedbroker.job.status import ParticipantStatus
from fedbroker.proto import fedbroker_pb2 as pb
from fedbroker.rpc.aggregation_client import AggregatorClient

pytestmark = pytest.mark.timeout(60)

DP = DPPolicy(enabled=True, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=50.0)
TRAINING = TrainingConfig(rounds=3, local_epochs=1, batch_size=32, lr=0.1)


def wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)
    return value


def register(store: StateStore, worker_id: str, epsilon: float = 0.0) -> None:
    store.upsert_worker(worker_id=worker_id, categories=["digits"], histogram=[1] * 10, dp=DP,
                        epsilon_spent=epsilon, device="cpu", num_samples=500)


def test_a_registration_is_refused_unless_its_broker_user_may_speak_for_its_worker(tmp_path: Path) -> None:
    namespace = f"bind-{uuid.uuid4().hex[:6]}"
    coordinator_bus = InProcessBus(namespace=namespace, user="coordinator")
    c = Coordinator(bus=coordinator_bus, store=StateStore(str(tmp_path / "c.sqlite")),
                    aggregator=AggregatorClient("127.0.0.1:1"), aggregator_target="127.0.0.1:1",
                    checkpoint_dir=str(tmp_path / "ck"), worker_broker_users={"site-a": ["a"], "site-b": ["b"]})
    site_a, anonymous = InProcessBus(namespace=namespace, user="site-a"), InProcessBus(namespace=namespace)
    c.start()
    coordinator_bus.start()
    try:
        for bus, worker_id in ((site_a, "b"), (anonymous, "a"), (site_a, "a")):  # only the last may pass
            bus.publish_control(envelope.encode(registration=pb.Registration(
                worker_id=worker_id, categories=["digits"], num_samples=10, device="cpu")))
        wait_for(lambda: c.store.workers())
        wait_for(lambda: len(coordinator_bus.dead) == 2)
    finally:
        c.stop()
        for bus in (coordinator_bus, site_a, anonymous):
            bus.close()
    assert [w.worker_id for w in c.store.workers()] == ["a"]


def test_a_binding_names_a_bad_worker_id_as_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"coordinator.worker_broker_users.site-a"):
        SenderBinding({"site-a": ["a b"]})
    assert not SenderBinding({}).enabled


def test_the_binding_follows_the_config_file_so_an_added_site_is_accepted_without_a_restart(tmp_path: Path) -> None:
    from fedbroker.app.launch import broker_users_of
    from fedbroker.app.provision.folder import replace_yaml

    config = tmp_path / "coordinator.yaml"
    config.write_text(yaml.safe_dump({"coordinator": {"worker_broker_users": {"site-a": ["a"]}}}))
    follow = broker_users_of(str(config), None)
    binding = SenderBinding(follow(), follow=follow)
    registration = pb.Envelope(registration=pb.Registration(worker_id="c"))
    with pytest.raises(ForeignSender, match="broker user .site-c. may not speak for it"):
        binding.check(registration, "site-c")
    # `fedbroker provision add` rewrites the file whole (a new inode): the next message sees the new map
    replace_yaml(config, {"coordinator": {"worker_broker_users": {"site-a": ["a"], "site-c": ["c"]}}}, secret=False)
    binding.check(registration, "site-c")
    assert binding.provisioned() == {"a", "c"}
    unbound: list[list[str]] = []
    binding.on_unbound = unbound.append
    replace_yaml(config, {"coordinator": {"worker_broker_users": {"site-c": ["c"]}}}, secret=False)   # `revoke`
    assert binding.provisioned() == {"c"} and unbound == [["a"]]
    replace_yaml(config, {"coordinator": {"worker_broker_users": {"site-a": ["a"], "site-c": ["c"]}}}, secret=False)
    assert binding.provisioned() == {"a", "c"} and unbound == [["a"]]
    # a file that does not load (a bad worker id) keeps the last good map in force
    replace_yaml(config, {"coordinator": {"worker_broker_users": {"site-d": ["d d"]}}}, secret=False)
    binding.check(registration, "site-c")
    assert binding.site_for("site-a", "a") == "a"


def test_a_jobs_epsilon_claim_is_bounded_by_what_its_tasks_were_priced_at_and_the_bound_outlives_a_restart(
        store_url: str) -> None:
    store = StateStore.from_url(store_url)
    register(store, "w0")
    bounds = EpsilonBounds(store)
    assert bounds.limit("w0", "job-1") == 0.0  # nothing asked of it: no ε may be claimed
    bounds.note_tasks("job-1", ["w0", "w0"], time.time() + 60, TRAINING)  # the job's training, not read from tasks
    per_round = bounds.limit("w0", "job-1") / 2
    assert 0 < per_round < 50
    assert bounds.limit("w0", "job-2") == 0.0 and bounds.limit("ghost", "job-1") == 0.0
    again = StateStore.from_url(store_url)
    restarted = EpsilonBounds(again)  # the tasks' bounds are in the store
    assert restarted.limit("w0", "job-1") == pytest.approx(2 * per_round)
    again.close()
    store.close()


def test_the_recorded_epsilon_is_what_the_participant_rows_priced_never_a_claim(any_store: StateStore) -> None:
    """Per job the largest ε of its rows (a job's ε is cumulative), summed over jobs; a heartbeat changes nothing."""
    store = any_store
    register(store, "w0")
    for job_id in ("a", "b"):
        store.add_job(job_id, job_id, "{}", 3, "{}")
    store.record_async_training("a", "w0", task=1, status=ParticipantStatus.FAILED, reason="stale", epsilon=0.5)
    store.record_async_training("a", "w0", task=2, status=ParticipantStatus.FAILED, reason="stale", epsilon=0.9)
    store.record_async_training("b", "w0", task=1, status=ParticipantStatus.FAILED, reason="stale", epsilon=0.25)
    assert store.touch_worker("w0", state="idle")  # type: ignore[arg-type]
    assert store.priced_epsilon("w0") == pytest.approx(1.15)
    assert store.recorded_epsilon("w0") == pytest.approx(1.15)
    assert [w.epsilon_spent for w in store.workers()] == [pytest.approx(1.15)]
    assert store.recorded_epsilon("ghost") is None and store.priced_epsilon("ghost") == 0.0


def test_an_epsilon_correction_is_audited_and_may_lower_the_record(any_store: StateStore) -> None:
    store = any_store
    register(store, "w0", epsilon=1e6)
    assert store.correct_epsilon("nobody", epsilon=1.0, by="op", ledger_sha256="00", ledger_epsilon=1.0) is None
    correction = store.correct_epsilon("w0", epsilon=2.5, by="op", ledger_sha256="ab", ledger_epsilon=2.5, note="n")
    assert correction is not None and (correction.old, correction.new) == (1e6, 2.5)
    assert store.recorded_epsilon("w0") == 2.5
    assert [(c.worker_id, c.by, c.old, c.new, c.note) for c in store.epsilon_corrections("w0")] == [
        ("w0", "op", 1e6, 2.5, "n")]


def test_async_trainings_never_aggregated_keep_the_largest_epsilon_and_their_count(any_store: StateStore) -> None:
    store = any_store
    store.add_job("j", "j", "{}", 3, "{}")
    store.record_async_training("j", "w0", task=4, status=ParticipantStatus.FAILED, reason="stale", epsilon=0.5)
    store.record_async_training("j", "w0", task=7, status=ParticipantStatus.FAILED, reason="stale", epsilon=0.8)
    (row,) = store.participants("j", 0)
    assert (row.worker_id, row.status, row.epsilon) == ("w0", "failed", 0.8)
    assert row.reason.startswith("2 training(s) not aggregated; the last, task 7")
    assert len([e for e in store.events("j") if "trained, not aggregated" in e.message]) == 2


def test_worker_broker_users_load_from_yaml_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"coordinator": {"worker_broker_users": {"p-a": ["a"], "p-b": "b, c"}}}))
    assert load_config(str(path), environ={}).coordinator.worker_broker_users == {"p-a": ("a",), "p-b": ("b", "c")}
    env = {"FEDBROKER__COORDINATOR__WORKER_BROKER_USERS": '{"p-a": [a]}'}
    assert load_config(environ=env).coordinator.worker_broker_users == {"p-a": ("a",)}
    with pytest.raises(ConfigError, match="coordinator.worker_broker_users: must be a mapping"):
        load_config(environ={"FEDBROKER__COORDINATOR__WORKER_BROKER_USERS": "[a]"})


def test_provisioning_binds_each_site_to_its_broker_user_and_gives_every_kit_one_consumer_timeout(
        tmp_path: Path) -> None:
    project = parse_project({"name": "study", "server": {"host": "fl.example.org"},
                             "sites": [{"name": "hospital-a"}, {"name": "hospital-b"}]})
    out = tmp_path / "kits"
    provision(project, out)
    coordinator = yaml.safe_load((out / "server/coordinator.yaml").read_text())
    assert coordinator["coordinator"]["worker_broker_users"] == {"study-hospital-a": ["hospital-a"],
                                                                 "study-hospital-b": ["hospital-b"]}
    overlay = yaml.safe_load((out / "server/k8s/config.yaml").read_text())
    assert overlay["coordinator"]["worker_broker_users"] == coordinator["coordinator"]["worker_broker_users"]
    timeouts = {yaml.safe_load(p.read_text())["broker"]["consumer_timeout_s"]
                for p in (out / "server/coordinator.yaml", out / "server/k8s/config.yaml",
                          out / "sites/hospital-a/worker.yaml")}
    assert timeouts == {14400}
    assert "consumer_timeout = 14400000" in (out / "server/rabbitmq/rabbitmq.conf").read_text()


def test_an_async_update_no_version_holds_is_charged_only_within_what_its_jobs_tasks_were_priced_at(
        tmp_path: Path) -> None:
    """An asynchronous update left out of every version (in the buffer at the close, or past the last version) is
    charged at its header's ε, the site's own word: within what the job's tasks to that site were priced at, as a
    task outcome's claim (control_handler); one above it is refused, counted and never stored. (Before: any header
    ε went into the job's record, and so into the site's recorded ε, which its worker must then match.)"""
    from types import SimpleNamespace

    from fedbroker.coordinator.asynchronous import record_not_aggregated
    from tests.faults.harness import sample

    store = StateStore(str(tmp_path / "c.sqlite"))
    register(store, "w0")
    register(store, "w1")
    store.add_job("j", "j", "{}", 3, "{}")
    bounds = EpsilonBounds(store)
    bounds.note_tasks("j", ["w0", "w1"], time.time() + 60, TRAINING)
    priced = bounds.limit("w0", "j")
    refused = sample("fedbroker_coordinator_epsilon_jumps_refused_total", {"message": "not_aggregated"})
    ctx = SimpleNamespace(store=store, epsilon_bounds=bounds)
    record_not_aggregated(ctx, "j", [  # type: ignore[arg-type]
        (pb.UpdateSummary(worker_id="w0", task=3, epsilon=priced / 2), "in the buffer when it closed"),
        (pb.UpdateSummary(worker_id="w1", task=4, epsilon=1e6), "in the buffer when it closed")])
    assert {p.worker_id: p.epsilon for p in store.participants("j", 0)} == {"w0": pytest.approx(priced / 2)}
    assert store.recorded_epsilon("w1") == 0.0  # the inflated claim reached no record
    assert sample("fedbroker_coordinator_epsilon_jumps_refused_total", {"message": "not_aggregated"}) == refused + 1
    store.close()
