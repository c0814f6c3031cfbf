"""Chaos: kill -9 of the leading coordinator mid-round (issue 35, item 3). Two coordinator processes on one
PostgreSQL (a database of its own on the machine's server), the machine's RabbitMQ under a namespace of the test's
own, the aggregation service, two DP workers, a three-round job. The leader is killed while round 2 is open (every site holds its task); the
standby takes the lease, resumes the job at that round and finishes it.

Checked: every round opened and closed once (the open round keeps its start and participants across the
takeover; versions follow one another), every participant's ε recorded once and equal to its own ledger's (none
under-recorded), the standby answered `standby` before and the CLI's client reached whichever led. Measured and
printed (never asserted): kill → lease taken, and kill → the new leader's first write."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from sqlalchemy import select

from fedbroker.coordinator import tables as t
from fedbroker.coordinator.service import CoordinatorClient
from fedbroker.rpc.plumbing import reason_of
from tests.ha.coordinators import LEASE_TTL_S, Federation, until
from tests.postgres_node import scratch_database

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture
def federation(rabbitmq_url: str, tmp_path: Path) -> Iterator[Federation]:
    with scratch_database() as url:
        fed = Federation(rabbitmq_url, url, tmp_path)
        try:
            yield fed
        finally:
            fed.close()


def answers_standby(address: str) -> bool:
    with CoordinatorClient(address, timeout_s=5) as c:
        try:
            c.status()
        except grpc.RpcError as refused:
            return reason_of(refused) == "standby"
    return False


def test_the_standby_takes_over_mid_round_and_the_job_finishes_with_every_round_and_epsilon_once(
        federation: Federation, record_property: pytest.RecordProperty) -> None:
    fed = federation
    fed.spawn_coordinator("one")
    fed.spawn_coordinator("other")
    fed.start_workers()
    leader = until(fed.leader, what="a coordinator to lead", within_s=90, logs=fed.logs)
    standby = next(name for name in fed.addresses if name != leader)
    until(lambda: answers_standby(fed.addresses[standby]), what="the other coordinator to stand by", within_s=90,
          logs=fed.logs)
    job_id = fed.submit()   # through the CLI's client, which passes over the standby

    until(fed.holding, what="every site to hold its task of round 2", within_s=120, logs=fed.logs)
    with fed.engine.connect() as conn:
        before = conn.execute(select(t.rounds.c.started, t.rounds.c.deadline).where(
            t.rounds.c.job_id == job_id, t.rounds.c.round == 2)).one()
    killed_at = time.time()
    fed.kill(leader)
    dead_at = time.time()
    fed.held.release.set()   # the sites train and upload while no coordinator leads
    until(lambda: fed.leader() == standby, what="the standby to take the lease", within_s=60, logs=fed.logs)
    taken_s = time.time() - killed_at
    first_write = until(lambda: (w := fed.last_write(job_id)) > dead_at and w, what="the new leader's first write",
                        within_s=60, logs=fed.logs)
    until(lambda: fed.job_ended(job_id), what="the job to end", within_s=180, logs=fed.logs)

    report = fed.check_books(job_id)
    with fed.engine.connect() as conn:
        after = conn.execute(select(t.rounds.c.started, t.rounds.c.deadline).where(
            t.rounds.c.job_id == job_id, t.rounds.c.round == 2)).one()
    assert after.started == before.started, "round 2 was opened again after the takeover"
    with fed.client() as c:   # the CLI reaches the new leader through the dead one's address first
        assert c.status(job_id).jobs[0].status == "completed"
    failover = {"lease_ttl_s": LEASE_TTL_S, "kill_to_lease_taken_s": round(taken_s, 2),
                "kill_to_first_write_s": round(first_write - killed_at, 2), **report}
    print(f"coordinator failover: {json.dumps(failover)}")
    record_property("coordinator_failover", json.dumps(failover))
