"""`fedbroker jobs show` says what the job's sites shared before round 1 and the job's data section (table and
--json), from the coordinator's events."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from fedbroker.app import jobs
from fedbroker.proto import fedbroker_pb2 as pb

SPEC = {"name": "std", "category": "c", "model": {"input_shape": [2], "layers": [{"type": "Linear", "in_features": 2,
                                                                                  "out_features": 2}]},
        "data": {"standardize": "federated", "bounds": [0, 10]}}


class FakeClient:
    def status(self, job_id: str) -> pb.StatusReply:
        reply = pb.StatusReply()
        reply.jobs.add(job_id=job_id, name="std", status="running", category="c", spec_json=json.dumps(SPEC))
        return reply

    def events(self, job_id: str, **_: Any) -> list[pb.JobEvent]:
        return [pb.JobEvent(job_id=job_id, seq=1, kind="submitted", message="1 round(s)"),
                pb.JobEvent(job_id=job_id, seq=2, kind="share_requested", message="feature statistics asked of 2 site(s)"),
                pb.JobEvent(job_id=job_id, seq=3, kind="not_shared", worker_id="b", message="refused (no): not selected"),
                pb.JobEvent(job_id=job_id, seq=4, kind="statistics_agreed", message="mean and std of 2 feature(s)"),
                pb.JobEvent(job_id=job_id, seq=5, kind="round_opened", round=1, message="1 participant(s)")]

    def __enter__(self) -> FakeClient:  # the CLI holds its client in a `with` block
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_jobs_show_lists_what_was_shared_and_the_data_section(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(jobs, "client", lambda args: FakeClient())
    assert jobs.cmd_show(argparse.Namespace(job_id="std-1", json=False)) == 0
    out = capsys.readouterr().out
    assert "standardised  mean and std of 2 feature(s)" in out
    assert "sharing       b: refused (no): not selected" in out
    assert 'data          standardize federated, bounds [0, 10]' in out
    assert "round_opened" not in out and "1 participant" not in out
    assert jobs.cmd_show(argparse.Namespace(job_id="std-1", json=True)) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [e["kind"] for e in doc["sharing"]] == ["share_requested", "not_shared", "statistics_agreed"]
    assert doc["spec"]["data"] == SPEC["data"]
