"""`fedbroker ledger` on a site: what its ledger holds (totals, budget left, per job, per release, the shared log)
as tables or JSON, read without ever writing the ledger, from the worker's config or its kit; and the
comparison with the coordinator's record. The record itself over gRPC: tests/integration/test_site_ledger.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from fedbroker.app.cli import main
from fedbroker.app.ledger import Agreement, compare
from fedbroker.worker.ledger import PrivacyLedger

POLICY = {"enabled": True, "noise_multiplier": 1.1, "epsilon_budget": 10.0, "delta": 1e-5}


def spend(path: Path, worker_id: str | None = "site-a") -> PrivacyLedger:
    """A ledger as a worker leaves it: two jobs trained, a histogram released twice (a changed data set), and
    what was shared with whom."""
    ledger = PrivacyLedger(str(path), worker_id=worker_id)
    ledger.record("job-1", history=[(1.1, 0.1, 10)], epsilon=1.25)
    ledger.record("job-2", history=[(1.1, 0.1, 20)], epsilon=2.0)
    ledger.record_release("label_histogram", value=[3, 4], epsilon=0.5, source=[3, 3])
    ledger.record_release("label_histogram", value=[4, 4], epsilon=0.5, source=[4, 4])
    ledger.record_release("statistics", value=[7, 9, 11], epsilon=0.25, source=[1, 2, 3])
    ledger.note_shared("job-1", "histogram", epsilon=0.5)
    ledger.note_shared("job-2", "statistics", epsilon=0.25)
    ledger.note_shared("job-2", "evaluation", recipient="coordinator")
    return ledger


def write_config(path: Path, ledger: str, **sections: dict) -> Path:
    path.write_text(yaml.safe_dump({"worker": {"id": "site-a", "ledger_path": ledger, "dp": POLICY}, **sections}))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["ledger", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.mark.parametrize("worker_id", ["site-a", None])  # None: a ledger written before ledgers named their worker
def test_reading_the_ledger_never_writes_it(tmp_path, capsys, worker_id, monkeypatch):
    state = tmp_path / "state"
    spend(state / "ledger.json", worker_id)
    config = write_config(tmp_path / "worker.yaml", "state/ledger.json")
    before = snapshot(state)
    stat = {name: os.stat(state / name).st_mtime_ns for name in before}
    monkeypatch.chdir(tmp_path)
    for argv in (("--config", str(config)), ("--config", str(config), "--json")):
        code, out, _ = run(capsys, *argv)
        assert code == 0 and "site-a" in out
    assert snapshot(state) == before  # the ledger and its mark, byte for byte; nothing added beside them
    assert {name: os.stat(state / name).st_mtime_ns for name in before} == stat


def test_json_holds_totals_budget_jobs_releases_and_the_shared_log(tmp_path, capsys, monkeypatch):
    ledger = spend(tmp_path / "ledger.json")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "--config", str(write_config(tmp_path / "worker.yaml", "ledger.json")), "--json")
    view = json.loads(out)
    assert code == 0
    assert view["worker_id"] == "site-a" and view["ledger_path"] == str(tmp_path / "ledger.json")
    assert view["jobs"] == [{"job_id": "job-1", "epsilon": 1.25}, {"job_id": "job-2", "epsilon": 2.0}]
    assert view["releases"] == [
        {"name": "label_histogram", "epsilon": 1.0, "draw_epsilon": 0.5, "value": [4, 4]},  # both draws count
        {"name": "statistics", "epsilon": 0.25, "draw_epsilon": 0.25, "value": [7, 9, 11]}]
    assert view["epsilon_training"] == 3.25 and view["epsilon_releases"] == 1.25
    assert view["epsilon_total"] == ledger.total_epsilon() == 4.5
    assert view["dp"] == {"enabled": True, "epsilon_budget": 10.0, "delta": 1e-5, "epsilon_left": 5.5}
    assert [(s["job_id"], s["what"], s["epsilon"], s["recipient"]) for s in view["shared"]] == [
        ("job-1", "histogram", 0.5, "coordinator"), ("job-2", "statistics", 0.25, "coordinator"),
        ("job-2", "evaluation", 0.0, "coordinator")]
    assert [s["time_unix"] for s in view["shared"]] == [s.time_unix for s in ledger.shared()]
    assert all(s["time"].startswith("20") for s in view["shared"])
    assert view["coordinator"] is None and view["agreement"]["status"] == "not_asked"  # no coordinator named


def test_the_tables_show_the_same(tmp_path, capsys, monkeypatch):
    spend(tmp_path / "ledger.json")
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "--config", str(write_config(tmp_path / "worker.yaml", "ledger.json")))
    assert code == 0
    assert "ε spent    4.5 (training 3.25, releases 1.25" in out
    assert "budget     10 at δ 1e-05: ε 5.5 left" in out
    lines = out.splitlines()
    assert any(line.split()[:2] == ["job-2", "2"] for line in lines)
    assert any(line.split()[:4] == ["label_histogram", "1", "0.5", "[4,"] for line in lines)
    assert any(line.split()[2:6] == ["job-2", "statistics", "coordinator", "0.25"] for line in lines)
    assert "the coordinator was not asked" in out


def test_a_kit_is_read_from_its_own_folder_wherever_the_command_runs(tmp_path, capsys, monkeypatch):
    kit = tmp_path / "kit"
    spend(kit / "state/ledger.json")
    write_config(kit / "worker.yaml", "state/ledger.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, out, _ = run(capsys, "--kit", str(kit), "--json")
    assert code == 0 and json.loads(out)["epsilon_total"] == 4.5
    assert list(elsewhere.iterdir()) == []


def test_a_policy_without_dp_has_no_budget(tmp_path, capsys, monkeypatch):
    spend(tmp_path / "ledger.json")
    (tmp_path / "worker.yaml").write_text(yaml.safe_dump({"worker": {"id": "site-a", "ledger_path": "ledger.json",
                                                                     "dp": {"enabled": False}}}))
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "--config", "worker.yaml", "--json")
    assert code == 0 and json.loads(out)["dp"] == {"enabled": False, "epsilon_budget": None, "delta": None, "epsilon_left": None}
    assert "DP is off" in run(capsys, "--config", "worker.yaml")[1]


def test_a_missing_ledger_reads_as_nothing_spent_and_is_not_created(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "--config", str(write_config(tmp_path / "worker.yaml", "state/ledger.json")),
                         "--json")
    view = json.loads(out)
    assert code == 0 and view["epsilon_total"] == 0.0 and view["jobs"] == [] and "no ledger file" in view["note"]
    assert not (tmp_path / "state").exists() and err == ""


def test_a_missing_ledger_whose_mark_says_epsilon_was_spent_is_refused(tmp_path, capsys, monkeypatch):
    spend(tmp_path / "ledger.json")
    (tmp_path / "ledger.json").unlink()
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "--config", str(write_config(tmp_path / "worker.yaml", "ledger.json")))
    assert code == 2 and "privacy ledger is missing, but its mark" in err


def test_another_workers_ledger_is_refused_naming_both(tmp_path, capsys, monkeypatch):
    spend(tmp_path / "ledger.json", "site-b")
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "--config", str(write_config(tmp_path / "worker.yaml", "ledger.json")))
    assert code == 2 and "ledger of worker 'site-b', but the config names 'site-a'" in err


@pytest.mark.parametrize("argv, message", [
    ((), "--config/--kit: give the site's worker config"),
    (("--config", "a.yaml", "--kit", "k"), "--config/--kit: give the site's worker config"),
    (("--config", "nowhere.yaml"), "--config: no worker config at nowhere.yaml"),
    (("--kit", "nowhere"), "--kit: no worker config at nowhere/worker.yaml"),
])
def test_where_the_config_is_must_be_said_once(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err


def test_a_coordinator_that_cannot_be_reached_leaves_the_ledger_shown_and_says_why(tmp_path, capsys, monkeypatch):
    spend(tmp_path / "ledger.json")
    config = write_config(tmp_path / "worker.yaml", "ledger.json", coordinator={"target": "127.0.0.1:1"},
                          client={"token": "t" * 20})
    monkeypatch.chdir(tmp_path)
    code, out, _ = run(capsys, "--config", str(config), "--json")  # named in the config: asked by default
    view = json.loads(out)
    assert code == 0 and view["epsilon_total"] == 4.5
    assert view["coordinator"]["target"] == "127.0.0.1:1" and view["coordinator"]["error"].startswith("UNAVAILABLE")
    assert view["agreement"]["status"] == "no_record"
    assert run(capsys, "--config", str(config), "--remote")[0] == 1  # asked for: its failure is the exit code
    assert json.loads(run(capsys, "--config", str(config), "--no-remote", "--json")[1])["coordinator"] is None


def remote(recorded: float, **jobs: float) -> dict:
    return {"target": "c:1", "error": "", "epsilon_recorded": recorded,
            "jobs": [{"job_id": j, "status": "completed", "epsilon": e, "rounds": 1, "shared": []}
                     for j, e in jobs.items()]}


def local(total: float, **jobs: float) -> dict:
    return {"epsilon_total": total, "jobs": [{"job_id": j, "epsilon": e} for j, e in jobs.items()]}


def test_the_ledger_and_the_coordinators_record_are_compared_in_total_and_per_job():
    same = compare(local(3.5, a=1.0, b=2.0), remote(3.5, a=1.0, b=2.0))
    assert same["status"] == "agree" and [r["status"] for r in same["jobs"]] == ["agree", "agree"]
    # the total sums in another order: float slack is no disagreement
    assert compare(local(0.1 + 0.2 + 0.3), remote(0.3 + 0.2 + 0.1))["status"] == "agree"
    lost = compare(local(1.0, a=1.0), remote(3.0, a=1.0, b=2.0))
    assert lost["status"] == Agreement.LEDGER_BELOW and "lost or replaced ledger" in lost["message"]
    assert [(r["job_id"], r["status"]) for r in lost["jobs"]] == [("a", "agree"), ("b", "coordinator_only")]
    older = compare(local(3.0, a=1.0, b=1.5), remote(3.0, a=1.0, b=2.0))  # a job's ε fell: an older copy
    assert older["status"] == Agreement.LEDGER_BELOW and "short for job(s) b" in older["message"]
    ahead = compare(local(4.0, a=1.5, c=2.0), remote(3.5, a=1.0))
    assert ahead["status"] == Agreement.LEDGER_ABOVE and "normal" in ahead["message"]
    assert [(r["job_id"], r["status"]) for r in ahead["jobs"]] == [("a", Agreement.LEDGER_ABOVE), ("c", "ledger_only")]
    asked_only = compare(local(0.0), remote(0.0, refused=0.0))  # asked, never trained: nothing to hold
    assert asked_only["status"] == "agree" and asked_only["jobs"][0]["status"] == "agree"


def test_a_ledger_below_the_coordinators_record_exits_1_with_a_warning(tmp_path, capsys, monkeypatch):
    from fedbroker.app import ledger as command

    spend(tmp_path / "ledger.json")
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path / "worker.yaml", "ledger.json")
    monkeypatch.setattr(command, "remote_view", lambda site, target: remote(9.0, **{"job-1": 1.25, "job-2": 2.0}))
    code, out, _ = run(capsys, "--config", str(config), "--remote")
    # its training (3.25; the 1.25 of releases is the ledger's alone) against the record
    assert code == 1 and "WARNING: the ledger holds less than the coordinator recorded (ε 3.25 < 9)" in out
