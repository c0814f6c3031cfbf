"""Workers' presence at the aggregation service, end to end: `fedbroker aggregator` with a token table and two
`fedbroker worker` processes, each on its own broker user of a private RabbitMQ node as a kit deploys them, no
coordinator and no job. The honest worker beats `KeepAlive` as itself from the start, when the service says
(`heartbeat_interval_s` 2 here), and the service's `fedbroker_aggregator_workers_present` gauge and accepted
heartbeats rise for it; a site whose token names w1 but which runs as w2 is refused every beat (`forged`), is
never counted present, and its own counter says `refused` (deploy/SECURITY.md, "Workers' presence heartbeats").
The RPC's own refusal of a forged id is pinned in tests/aggregators/test_aio_control_plane.py."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.processes import Deployment
from tests.rabbitmq_node import PrivateRabbitMQ, free_ports
from tests.security.conftest import write_table

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WORKERS = ["w1", "w2"]


@pytest.fixture
def deployment(private_rabbitmq: PrivateRabbitMQ, tmp_path: Path) -> Iterator[Deployment]:
    with Deployment(private_rabbitmq.url, tmp_path, name="presence", worker_ids=WORKERS, users=private_rabbitmq) as d:
        yield d


def scrape(port: int) -> dict[str, float]:
    """One process's /metrics as {series with labels: value} (empty while it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return {}
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([^#\s]\S*) (\S+)$", text, re.M)}


def worker_settings(d: Deployment, worker: str, *, token_file: Path, metrics_port: int) -> dict[str, Any]:
    return {"worker.id": worker, "worker.ledger_path": str(d.tmp / f"{worker}-ledger.json"), "worker.device": "cpu",
            "worker.torch_threads": 1, "worker.metrics_port": metrics_port, "worker.metrics_addr": "127.0.0.1",
            "client.token_file": str(token_file)}


def test_a_worker_process_is_present_at_the_service_and_one_beating_as_another_is_not(deployment: Deployment):
    d = deployment
    tokens = write_table(d.tmp / "tokens.yaml", {"coordinator": "coordinator", "w1": "worker", "w2": "worker"})
    (d.tmp / "w1.token").write_text(tokens["w1"])
    service_port, w1_port, w2_port = free_ports(3)
    d.spawn("aggregator", "aggregator", {"aggregator.listen": d.aggregator, "aggregator.tokens_file": d.tmp / "tokens.yaml",
                                         "aggregator.metrics_port": service_port, "aggregator.metrics_addr": "127.0.0.1",
                                         "aggregator.heartbeat_interval_s": 2})
    d.spawn("w1", "worker", worker_settings(d, "w1", token_file=d.tmp / "w1.token", metrics_port=w1_port))
    # a dishonest site: w1's token, run as w2 (its broker user is w2's, so only the aggregation service can tell)
    d.spawn("w2", "worker", worker_settings(d, "w2", token_file=d.tmp / "w1.token", metrics_port=w2_port))

    accepted = 'fedbroker_aggregator_heartbeats_total{outcome="accepted"}'
    forged = 'fedbroker_aggregator_heartbeats_total{outcome="forged"}'
    present = "fedbroker_aggregator_workers_present"
    service = d.wait_for(lambda: (m := scrape(service_port)).get(accepted, 0) >= 3 and m.get(present) == 1
                         and m.get(forged, 0) >= 1 and m, 150, "w1's beats counted, w2's refused")
    w1 = d.wait_for(lambda: (m := scrape(w1_port)).get(
        'fedbroker_worker_presence_beats_total{outcome="accepted",worker_id="w1"}', 0) >= 2 and m, 60, "w1's counter")
    w2 = d.wait_for(lambda: (m := scrape(w2_port)).get(
        'fedbroker_worker_presence_beats_total{outcome="refused",worker_id="w2"}', 0) >= 1 and m, 60, "w2's counter")
    assert w1['fedbroker_worker_presence_beats_total{outcome="refused",worker_id="w1"}'] == 0
    assert w2['fedbroker_worker_presence_beats_total{outcome="accepted",worker_id="w2"}'] == 0
    # never present: a refused beat records no row, and w2 waits the longest before trying again (no flood)
    assert service[present] == 1 and scrape(service_port)[present] <= 1
    assert scrape(service_port).get(forged, 0) <= 2
    d.alive()
