"""Chaos: PostgreSQL killed -9 and restarted mid-round under a coordinator on a shared database (issue 35). A
private PostgreSQL server the test owns, one coordinator process electing itself on it (as in a two-replica
deployment), the machine's RabbitMQ under a namespace of the test's own, the aggregation service and two DP workers
in this process, a three-round job. The server's postmaster and backends are killed while round 2 is open (every site holds its task), and
started again (crash recovery from its WAL).

Checked: the coordinator rode the outage out (still running, still leading: the lease outlives the outage), the
job finished with every round closed once holding every participant's update (none lost, none counted twice),
and each participant's ε equal to its own ledger's. Measured and printed (never asserted): the outage (kill →
server back) and kill → the coordinator's first write after it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ha.coordinators import Federation, until
from tests.postgres_node import PostgresNode, private_postgres

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

LEASE_TTL_S = 30.0   # longer than the restart: a lease that outlives the outage keeps the leader leading


@pytest.fixture
def node() -> Iterator[PostgresNode]:
    with private_postgres() as started:
        yield started


@pytest.fixture
def federation(rabbitmq_url: str, node: PostgresNode, tmp_path: Path) -> Iterator[Federation]:
    fed = Federation(rabbitmq_url, node.url, tmp_path)
    try:
        yield fed
    finally:
        fed.close()


def test_a_postgres_restart_mid_round_costs_the_job_nothing(
        federation: Federation, node: PostgresNode, record_property: pytest.RecordProperty) -> None:
    fed = federation
    fed.spawn_coordinator("coordinator", lease_ttl_s=LEASE_TTL_S)
    fed.start_workers()
    until(fed.leader, what="the coordinator to lead", within_s=90, logs=fed.logs)
    job_id = fed.submit()
    until(fed.holding, what="every site to hold its task of round 2", within_s=120, logs=fed.logs)

    killed_at = time.time()
    node.kill()
    fed.held.release.set()   # the sites train and upload while the database is down
    node.start()
    back_at = time.time()
    first_write = until(lambda: (w := fed.last_write(job_id)) > back_at and w,
                        what="the coordinator's first write after the restart", within_s=60, logs=fed.logs)
    until(lambda: fed.job_ended(job_id), what="the job to end", within_s=180, logs=fed.logs)

    report = fed.check_books(job_id)
    fed.processes["coordinator"].poll()
    assert fed.processes["coordinator"].returncode is None, "the coordinator did not ride the outage out"
    assert fed.leader() == "coordinator"
    outage = {"outage_s": round(back_at - killed_at, 2), "kill_to_first_write_s": round(first_write - killed_at, 2),
              **report}
    print(f"postgres restart: {json.dumps(outage)}")
    record_property("postgres_restart", json.dumps(outage))
