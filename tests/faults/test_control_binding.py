"""Control messages bound to their senders, and ε claims bounded by the tasks issued: against the real RabbitMQ
and a real coordinator and workers. Bound senders run as guest on the machine's broker (nothing on it is
reconfigured: guest speaks for one worker) and with per-participant broker users on the session's private node, as
the kits deploy them; a forged claim on a shared user runs shared, which is its point; the rest runs provisioned.

The breaks (issue "Hardening, third pass", item 2; "fourth pass", items 6 and 7): a heartbeat published for `w0`
with a high ε was recorded (the fourth pass: one within the bound of its open tasks), and from then on the real
worker refused every task (its ledger holds less), for good; and `workers reset-epsilon` took a ledger emptied of
jobs below what the coordinator's own participant rows held.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from fedbroker.app.cli import main
from fedbroker.bus import Topology, envelope
from fedbroker.config import DPPolicy
from fedbroker.coordinator.store import StateStore
from fedbroker.proto import fedbroker_pb2 as pb
from tests.faults.harness import BUS_USERS, Federation, HoldsNth, Training, job, sample, wait_for
from tests.rabbitmq_node import PrivateRabbitMQ

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

DP = DPPolicy(enabled=True, noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5, epsilon_budget=50.0)


def registration(worker_id: str, epsilon: float) -> bytes:
    return envelope.encode(registration=pb.Registration(
        worker_id=worker_id, categories=["digits"], label_histogram=[10] * 10, device="cpu", num_samples=100,
        epsilon_spent=epsilon))


def heartbeat(worker_id: str, epsilon: float) -> bytes:
    return envelope.encode(heartbeat=pb.Heartbeat(worker_id=worker_id, epsilon_spent=epsilon, state="idle"))


def rejected(reason: str) -> float:
    return sample("fedbroker_coordinator_control_messages_rejected_total", {"reason": reason})


def decreases() -> float:
    return sample("fedbroker_coordinator_epsilon_decreases_total", {"message": "heartbeat"})


def jumps(message: str) -> float:
    return sample("fedbroker_coordinator_epsilon_jumps_refused_total", {"message": message})


@pytest.fixture(params=BUS_USERS)
def bound_federation(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Federation]:
    """guest: the guest user speaks for w0 only, w1 is a site with a broker user of its own (`site-w1`);
    provisioned: each site its own broker user, bound to its worker id as a kit's coordinator.yaml binds it."""
    if request.param == "guest":
        fed = Federation(request.getfixturevalue("rabbitmq_url"), tmp_path,
                         worker_broker_users={"guest": ["w0"], "site-w1": ["w1"]})
    else:
        node: PrivateRabbitMQ = request.getfixturevalue("private_rabbitmq")
        fed = Federation(node.url, tmp_path, users=node)
    try:
        yield fed
    finally:
        fed.close()


