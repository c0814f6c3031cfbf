"""Registrations on the control queue, against the real broker and real workers (issue 12, item 4).

An invalid registration (a worker id the bus cannot route to) is dead-lettered with a metric reason and
never stored, so it can never be selected and fail a running job. A valid registration of a worker that
never consumes gets its task queue declared when it is accepted: its task waits there, it is a straggler,
and the other workers get their tasks at once (before, its unroutable task was retried until the round's
deadline, and the tasks after it in the publishing order were never sent). Each runs as guest and with
per-participant broker users (`each_federation`)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from fedbroker.bus import envelope
from fedbroker.proto import fedbroker_pb2 as pb
from tests.faults.harness import Federation, Training, job, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def registration(worker_id: str, **fields: object) -> bytes:
    values: dict[str, object] = {"worker_id": worker_id, "categories": ["digits"], "label_histogram": [10] * 10,
                                 "device": "cpu", "num_samples": 100, **fields}
    return envelope.encode(registration=pb.Registration(**values))  # type: ignore[arg-type]


def rejected(reason: str) -> float:
    return REGISTRY.get_sample_value("fedbroker_coordinator_control_messages_rejected_total",
                                     {"reason": reason}) or 0.0


def test_an_invalid_registration_is_dead_lettered_never_stored_and_the_job_completes(
        each_federation: Federation, training: Training) -> None:
    fed = each_federation
    fed.add_worker("w0", index=0, count=2)
    fed.add_worker("w1", index=1, count=2)
    sender = fed.bus_for("sender")  # a site's bus (in provisioned mode, a site's own broker user)
    before = rejected("invalid_registration")
    try:
        sender.publish_control(registration("evil id"))
        sender.publish_control(registration("w9", num_samples=10**15))
        wait_for(lambda: rejected("invalid_registration") == before + 2, 30, "both registrations to be refused")
    finally:
        sender.close()
    assert {w.worker_id for w in fed.store.workers()} == {"w0", "w1"}
    job_id = fed.submit(job(training={"rounds": 1}))
    fed.wait_job(job_id, 60)
    assert {p.worker_id for p in fed.store.participants(job_id)} == {"w0", "w1"}
    dead = sorted(envelope.decode(body, expect=("registration",)).registration.worker_id for body, _ in fed.dead_letters())
    assert dead == ["evil id", "w9"]


def test_a_registered_worker_without_a_consumer_is_a_straggler_and_the_others_get_their_tasks(
        each_federation: Federation, training: Training) -> None:
    fed = each_federation
    fed.worker_ids.add("ghost")  # its queue is removed with the namespace
    sender = fed.bus_for("ghost")  # the ghost site's bus (in provisioned mode, its own broker user)
    try:  # sorts before w0 and w1: published first
        sender.publish_control(registration("ghost"))
        wait_for(lambda: any(w.worker_id == "ghost" for w in fed.store.workers()), 30, "the ghost to register")
    finally:
        sender.close()
    fed.add_worker("w0", index=0, count=2)
    fed.add_worker("w1", index=1, count=2)
    # three selected, two needed to close: the round must not wait for the ghost's task, nor its deadline
    # (NEVER_S: only the quorum can close it within this wait, however slow the machine)
    job_id = fed.submit(job(training={"rounds": 1}, schedule={"min_workers": 3, "quorum": 2, "min_clients": 2}))
    fed.wait_job(job_id, 60)
    statuses = {p.worker_id: p.status for p in fed.store.participants(job_id, 1)}
    assert statuses == {"ghost": "missed", "w0": "aggregated", "w1": "aggregated"}
