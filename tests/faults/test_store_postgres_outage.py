"""The coordinator's store on PostgreSQL when the server dies (deploy/SECURITY.md, "HA: the coordinator's store"):
against a private server killed with SIGKILL, every write fails as `StateUnavailable` (nothing of it recorded) and
every read too, the store never hangs, and a job's thread (`retrying_writes`) rides the outage out: its write lands
once the server is back, on fresh connections (the pool's pre-ping drops the dead ones)."""

from __future__ import annotations

import time

import pytest

from fedbroker.coordinator.store import StateStore, StateUnavailable
from tests.postgres_node import private_postgres

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_a_killed_postgresql_fails_writes_cleanly_and_a_jobs_thread_rides_the_outage_out() -> None:
    with private_postgres() as node:
        store = StateStore.from_url(node.url, busy_timeout_s=5.0)
        try:
            store.add_job("before", "before", "{}", 2, "{}")
            store.open_round("before", 1, ["w0", "w1"], deadline=1.0)
            node.kill()
            started = time.monotonic()
            with pytest.raises(StateUnavailable, match="could not record job 'lost'.*rolled back"):
                store.add_job("lost", "lost", "{}", 1, "{}")
            with pytest.raises(StateUnavailable, match="could not be read"):
                store.jobs()
            assert time.monotonic() - started < 60  # refused, never hung on a dead server

            tries: list[float] = []

            def sleep(seconds: float) -> None:  # the server comes back while the job's thread waits to retry
                tries.append(seconds)
                if len(tries) == 2:
                    node.start()

            with store.retrying_writes(for_s=120, sleep=sleep):
                store.close_round("before", 1, model_version=2, aggregated=["w0"], updates=[("w0", 3, 0.5, 0.1)],
                                  accuracy=None, loss=None, seconds=1.0, checkpoint="c", stats={},
                                  model_spec_json="{}")
            assert len(tries) >= 2
            assert [j.job_id for j in store.jobs()] == ["before"]  # the failed write left nothing
            assert store.job("before").rounds_done == 1  # type: ignore[union-attr]
            assert [(p.worker_id, p.status) for p in store.participants("before", 1)] == [
                ("w0", "aggregated"), ("w1", "missed")]
            assert [e.kind for e in store.events("before")].count("round_closed") == 1
        finally:
            store.close()