def test_a_registration_for_another_sites_worker_is_refused_dead_lettered_and_counted(
        bound_federation: Federation, training: Training) -> None:
    fed = bound_federation
    fed.add_worker("w0", index=0, count=2)  # its user (guest, or its own) may speak for w0: its messages pass
    wait_for(lambda: [w.worker_id for w in fed.store.workers()] == ["w0"], 30, "w0 to register")
    foreign, anonymous = rejected("foreign_sender"), rejected("unidentified_sender")
    sender = fed.bus_for("w0")
    try:  # w0's credentials speaking for w1: refused, never stored
        sender.publish_control(registration("w1", 1e6))
        sender.publish_control(heartbeat("w1", 1e6))
        wait_for(lambda: rejected("foreign_sender") == foreign + 2, 30, "both forgeries to be refused")
    finally:
        sender.close()
    # a message without user_id (a client that sets none) is bound to nobody: refused too
    connection = pika.BlockingConnection(pika.URLParameters(fed.url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(Topology(fed.namespace).control_exchange, "coordinator", heartbeat("w0", 0.0),
                              pika.BasicProperties(delivery_mode=2), mandatory=True)
        wait_for(lambda: rejected("unidentified_sender") == anonymous + 1, 30, "the anonymous heartbeat to be refused")
        # and RabbitMQ itself refuses a user_id that is not the connection's user: nobody can claim site-w1's
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="user_id property set to 'site-w1'"):
            channel.basic_publish(Topology(fed.namespace).control_exchange, "coordinator", registration("w1", 0.0),
                                  pika.BasicProperties(user_id="site-w1"), mandatory=True)
    finally:
        connection.close()
    assert [w.worker_id for w in fed.store.workers()] == ["w0"]
    dead = [envelope.decode(body, expect=("registration", "heartbeat")) for body, _ in fed.dead_letters()]
    assert sorted(e.WhichOneof("message") + ":" + getattr(e, e.WhichOneof("message")).worker_id for e in dead) == [
        "heartbeat:w0", "heartbeat:w1", "registration:w1"]
    job_id = fed.submit(job(training={"rounds": 1}, schedule={"min_workers": 1}))
    fed.wait_job(job_id, 60)


def test_a_forged_epsilon_claim_on_a_shared_broker_user_never_locks_the_site_out(
        federation: Federation, training: Training) -> None:
    """Shared broker users on purpose: this is the demo's and deploy/k8s/base's deployment, where control messages
    cannot be bound to their senders, so no per-participant run would show it (that one is
    test_a_registration_for_another_sites_worker_is_refused_dead_lettered_and_counted[provisioned]).
    One broker user shared by everyone (guest: no binding possible, as in the demo and deploy/k8s/base). After
    w0's first job, a forged heartbeat claims 1.5× its ledger's ε: within what the tasks just issued to it could
    have cost, so the old bound accepted it and w0 refused every later job (its ledger holds less), across
    restarts. A claim is advisory now: the record stays what the coordinator priced, and w0 is selected and trains
    after a restart. A forged outcome claiming ε for the job beyond its priced tasks is refused and counted."""
    fed = federation
    agent = fed.add_worker("w0", index=0, count=2, dp=DP)
    first = fed.submit(job(training={"rounds": 1}, schedule={"min_workers": 1}))
    fed.wait_job(first, 120)
    spent = agent.ledger.total_epsilon()
    assert spent > 0 and fed.store.recorded_epsilon("w0") == pytest.approx(spent)
    jumped, fell = jumps("task_outcome"), decreases()
    sender = fed.bus_for()
    try:
        sender.publish_control(heartbeat("w0", 1.5 * spent))
        sender.publish_control(heartbeat("w0", 1e6))
        sender.publish_control(envelope.encode(task_outcome=pb.TaskOutcome(
            job_id=first, round=1, worker_id="w0", status=pb.TaskOutcome.FAILED, reason="forged", epsilon=1e6)))
        sender.publish_control(heartbeat("w0", 0.0))  # below the record: logged and counted, so we see it handled
        wait_for(lambda: decreases() >= fell + 1, 30, "the forged messages to be handled")
    finally:
        sender.close()
    assert jumps("task_outcome") == jumped + 1
    assert fed.store.recorded_epsilon("w0") == pytest.approx(spent)  # no claim stored
    fed.stop_coordinator()
    fed.start_coordinator()
    second = fed.submit(job(training={"rounds": 2}, schedule={"min_workers": 1}))
    fed.wait_job(second, 180)
    assert [p.status for p in fed.store.participants(second)] == ["aggregated", "aggregated"]
    assert agent.ledger.epsilon(second) > 0
    wait_for(lambda: fed.store.recorded_epsilon("w0") == pytest.approx(agent.ledger.total_epsilon()), 30,
             "w0's ε after its second job to be recorded")


def test_reset_epsilon_corrects_a_forged_record_from_the_sites_ledger_and_audits_it(
        private_rabbitmq: PrivateRabbitMQ, tmp_path: Path, training: Training,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A record forged before this version (1e6 for w0) locks w0 out; the operator stops the coordinator and
    corrects it from w0's ledger (which names w0), never below what that ledger holds; the correction is
    audited, and w0 trains again once the coordinator is back. With per-participant broker users, as a kit runs."""
    fed = Federation(private_rabbitmq.url, tmp_path, users=private_rabbitmq)
    try:
        agent = fed.add_worker("w0", index=0, count=2, dp=DP)
        first = fed.submit(job(training={"rounds": 1}, schedule={"min_workers": 1}))
        fed.wait_job(first, 120)
        fed.stop_coordinator()
        fed.store.close()
        with sqlite3.connect(tmp_path / "coordinator.sqlite") as db:  # what an older version's forged beat left
            db.execute("UPDATE workers SET epsilon_spent = 1e6 WHERE worker_id = 'w0'")
        ledger = agent.ledger.path
        spent = agent.ledger.total_epsilon()
        doc = json.loads(Path(ledger).read_text())
        other, emptied = tmp_path / "other-ledger.json", tmp_path / "emptied-ledger.json"
        other.write_text(json.dumps({**doc, "worker_id": "w9"}))
        emptied.write_text(json.dumps({**doc, "jobs": {}}))  # w0's own ledger, its job taken out
        state = str(tmp_path)

        assert main(["workers", "reset-epsilon", "w0", "--ledger", str(other), "--state-dir", state]) == 2
        assert "ledger of worker 'w9', not of 'w0'" in capsys.readouterr().err
        # a ledger emptied of jobs: below what the coordinator's own participant rows priced for w0
        assert main(["workers", "reset-epsilon", "w0", "--ledger", str(emptied), "--state-dir", state]) == 2
        err = capsys.readouterr().err
        assert f"the ε {0:.6g} to record is below the ε {spent:.6g} this coordinator recorded" in err
        assert main(["workers", "reset-epsilon", "w0", "--ledger", str(emptied), "--state-dir", state,
                     "--epsilon", str(spent / 2)]) == 2
        assert f"the ε {spent / 2:.6g} to record is below the ε {spent:.6g}" in capsys.readouterr().err
        assert main(["workers", "reset-epsilon", "w0", "--ledger", ledger, "--state-dir", state,
                     "--epsilon", str(spent / 2)]) == 2
        assert "below the ε" in capsys.readouterr().err
        assert main(["workers", "reset-epsilon", "w0", "--ledger", ledger, "--state-dir", state, "--by", "alice",
                     "--note", "forged heartbeat"]) == 0
        assert "recorded ε 1e+06 →" in capsys.readouterr().out
        assert main(["workers", "corrections", "--state-dir", state, "--json"]) == 0
        (audit,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert (audit["worker_id"], audit["by"], audit["old"], audit["note"]) == ("w0", "alice", 1e6, "forged heartbeat")
        assert audit["new"] == audit["ledger_epsilon"] == pytest.approx(spent)

        fed.store = StateStore(str(tmp_path / "coordinator.sqlite"))
        assert fed.store.recorded_epsilon("w0") == pytest.approx(spent)
        fed.start_coordinator()
        second = fed.submit(job(training={"rounds": 1}, schedule={"min_workers": 1}))
        fed.wait_job(second, 120)
        assert [p.status for p in fed.store.participants(second)] == ["aggregated"]
    finally:
        fed.close()


def test_an_async_jobs_record_keeps_the_epsilon_of_trainings_refused_as_stale(
        provisioned_federation: Federation, training: Training) -> None:
    """The slow worker's updates are always stale (buffer of one, no staleness allowed, the fast worker
    publishes a version first): each is refused after its training spent ε. The job's record (`jobs show`: the
    largest ε per worker) must still say what the job cost the slow worker's owner: its ledger's ε for it.
    Provisioned: the failed outcomes come from the slow worker's own broker user."""
    fed = provisioned_federation
    held = HoldsNth.nth(1)  # the slow worker's first task waits until the fast worker has published a version:
    fed.add_worker("fast", index=0, count=2, dp=DP)  # its update is then stale by construction, not by timing
    slow = fed.add_worker("slow", index=1, count=2, dp=DP, agent_class=held)
    job_id = fed.submit(job(training={"rounds": 6}, schedule={
        "mode": "async", "buffer_size": 1, "max_staleness": 0, "min_workers": 2}))
    wait_for(lambda: "slow" in held.holding and fed.book.buffer_status(job_id)[0] >= 1, 300,
             "the fast worker's first version, the slow worker holding its first task")
    held.release.set()
    fed.wait_job(job_id, 600)
    spent = slow.ledger.epsilon(job_id)
    assert spent > 0

    def recorded() -> float:
        return max((p.epsilon or 0.0 for p in fed.store.participants(job_id) if p.worker_id == "slow"), default=0.0)

    wait_for(lambda: recorded() == pytest.approx(spent), 300, "the slow worker's ε to be in the job's record")
    # an async job keeps a worker's trainings that were not aggregated in its row of round 0, written when the
    # worker's failed outcome arrives: the ε above may already be in the record from a later aggregated update

    def refused_row() -> list[Any]:
        return [p for p in fed.store.participants(job_id) if p.worker_id == "slow" and p.round == 0]

    wait_for(lambda: bool(refused_row()), 300, "the slow worker's refused training in the job's record")
    (row,) = refused_row()
    assert row.status == "failed" and "not aggregated" in row.reason
    assert any(e.kind == "failed" and "trained, not aggregated" in e.message for e in fed.store.events(job_id))
