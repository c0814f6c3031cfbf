"""`fedbroker jobs show` lists the uploads a robust rule discarded or down-weighted, with the coordinator's note."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from fedbroker.app import jobs
from fedbroker.proto import fedbroker_pb2 as pb


class FakeClient:
    def __init__(self, reply: pb.StatusReply) -> None:
        self.reply = reply

    def status(self, _job_id: str) -> pb.StatusReply:
        return self.reply

    def events(self, _job_id: str) -> list[Any]:
        return []

    def __enter__(self) -> FakeClient:  # the CLI holds its client in a `with` block
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_jobs_show_names_the_site_a_robust_rule_discarded(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    reply = pb.StatusReply()
    reply.jobs.add(job_id="j-1", status="running", rounds_done=1, rounds_total=3, spec_json=json.dumps({}))
    reply.rounds.add(job_id="j-1", round=1, status="closed", participants=3, uploaded=3, aggregated=2)
    reply.participants.add(job_id="j-1", round=1, worker_id="hospital-a", status="aggregated")
    reply.participants.add(job_id="j-1", round=1, worker_id="hospital-b", status="aggregated")
    reply.participants.add(job_id="j-1", round=1, worker_id="hospital-c", status="uploaded",
                           reason="multi_krum discarded its update (0% of its share)")
    monkeypatch.setattr(jobs, "client", lambda _args: FakeClient(reply))
    assert jobs.cmd_show(argparse.Namespace(job_id="j-1", json=False)) == 0
    out = capsys.readouterr().out
    section = out.split("UPLOADS WITH A NOTE", 1)[1].split("\n\n", 1)[0]
    assert "hospital-c" in section and "multi_krum discarded its update (0% of its share)" in section
    assert "hospital-a" not in section
