"""A job's round count as the CLI prints it (`jobs show`, `jobs list`, `status`), from a state store holding what
a lost secure round leaves: round 1 abandoned and re-opened as round 2 (coordinator/secure_reopen.py), so the
job row says 2 rounds done of 1 configured. The CLI says 1 of 1 completed, and that one was abandoned and
re-opened; a cancelled job's abandoned open round is said apart."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedbroker.app import jobs
from fedbroker.app.status import render
from fedbroker.coordinator.service import status_reply
from fedbroker.coordinator.store import StateStore
from fedbroker.proto import fedbroker_pb2 as pb


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    s = StateStore(str(tmp_path / "coordinator.sqlite"))
    yield s
    s.close()


def close(store: StateStore, job_id: str, round_number: int) -> None:
    store.close_round(job_id, round_number, model_version=round_number + 1, aggregated=["a", "b"],
                      updates=[("a", 10, 0.1, 0.5), ("b", 10, 0.1, 0.5)], accuracy=None, loss=None, seconds=1.0,
                      checkpoint="", stats={}, model_spec_json="{}")


def lost_and_reopened(store: StateStore) -> None:
    """Job `lost`: 1 round configured; round 1 lost at the service, abandoned, round 2 closed in its place."""
    store.add_job("lost", "secure", "{}", 1, "{}")
    store.open_round("lost", 1, ["a", "b"])
    store.abandon_round("lost", 1, 2.0, why="round lost at the service; re-opened as round 2 from version 1")
    store.open_round("lost", 2, ["a", "b"])
    close(store, "lost", 2)


def cancelled_while_open(store: StateStore) -> None:
    """Job `cut`: 3 rounds configured; round 1 closed, round 2 open when the job was cancelled."""
    store.add_job("cut", "plain", "{}", 3, "{}")
    store.open_round("cut", 1, ["a", "b"])
    close(store, "cut", 1)
    store.open_round("cut", 2, ["a", "b"])
    assert store.cancel_job("cut", by="alice", round_number=2)


class StoreClient:
    """The coordinator's status reply, read from `store` as its service reads it; no events."""

    def __init__(self, store: StateStore) -> None:
        self.coordinator = SimpleNamespace(store=store, waiting=lambda job_id: "")

    def status(self, job_id: str = "") -> pb.StatusReply:
        return status_reply(self.coordinator, job_id)  # type: ignore[arg-type]

    def events(self, job_id: str) -> list[pb.JobEvent]:
        return []

    def __enter__(self) -> StoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_a_reopened_secure_round_is_counted_once_and_said(store: StateStore, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    lost_and_reopened(store)
    row = store.job("lost")
    assert row is not None and (row.rounds_done, row.rounds_total) == (2, 1)  # the state that printed "2/1"
    monkeypatch.setattr(jobs, "client", lambda args: StoreClient(store))
    assert jobs.cmd_show(argparse.Namespace(job_id="lost", json=False)) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("rounds ")]
    assert line.split(None, 1)[1] == "1/1 (1 abandoned and re-opened)"
    assert jobs.cmd_list(argparse.Namespace(json=False)) == 0
    (listed,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("lost ")]
    assert "1/1 (1 abandoned and re-opened)" in listed and "2/1" not in listed


def test_an_abandoned_last_round_is_not_called_reopened_and_plain_jobs_read_as_before(store: StateStore) -> None:
    lost_and_reopened(store)
    cancelled_while_open(store)
    store.add_job("fresh", "plain", "{}", 2, "{}")
    store.open_round("fresh", 1, ["a"])
    close(store, "fresh", 1)
    table = render(StoreClient(store).status(""), workers=False)
    rows = {line.split()[0]: line for line in table.split("ROUNDS", 1)[0].splitlines()[2:] if line.strip()}
    assert "  1/1 (1 abandoned and re-opened)" in rows["lost"]
    assert rows["cut"].split("sync", 1)[1].split("cancelled by")[0].strip() == "1/3 (1 abandoned)"
    assert rows["fresh"].split("sync", 1)[1].strip() == "1/2"
