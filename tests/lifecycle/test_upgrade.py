"""Upgrading a host: the state the release before schema versions wrote (fixtures/release-4eb5814, made by that
release's code) is migrated when the current code opens it, and its running job resumes and completes; the state
the release before Alembic wrote (fixtures/release-ae51aad: user_version 3, every table) is upgraded by Alembic
with every row kept."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

import fedbroker.worker.agent
from fedbroker.coordinator.store import StateStore
from fedbroker.coordinator.store_schema import HEAD, SCHEMA
from tests.faults.harness import Federation, Training

pytestmark = [pytest.mark.integration]

FIXTURE = Path(__file__).parent / "fixtures" / "release-4eb5814"
BEFORE_ALEMBIC = Path(__file__).parent / "fixtures" / "release-ae51aad" / "coordinator.sql"
JOB_ID = "faults-af58f60f"


def state_of_the_previous_release(folder: Path) -> Path:
    """The fixture's state as that release left it: `coordinator.sqlite` (user_version 0), checkpoints and the
    two sites' ledgers, laid out as tests/faults/harness.py's Federation keeps them in `folder`."""
    shutil.copytree(FIXTURE / "checkpoints", folder / "checkpoints")
    for ledger in FIXTURE.glob("w*-ledger.json*"):
        shutil.copy(ledger, folder / ledger.name)
    script = (FIXTURE / "coordinator.sql").read_text().replace("@CHECKPOINTS@", str(folder / "checkpoints"))
    db = sqlite3.connect(folder / "coordinator.sqlite")
    db.executescript(script)
    db.close()
    return folder / "coordinator.sqlite"


def test_the_fixture_is_the_unversioned_state_of_the_previous_release(tmp_path: Path) -> None:
    db = sqlite3.connect(state_of_the_previous_release(tmp_path))
    try:
        assert db.execute("PRAGMA user_version").fetchone()[0] == 0
        assert db.execute("SELECT status, rounds_done FROM jobs WHERE job_id = ?", (JOB_ID,)).fetchone() == (
            "running", 1)
        assert db.execute("SELECT round, status FROM rounds ORDER BY round").fetchall() == [(1, "closed"), (2, "open")]
    finally:
        db.close()


@pytest.mark.timeout(180)
def test_a_state_of_the_previous_release_is_migrated_and_its_running_job_resumes_to_completion(
        rabbitmq_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    training = Training()
    monkeypatch.setattr(fedbroker.worker.agent, "train_local", training)
    state_of_the_previous_release(tmp_path)
    fed = Federation(rabbitmq_url, tmp_path, start_coordinator=False)  # opens (and migrates) coordinator.sqlite
    try:
        assert fed.store.schema_version() == SCHEMA.latest
        assert fed.store.job(JOB_ID).rounds_done == 1  # nothing of the old state was lost on the way
        fed.add_worker("w0", index=0, count=2)  # the same sites, on the ledgers they kept
        fed.add_worker("w1", index=1, count=2)
        fed.start_coordinator()  # resumes the job's open round 2 (a fresh broker namespace: its tasks sent again)
        row = fed.wait_job(JOB_ID, 150)
        assert row.rounds_done == 3
        assert [r.status for r in fed.store.rounds(JOB_ID)] == ["closed"] * 3
        assert training.count == {"w0": 2, "w1": 2}  # rounds 2 and 3: round 1 is the old release's checkpoint
        kinds = [e.kind for e in fed.store.events(JOB_ID)]
        assert kinds.count("round_closed") == 3 and kinds[-1] == "completed"
        assert fed.store.workers()[0].worker_id == "w0"
    finally:
        fed.close()


def every_row(path: Path) -> dict[str, list[tuple[object, ...]]]:
    """Each table's rows (its columns in order, sorted), as another program reading the file sees them."""
    db = sqlite3.connect(path)
    try:
        names = [n for (n,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE"
                                          " 'sqlite_%' AND name != 'alembic_version' ORDER BY name")]
        return {n: sorted(db.execute(f"SELECT * FROM {n}").fetchall(), key=repr) for n in names}
    finally:
        db.close()


def test_a_state_of_the_release_before_alembic_is_upgraded_by_alembic_and_keeps_every_row(tmp_path: Path) -> None:
    path = tmp_path / "coordinator.sqlite"
    db = sqlite3.connect(path)
    db.executescript(BEFORE_ALEMBIC.read_text())
    assert db.execute("PRAGMA user_version").fetchone()[0] == 3
    db.close()
    before = every_row(path)
    assert len(before) == 17 and all(before[t] for t in ("jobs", "shares", "evaluations", "site_logs", "site_dp_rounds"))
    store = StateStore.in_directory(str(tmp_path))
    try:
        assert store.schema_version() == HEAD
        assert store.job("j-1").rounds_done == 1 and [r.status for r in store.rounds("j-1")] == ["closed", "open"]
        assert store.recorded_epsilon("w0") == 0.5 and store.recorded_epsilon("w1") == 0.2
        assert store.local_floors("w0") == {"j-1": 0.1}
        assert [c.note for c in store.epsilon_corrections("w1")] == ["audit"]
    finally:
        store.close()
    after = every_row(path)
    assert after.keys() == {*before, "leases"} and after["leases"] == []
    assert {t: after[t] for t in before} == before  # nothing lost, nothing changed
    db = sqlite3.connect(path)
    try:  # the release before reads user_version 4 > its 3: it refuses the file instead of writing it
        assert db.execute("PRAGMA user_version").fetchone()[0] == HEAD
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [(f"{HEAD:04d}",)]
    finally:
        db.close()
