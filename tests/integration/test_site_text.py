"""A site's text cannot forge the operator's log or terminal, end to end (issue "Hardening, fourth pass", item 11):
a real coordinator process on a RabbitMQ node of the session's own, site `a` with its own broker user, bound to
its worker id as `fedbroker provision` binds it (tests/integration/test_sites.py's deployment).

With site a's credentials, a task outcome is published whose reason is a forged log line (`\\n` and a time stamp),
ANSI and OSC escape sequences and 5 MB of text. Before the fix `coordinator.log` held the forged line as a line
of its own and the 5 MB, and `jobs show` printed the escapes raw.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedbroker.bus import envelope, open_bus
from fedbroker.coordinator.control import MAX_REASON_CHARS
from fedbroker.printable import printable
from fedbroker.proto import fedbroker_pb2 as pb
from tests.faults.harness import job
from tests.integration.test_sites import Deployment, until, url_of
from tests.rabbitmq_node import PrivateRabbitMQ

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FORGED_LINE = "2026-01-01 00:00:00,000 CRITICAL fedbroker.coordinator: the operator's key is FORGED"
REASON = "training failed\n" + FORGED_LINE + "\r\x1b[2J\x1b[31m\x1b]0;owned\x07\u202e" + "A" * 5_000_000


@pytest.fixture
def deployment(private_rabbitmq: PrivateRabbitMQ, tmp_path: Path) -> Iterator[Deployment]:
    d = Deployment(private_rabbitmq, tmp_path)
    try:
        yield d
    finally:
        d.close()


def test_a_forged_reason_from_a_site_leaves_no_forged_line_in_the_log_and_is_shown_bounded_and_escaped(
        deployment: Deployment, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    d = deployment
    site = open_bus(url_of(d.node, "site-a"), namespace=d.namespace)
    try:
        site.publish_control(envelope.encode(registration=pb.Registration(
            worker_id="a", categories=["digits"], num_samples=100, device="cpu", input_shape=[1, 8, 8],
            num_classes=10, software_version="0.1.0", started_unix=time.time())))
        site.publish_control(envelope.encode(heartbeat=pb.Heartbeat(worker_id="a", state="idle")))
        until(lambda: d.cli(capsys, "sites", "list", "--json")[1].count('"worker_id": "a"'),
              what="site a registered", processes=tuple(d.processes), logs=d.logs)
        spec = tmp_path / "job.json"
        spec.write_text(json.dumps(job(name="text", training={"rounds": 1}, schedule={"min_workers": 1})))
        code, out = d.cli(capsys, "submit", str(spec))
        assert code == 0, out
        job_id = re.search(r"text-[0-9a-f]{8}", out).group(0)  # type: ignore[union-attr]

        def round_published() -> bool:
            code, out = d.cli(capsys, "jobs", "show", job_id, "--json")
            return code == 0 and any(p["worker_id"] == "a" for p in json.loads(out)["participants"])

        until(round_published, what="round 1 published to site a", processes=tuple(d.processes), logs=d.logs)
        site.publish_control(envelope.encode(task_outcome=pb.TaskOutcome(
            job_id=job_id, round=1, worker_id="a", status=pb.TaskOutcome.FAILED, reason=REASON)))

        def shown() -> str:
            code, out = d.cli(capsys, "jobs", "show", job_id)
            return out if code == 0 and "FORGED" in out else ""

        out = until(shown, what="the failure in jobs show", processes=tuple(d.processes), logs=d.logs)
    finally:
        site.close()
    assert printable(out.replace("\n", "")) == out.replace("\n", ""), "jobs show printed a control character"
    (row,) = [line for line in out.splitlines() if "FORGED" in line]
    assert "training failed " in row and max(len(line) for line in out.splitlines()) < 2 * MAX_REASON_CHARS + 500
    assert not any(line.startswith(FORGED_LINE[:30]) for line in out.splitlines())

    log = (d.logs / "coordinator.log").read_text(errors="replace")
    assert "FORGED" in log  # the failure was logged: as part of its own line only
    assert not any(line.startswith(FORGED_LINE[:30]) for line in log.splitlines()), "a forged line in the log"
    assert "\x1b" not in log and "\u202e" not in log and len(log) < 1_000_000
